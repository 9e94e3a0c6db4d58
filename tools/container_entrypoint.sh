#!/usr/bin/env bash
# The image's entry point, started by tini (the ENTRYPOINT in the Dockerfile): on the GPU flavour
# it hands the command to NVIDIA's entry point of the NGC base (its banner and CUDA compatibility
# set-up); the CPU flavour has no such file and runs the command itself. Without a command, an
# interactive shell, as NVIDIA's entry point does.
set -euo pipefail

nvidia_entrypoint=/opt/nvidia/nvidia_entrypoint.sh
if (($# == 0)); then
    set -- bash
fi
if [[ -x "$nvidia_entrypoint" ]]; then
    exec "$nvidia_entrypoint" "$@"
fi
exec "$@"
