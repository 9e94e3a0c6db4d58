#!/usr/bin/env bash
# Start one SGLang rollout server with the settings of a preset, in the foreground.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

script_dir="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$script_dir/common.sh"

usage() {
    cat <<'EOF'
Usage: examples/moe/sglang_server.sh [options] [key=value ...] [-- sglang-arg ...]

Starts `python -m sglang.launch_server` for the model and SGLang settings of a preset
(model.hf_path, rollout.sglang.tp / ep / mem_fraction / extra_args;
--enable-return-routed-experts when algo.routing_replay=r3), with the command the trainer itself
builds (megatron_gspo/rollout/sglang_launcher.py). Use it on dedicated rollout nodes; the trainer
then gets the servers' URLs (launch_*.sh --sglang dedicated --sglang-url URL). The launch scripts
start colocated servers with the same command.

Options:
  --preset NAME|PATH   preset in examples/moe/ or a YAML path (default: qwen3_30b_a3b_gspo_1node)
  --host HOST          address to listen on (default: 0.0.0.0, so trainer nodes can reach it)
  --port PORT          port (default: the preset's rollout.sglang.port)
  --colocated          the server shares its GPUs with the trainer: add --enable-memory-saver
                       so the trainer can release its memory (rollout.sglang.release_memory)
  --dry-run            print the command instead of running it
  -h, --help           this help

key=value arguments are Hydra overrides of the preset (rollout.sglang.tp=4, ...); arguments after
`--` go to sglang.launch_server unchanged (e.g. -- --base-gpu-id 4 --moe-a2a-backend deepep).
Select GPUs with CUDA_VISIBLE_DEVICES. Set MEGATRON_GSPO_SGLANG_API_KEY (the same for the
trainer): the server then refuses calls without it (SGLang's --api-key, handed over in a private
--config file that is removed once the server answers: never on a command line). HTTP carries the key and the
weights in the clear, so bind the server to a network that only the cluster can reach.

Example (one 8-GPU rollout node for the 4-node GSPO preset):
  examples/moe/sglang_server.sh --preset qwen3_30b_a3b_gspo_4node --port 30000
EOF
}

preset=qwen3_30b_a3b_gspo_1node
host=0.0.0.0
port=""
colocated=false
dry_run=false
overrides=()
sglang_args=()
while (($#)); do
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
        --preset)
            preset="${2:?--preset needs a value}"
            shift 2
            ;;
        --host)
            host="${2:?--host needs a value}"
            shift 2
            ;;
        --port)
            port="${2:?--port needs a value}"
            shift 2
            ;;
        --colocated)
            colocated=true
            shift
            ;;
        --dry-run)
            dry_run=true
            shift
            ;;
        --)
            shift
            sglang_args=("$@")
            break
            ;;
        *=*)
            overrides+=("$1")
            shift
            ;;
        *)
            usage >&2
            die "unknown argument '$1'"
            ;;
    esac
done

read_config "$preset" 0 "${overrides[@]}"
if [[ -z "${MEGATRON_GSPO_SGLANG_API_KEY:-}" ]]; then
    log "warning: MEGATRON_GSPO_SGLANG_API_KEY is not set: the server accepts calls from anyone who can reach $host (weight updates included)"
fi
port="${port:-$CFG_SGLANG_PORT}"
build_sglang_command "$host" "$port" "$colocated" "${sglang_args[@]}"
add_sglang_key_file "$dry_run"
if [[ "$dry_run" == true ]]; then
    print_command "${SGLANG_COMMAND[@]}"
    exit 0
fi
if [[ -z "${SGLANG_KEY_FILE:-}" ]]; then
    exec "${SGLANG_COMMAND[@]}"
fi
# The key file goes once the server answers (it has read it by then); the script stays the
# server's parent meanwhile and passes a Ctrl-C or TERM on to it.
"${SGLANG_COMMAND[@]}" &
server=$!
trap 'kill -TERM "$server" 2>/dev/null || true' INT TERM
trap remove_sglang_key_file EXIT
until "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health_generate", timeout=30).read()' "http://$host:$port" 2>/dev/null; do
    kill -0 "$server" 2>/dev/null || break
    sleep "${SGLANG_POLL_SECONDS:-5}"
done
remove_sglang_key_file
wait "$server"
