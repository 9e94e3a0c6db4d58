#!/usr/bin/env bash
# Launch a megatron_gspo run on several nodes. Run this script once on every node, with the same
# settings and each node's own NODE_RANK (an mpirun/srun/pdsh line or the cluster scheduler does).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

script_dir="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$script_dir/common.sh"

usage() {
    cat <<'EOF'
Usage: examples/moe/launch_multi_node.sh [options] [key=value ...]

On every node, runs
  torchrun --nnodes NNODES --node_rank NODE_RANK --nproc_per_node GPUS \
           --rdzv_backend c10d --rdzv_endpoint MASTER_ADDR:MASTER_PORT --rdzv_id RDZV_ID \
           -m megatron_gspo.train --preset PRESET key=value ...

Settings (environment variable, or the option):
  NNODES        --nnodes N          number of nodes (Slurm: SLURM_NNODES)
  NODE_RANK     --node-rank R       this node's index, 0..NNODES-1 (Slurm: SLURM_NODEID)
  MASTER_ADDR   --master-addr HOST  address of the node that hosts the rendezvous (e.g. node 0)
  MASTER_PORT   --master-port PORT  its port (default: 29500)
  NODE_HOSTS    --node-hosts LIST   comma-separated addresses of all nodes, in NODE_RANK order;
                                    needed for colocated SGLang (the trainer talks to every
                                    node's server). Slurm:
                                    NODE_HOSTS=$(scontrol show hostnames | paste -sd,)
  GPUS_PER_NODE --gpus N            trainer processes per node (default: 8)
  RDZV_ID       --rdzv-id ID        rendezvous id, the same on all nodes (default: megatron_gspo)
  SGLANG_URLS   --sglang-url URL    dedicated servers (comma-separated / repeatable option)
  MEGATRON_GSPO_SGLANG_API_KEY      the SGLang servers' --api-key, the same on every node:
                                    required for colocated SGLang, and for dedicated servers
                                    started with a key (sglang_server.sh uses it)

Options:
  --preset NAME|PATH    preset in examples/moe/ or a YAML path (default: qwen3_30b_a3b_gspo_4node)
  --sglang MODE         colocated (default when the preset's rollout.engine is sglang): every node
                        starts one SGLang server on its own GPUs (--enable-memory-saver), listening
                        on its NODE_HOSTS address, and the trainer gets all of them;
                        dedicated: servers on other machines (sglang_server.sh), given by
                        SGLANG_URLS / --sglang-url, weights by NCCL broadcast unless the preset
                        says disk; none: the preset's rollout engine as it is
  --sglang-port PORT    port of the colocated servers (default: the preset's rollout.sglang.port)
  --sglang-timeout SEC  how long to wait for the colocated server to answer (default: 1800)
  --dry-run             print the commands instead of running them
  -h, --help            this help

key=value arguments are Hydra overrides for the trainer. output_dir must be on storage shared by
all nodes (every rank writes its checkpoint shards there); each node's SGLang log goes to
OUTPUT_DIR/sglang/node<RANK>.log.

Example, 4 nodes (run on each node with its NODE_RANK):
  NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 NODE_HOSTS=node0,node1,node2,node3 \
    examples/moe/launch_multi_node.sh --preset qwen3_30b_a3b_gspo_4node data.train_path=/data/math.jsonl
EOF
}

parse_launch_args true usage "$@"
PRESET="${PRESET:-qwen3_30b_a3b_gspo_4node}"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "set NNODES (or --nnodes) to the number of nodes, got '$NNODES'"
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || ((NODE_RANK >= NNODES)); then
    die "set NODE_RANK (or --node-rank) to this node's index in 0..$((NNODES - 1)), got '$NODE_RANK'"
fi
[[ -n "$MASTER_ADDR" ]] || die "set MASTER_ADDR (or --master-addr) to the address of the rendezvous node, e.g. node 0"

read_config "$PRESET" "$((NNODES * GPUS_PER_NODE))" "${OVERRIDES[@]}"
default_sglang_mode

colocated_urls=()
if [[ "$SGLANG_MODE" == colocated ]]; then
    [[ -n "$NODE_HOSTS" ]] || die "colocated SGLang on several nodes needs NODE_HOSTS (or --node-hosts): the addresses of all nodes, comma-separated, in NODE_RANK order"
    IFS=, read -r -a node_hosts <<<"$NODE_HOSTS"
    ((${#node_hosts[@]} == NNODES)) || die "NODE_HOSTS lists ${#node_hosts[@]} addresses for NNODES=$NNODES nodes"
    for host in "${node_hosts[@]}"; do
        colocated_urls+=("http://$host:$SGLANG_PORT")
    done
    # Listen on this node's cluster address only (HTTP carries the key and the weights in the
    # clear), and require the key every node shares.
    sglang_host="${SGLANG_BIND_HOST:-${node_hosts[$NODE_RANK]}}"
    sglang_api_key true
fi
rollout_overrides_for "$SGLANG_MODE" "${colocated_urls[@]}"

# c10d rendezvous: the nodes meet at MASTER_ADDR:MASTER_PORT and torchrun assigns global ranks,
# node by node (local ranks of a node stay contiguous); --node_rank is kept for readability.
train_command=(
    env CUDA_DEVICE_MAX_CONNECTIONS=1
    "$TORCHRUN" --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE"
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID"
    -m megatron_gspo.train --preset "$PRESET"
    "${ROLLOUT_OVERRIDES[@]}" "${OVERRIDES[@]}"
)
# CUDA_DEVICE_MAX_CONNECTIONS=1 is for Megatron-Core's communication/compute ordering, trainer only.

# Each node waits for its own colocated server; torchrun's rendezvous then waits for every node,
# so all servers answer before the first rollout.
run_trainer "${sglang_host:-}" "$CFG_OUTPUT_DIR/sglang/node$NODE_RANK.log" \
    "node $NODE_RANK/$NNODES: starting the trainer" "${train_command[@]}"
