#!/usr/bin/env bash
# Run a command (a launch script, by default) inside the megatron_gspo image with what a multi-GPU,
# multi-node run needs: all GPUs, the host's IPC namespace and network, InfiniBand devices and
# unlimited locked memory, the model/data/output directories mounted.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: examples/moe/docker_run.sh [--dry-run] [COMMAND ARG ...]

Runs COMMAND (default: examples/moe/launch_single_node.sh) in the image:
  docker run --rm --init --gpus all --ipc=host --network host --ulimit memlock=-1 ... IMAGE COMMAND ...

Environment:
  IMAGE        image to run (default: megatron-gspo:0.1.0, built with `docker build -t megatron-gspo:0.1.0 .`)
  MODELS_DIR   host directory mounted read-only at /models (default: /models)
  DATA_DIR     host directory mounted read-only at /data (default: /data)
  OUTPUT_ROOT  host directory mounted at /workspace/megatron_gspo/outputs, where presets write
               (default: ./outputs; on several nodes, a shared file system)
  CODE_SANDBOX=1  let the code reward's sandbox (bubblewrap) make user namespaces in the container:
               --security-opt seccomp=unconfined, apparmor=unconfined, systempaths=unconfined
               (Docker's defaults refuse them; the sandbox then fails closed at start). See
               docs/code-sandbox.md for what this trades.
  NNODES NODE_RANK MASTER_ADDR MASTER_PORT NODE_HOSTS GPUS_PER_NODE SGLANG_URLS RDZV_ID
  MEGATRON_GSPO_OVERRIDES MEGATRON_GSPO_SGLANG_API_KEY WANDB_API_KEY HF_HUB_OFFLINE
  CUDA_VISIBLE_DEVICES and every NCCL_*, TORCH_NCCL_* and UCX_* variable are passed through when
  set.

The image runs as the unprivileged user "trainer" (uid 1000 unless built with
--build-arg TRAINER_UID=...): OUTPUT_ROOT must be writable by that uid.

Why the flags: --init starts the command under an init process that reaps orphaned processes
(without it the trainer is PID 1 and collects them as zombies); --ipc=host gives NCCL and PyTorch the host's shared memory (Docker's default
64 MB /dev/shm is far too small); --network host lets torchrun, NCCL and the SGLang
servers reach the other nodes at their own addresses; /dev/infiniband and memlock=-1 let NCCL use
RDMA.

Examples:
  IMAGE=megatron-gspo:0.1.0 examples/moe/docker_run.sh \
      examples/moe/launch_single_node.sh data.train_path=/data/math.jsonl
  NNODES=4 NODE_RANK=1 MASTER_ADDR=node0 NODE_HOSTS=node0,node1,node2,node3 OUTPUT_ROOT=/shared/runs \
      examples/moe/docker_run.sh examples/moe/launch_multi_node.sh --preset qwen3_30b_a3b_gspo_4node
EOF
}

dry_run=false
case "${1:-}" in
    -h | --help)
        usage
        exit 0
        ;;
    --dry-run)
        dry_run=true
        shift
        ;;
esac
if (($# == 0)); then
    set -- examples/moe/launch_single_node.sh
fi

image="${IMAGE:-megatron-gspo:0.1.0}"
output_root="${OUTPUT_ROOT:-$PWD/outputs}"
docker_command=(
    docker run --rm --init --gpus all --ipc=host --network host
    --ulimit memlock=-1 --ulimit stack=67108864
    -v "${MODELS_DIR:-/models}:/models:ro"
    -v "${DATA_DIR:-/data}:/data:ro"
    -v "$output_root:/workspace/megatron_gspo/outputs"
)
if [[ "${CODE_SANDBOX:-}" == 1 ]]; then
    docker_command+=(--security-opt seccomp=unconfined --security-opt apparmor=unconfined
        --security-opt systempaths=unconfined)
fi
if [[ -e /dev/infiniband ]]; then
    docker_command+=(--device /dev/infiniband --cap-add IPC_LOCK)
fi
if [[ -t 0 && -t 1 ]]; then
    docker_command+=(-it)
fi
# `-e NAME` copies the variable's value from this environment without putting it on the command
# line (WANDB_API_KEY stays out of `ps` and of the dry-run output).
for name in NNODES NODE_RANK MASTER_ADDR MASTER_PORT NODE_HOSTS GPUS_PER_NODE SGLANG_URLS \
    RDZV_ID MEGATRON_GSPO_OVERRIDES MEGATRON_GSPO_SGLANG_API_KEY WANDB_API_KEY HF_HUB_OFFLINE \
    SLURM_NNODES SLURM_NODEID CUDA_VISIBLE_DEVICES; do
    if [[ -n "${!name:-}" ]]; then
        docker_command+=(-e "$name")
    fi
done
while IFS= read -r name; do
    docker_command+=(-e "$name")
done < <(compgen -e | grep -E '^(NCCL|TORCH_NCCL|UCX)_' || true)
docker_command+=("$image" "$@")

if [[ "$dry_run" == true ]]; then
    printf '%q ' "${docker_command[@]}"
    printf '\n'
    exit 0
fi
mkdir -p "$output_root"
exec "${docker_command[@]}"
