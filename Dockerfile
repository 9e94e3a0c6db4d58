# syntax=docker/dockerfile:1
#
# One image for both sides of a megatron_gspo run: the trainer (torchrun, Megatron-Core,
# Transformer Engine, NCCL) and the rollout servers (SGLang). Two flavours from this one file:
#
#   docker build -t megatron-gspo:0.1.0 .                                  # GPU (the default)
#   docker build --build-arg FLAVOUR=cpu -t megatron-gspo:0.1.0-cpu .      # CPU, no CUDA
#   docker run --rm megatron-gspo:0.1.0 python -m megatron_gspo.train --help
#
# The stages: "gpu-base" (NGC PyTorch, torch swapped for the version SGLang needs, Transformer
# Engine, optional apex) and "cpu-base" (Debian bookworm's Python 3.11 in a venv, torch's CPU
# build, the CPU CI's pins from constraints.txt) each prepare Python, torch and a constraints file
# at PIP_CONSTRAINT; the last stage, built FROM the one FLAVOUR names, holds every step the two
# share (the sandbox's packages, the init, the user, the project and its dependencies), written
# once. Builders that skip unused stages (BuildKit, buildah/podman) never touch the other base:
# FLAVOUR=cpu builds without access to nvcr.io. tools/container_image.sh builds the CPU flavour
# with podman from a local Debian root file system (examples/moe/README.md, "Containers here").
#
# How the GPU versions fit together (tests/docker/test_dockerfile.py checks the pins against the
# "gpu" extra of setup.py):
#   * Base: NGC PyTorch 25.12 (Ubuntu 24.04, Python 3.12, CUDA 13.1, cuDNN, NCCL, HPC-X and the
#     InfiniBand user space that multi-node NCCL needs). Python 3.12 is what megatron-core 0.17+
#     requires.
#   * torch 2.14.1: sglang 0.5.23 pins torch==2.14.1 and CUDA 13 kernels (flashinfer[cu13],
#     sglang-kernel 0.4.10), so the base's NVIDIA build of torch (2.10.0a0) cannot stay. It is
#     replaced by the PyTorch cu130 wheel, and every package compiled against the old torch
#     (Transformer Engine, apex, torchvision, ...) is removed and, where needed, rebuilt below.
#   * Transformer Engine 2.12.0: the newest TE that megatron-core 0.17.1 checks for
#     (is_te_min_version("2.12.0")); its PyTorch extension is compiled against torch 2.14.1.
#     Megatron-Core takes its fused Adam and multi-tensor kernels from TE, so apex is optional
#     (APEX_REF below).
#   * megatron-core 0.17.1: a 0.17 patch release (0.17+ needs Python 3.12), the smallest step from
#     the CPU CI's 0.16.1 (the newest for Python 3.11); the package must work with both, and CI
#     tests both (.ci/run: job py312 runs this torch and megatron-core, constraints-py312.txt).
#     setup.py admits <0.18 only: 0.19 (GPTModel deprecated for HybridModel) is not supported yet,
#     for the reasons in docs/architecture.md, "megatron-core versions".
# The CPU versions are constraints.txt's, exactly what the CPU CI job (Python 3.11) runs: torch
# 2.13.0 from PyTorch's CPU index, megatron-core 0.16.1.

# gpu or cpu: which base stage the image is built on.
ARG FLAVOUR=gpu
# Base of the CPU flavour: a Debian bookworm image (its python3.11 package is the Python of the
# CPU CI). tools/container_image.sh passes a root file system it built with debootstrap, where no
# registry can be reached.
ARG CPU_BASE=debian:bookworm-slim

FROM nvcr.io/nvidia/pytorch:25.12-py3 AS gpu-base

ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
ARG TORCHAUDIO_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG TRANSFORMER_ENGINE_VERSION=2.12.0
ARG MEGATRON_CORE_VERSION=0.17.1
ARG SGLANG_VERSION=0.5.23
# Git ref of NVIDIA/apex to build; empty (the default) leaves apex out.
ARG APEX_REF=""
# GPU architectures compiled into Transformer Engine's extension: A100, H100/H200, B200.
ARG NVTE_CUDA_ARCHS="80;90;100"
ARG MAX_JOBS=8

# MEGATRON_GSPO_EXTRAS: the extra of setup.py the last stage installs with the project.
ENV PIP_CONSTRAINT=/etc/pip/megatron-gspo-constraints.txt \
    MEGATRON_GSPO_EXTRAS=gpu

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The base image constrains pip to its own torch build (/etc/pip/constraint.txt); the file written
# here replaces it, so that every later install, sglang's own resolution included, keeps these
# pins. Packages with C++/CUDA extensions built against the base's torch would fail to load (or
# load and crash) against torch 2.14.1, so they go before torch is swapped; names the base does
# not carry are skipped by pip with a warning. The image's entry script runs the base's own entry
# point (NVIDIA's banner and its compatibility set-up): it must be there.
RUN --mount=type=cache,target=/root/.cache/pip \
    printf '%s\n' \
        "torch==${TORCH_VERSION}" \
        "torchvision==${TORCHVISION_VERSION}" \
        "torchaudio==${TORCHAUDIO_VERSION}" \
        "transformer-engine==${TRANSFORMER_ENGINE_VERSION}" \
        "transformer-engine-cu13==${TRANSFORMER_ENGINE_VERSION}" \
        "transformer-engine-torch==${TRANSFORMER_ENGINE_VERSION}" \
        "megatron-core==${MEGATRON_CORE_VERSION}" \
        "sglang==${SGLANG_VERSION}" \
        > "${PIP_CONSTRAINT}" \
    && test -x /opt/nvidia/nvidia_entrypoint.sh \
    && pip uninstall -y \
        torch torchvision torchaudio torch-tensorrt torchao nvfuser lightning-thunder \
        transformer-engine transformer-engine-cu12 transformer-engine-cu13 \
        transformer-engine-torch apex flash-attn flash-attn-3 megatron-core \
    && pip install --index-url "${TORCH_INDEX_URL}" \
        "torch==${TORCH_VERSION}" \
        "torchvision==${TORCHVISION_VERSION}" \
        "torchaudio==${TORCHAUDIO_VERSION}"

# Transformer Engine: the core library is a CUDA 13 wheel; the PyTorch extension is an sdist that
# must compile against the torch installed above, hence --no-build-isolation (nvcc and cuDNN
# headers come from the base image). A layer of its own: it is the slowest step of the build.
# hadolint ignore=DL3059
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install "pybind11==3.0.1" "ninja==1.13.0" \
    && NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
       pip install --no-build-isolation \
        "transformer-engine[core_cu13,pytorch]==${TRANSFORMER_ENGINE_VERSION}"

# hadolint ignore=DL3059
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ -n "${APEX_REF}" ]; then \
        APEX_CPP_EXT=1 APEX_CUDA_EXT=1 MAX_JOBS="${MAX_JOBS}" \
        pip install --no-build-isolation "git+https://github.com/NVIDIA/apex.git@${APEX_REF}"; \
    fi

FROM ${CPU_BASE} AS cpu-base

# The venv's pip, not Debian's: bookworm's system Python refuses pip installs (PEP 668).
# MEGATRON_GSPO_EXTRAS: none, the CPU flavour runs the package's own requirements.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PIP_CONSTRAINT=/etc/pip/megatron-gspo-constraints.txt \
    MEGATRON_GSPO_EXTRAS=""

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# python3.11 by name: a CPU_BASE without it (another Debian release, Ubuntu 24.04) stops here
# instead of building an image whose Python the CPU CI never tested. Versions follow the base's
# Debian release and its security updates, hence unpinned (DL3008).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3.11 python3.11-venv \
    && rm -rf /var/lib/apt/lists/*

# The CPU CI's pins (torch 2.13.0, megatron-core 0.16.1, transformers, ...), one file for both:
# torch's version is read from it (hadolint cannot see that pin: DL3013), so the image and CI
# cannot disagree. Only the CPU build of torch comes from PyTorch's index (PyPI's Linux wheel is
# the CUDA build with ~3 GB of nvidia-* packages); with it installed, pip keeps it for every later
# install. Its own dependencies (sympy, networkx, ...) come from PyPI with the project's, under
# the same constraints (--no-deps here), so that the index only has to serve torch itself.
COPY constraints.txt ${PIP_CONSTRAINT}
# Declared here, where it is used: podman (buildah) counts an ARG in the cache key of every later
# step of the stage, so the apt layer above stays cached whatever index a build names.
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    python3.11 -m venv "${VIRTUAL_ENV}" \
    && torch_pin="$(grep -E '^torch==' "${PIP_CONSTRAINT}")" \
    && pip install --no-deps --index-url "${TORCH_CPU_INDEX_URL}" "${torch_pin}"

# The stage FLAVOUR names: every step below is shared by both flavours.
FROM ${FLAVOUR}-base AS image

LABEL org.opencontainers.image.title="megatron-gspo" \
      org.opencontainers.image.description="GSPO RL post-training for MoE LLMs: Megatron-Core trainer and SGLang rollout servers" \
      org.opencontainers.image.version="0.1.0"

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# bubblewrap and libseccomp2: the code reward runs generated programs in bubblewrap's namespaces
# under a seccomp filter (docs/code-sandbox.md); setpriv (util-linux) comes with both bases.
# tini: the ENTRYPOINT's init (below). Versions follow the base's release and its security
# updates, hence unpinned (DL3008).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap libseccomp2 tini \
    && rm -rf /var/lib/apt/lists/*

# Runs NVIDIA's entry point where the base has one (GPU), the command itself otherwise (CPU).
COPY tools/container_entrypoint.sh /usr/local/bin/megatron-gspo-entrypoint

# Training runs as the unprivileged user "trainer", uid and gid TRAINER_UID (USER at the end): neither the trainer nor the
# programs a code reward runs get root in the container. TRAINER_UID lets files written to mounted
# directories (outputs/) belong to the host user who starts the container; Ubuntu's default user
# gives up uid 1000 for it (Debian's base has none).
WORKDIR /workspace/megatron_gspo
ARG TRAINER_UID=1000
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && groupadd --gid "${TRAINER_UID}" trainer \
    && useradd --create-home --uid "${TRAINER_UID}" --gid trainer --shell /bin/bash trainer \
    && mkdir -p outputs \
    && chown trainer:trainer outputs

# Third-party dependencies of megatron_gspo (with the flavour's extra: sglang with its kernels and
# megatron-core 0.17.1 for gpu, none for cpu), resolved from setup.py alone so that editing the
# package's source does not invalidate this slow layer. A stub package stands in for the source
# until the next step. The versions are pinned in setup.py's "gpu" extra and the constraints file
# at PIP_CONSTRAINT, which hadolint cannot see (DL3013).
COPY setup.py pyproject.toml ./
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    mkdir -p megatron_gspo \
    && touch megatron_gspo/__init__.py README.md \
    && pip install ".${MEGATRON_GSPO_EXTRAS:+[${MEGATRON_GSPO_EXTRAS}]}" \
    && pip uninstall -y megatron_gspo \
    && rm -rf megatron_gspo README.md build ./*.egg-info

COPY . .
# Editable, so a checkout mounted over /workspace/megatron_gspo runs without reinstalling. Then
# the pins and the requirements of the project and of torch are checked against what is installed
# (tools/check_image_pins.py says what it checks).
RUN pip install --no-cache-dir --no-deps -e . \
    && python tools/check_image_pins.py

# An init as PID 1 (tini, -s: also as a subreaper under `docker run --init`, which docker_run.sh
# adds): it reaps the orphans of the trainer's process trees (every code sandbox leaves one);
# a trainer that is PID 1 itself would collect them as zombies.
ENTRYPOINT ["/usr/bin/tini", "-s", "--", "/usr/local/bin/megatron-gspo-entrypoint"]

USER ${TRAINER_UID}:${TRAINER_UID}
