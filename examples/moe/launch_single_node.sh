#!/usr/bin/env bash
# Launch a megatron_gspo run on one node: torchrun over its GPUs, with SGLang colocated on the same
# GPUs, on other machines, or not at all.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

script_dir="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$script_dir/common.sh"

usage() {
    cat <<'EOF'
Usage: examples/moe/launch_single_node.sh [options] [key=value ...]

Runs `torchrun --standalone --nproc_per_node GPUS -m megatron_gspo.train --preset PRESET key=value ...`.

Options:
  --preset NAME|PATH    preset in examples/moe/ or a YAML path (default: qwen3_30b_a3b_gspo_1node)
  --gpus N              trainer processes, one per GPU (default: $GPUS_PER_NODE or 8)
  --sglang MODE         where the rollout servers run (default: colocated if the preset's
                        rollout.engine is sglang, none otherwise):
                          colocated  start one SGLang server on this node's GPUs with
                                     --enable-memory-saver, wait until it answers, and let the
                                     trainer release its memory while it trains
                                     (rollout.sglang.release_memory=true, weights by CUDA IPC)
                          dedicated  use servers already running elsewhere (sglang_server.sh on
                                     other machines): --sglang-url, or SGLANG_URLS=url1,url2;
                                     weights go by NCCL broadcast unless the preset says disk
                          none       the preset's rollout engine as it is (CPU presets)
  --sglang-url URL      a dedicated server, e.g. http://rollout-0:30000 (repeatable)
  --sglang-port PORT    port of the colocated server (default: the preset's rollout.sglang.port)
  --sglang-timeout SEC  how long to wait for the colocated server to answer (default: 1800)
  --dry-run             print the commands instead of running them
  -h, --help            this help

key=value arguments are Hydra overrides, passed to the trainer (and used to start SGLang):
  data.train_path=/data/train.jsonl model.hf_path=/models/Qwen3-30B-A3B resume=true
The colocated server's log goes to OUTPUT_DIR/sglang/node0.log.

Examples:
  examples/moe/launch_single_node.sh data.train_path=/data/math.jsonl
  examples/moe/launch_single_node.sh --preset cpu_tiny_4proc --gpus 4 --sglang none
  examples/moe/launch_single_node.sh --sglang dedicated --sglang-url http://rollout-0:30000
EOF
}

parse_launch_args false usage "$@"
PRESET="${PRESET:-qwen3_30b_a3b_gspo_1node}"
read_config "$PRESET" "$GPUS_PER_NODE" "${OVERRIDES[@]}"
default_sglang_mode
# On one node nothing else needs to reach the colocated server: it listens on loopback only, and
# requires a key made for this run (unless MEGATRON_GSPO_SGLANG_API_KEY is set) that the trainer
# inherits.
if [[ "$SGLANG_MODE" == colocated ]]; then
    sglang_api_key false
fi
rollout_overrides_for "$SGLANG_MODE" "http://127.0.0.1:$SGLANG_PORT"

# Hydra lets the last override win, so the user's own key=value arguments come last.
train_command=(
    env CUDA_DEVICE_MAX_CONNECTIONS=1
    "$TORCHRUN" --standalone --nnodes 1 --nproc_per_node "$GPUS_PER_NODE"
    -m megatron_gspo.train --preset "$PRESET"
    "${ROLLOUT_OVERRIDES[@]}" "${OVERRIDES[@]}"
)
# CUDA_DEVICE_MAX_CONNECTIONS=1: Megatron-Core relies on one CUDA hardware queue to order its
# tensor/sequence-parallel communication with compute; it is set for the trainer only, since the
# rollout server gains nothing from that limit.

run_trainer 127.0.0.1 "$CFG_OUTPUT_DIR/sglang/node0.log" "starting the trainer" \
    "${train_command[@]}"
