# syntax=docker/dockerfile:1
#
# One image for both sides of a megatron_gspo run: the trainer (torchrun, Megatron-Core,
# Transformer Engine, NCCL) and the rollout servers (SGLang).
#
#   docker build -t megatron-gspo:0.1.0 .
#   docker run --rm megatron-gspo:0.1.0 python -m megatron_gspo.train --help
#
# How the versions fit together (tests/docker/test_dockerfile.py checks the pins against the
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

FROM nvcr.io/nvidia/pytorch:25.12-py3

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

LABEL org.opencontainers.image.title="megatron-gspo" \
      org.opencontainers.image.description="GSPO RL post-training for MoE LLMs: Megatron-Core trainer and SGLang rollout servers" \
      org.opencontainers.image.version="0.1.0"

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONSTRAINT=/etc/pip/megatron-gspo-constraints.txt

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# bubblewrap: the code reward runs generated programs in its namespaces (docs/code-sandbox.md);
# setpriv (util-linux) and libseccomp2 come with the base. tini: the ENTRYPOINT's init (below).
# Versions follow the base's Ubuntu release and its security updates, hence unpinned (DL3008).
# The base's own entry point must be where the ENTRYPOINT below runs it.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap tini \
    && rm -rf /var/lib/apt/lists/* \
    && test -x /opt/nvidia/nvidia_entrypoint.sh

# The base image constrains pip to its own torch build (/etc/pip/constraint.txt); the file written
# here replaces it, so that every later install, sglang's own resolution included, keeps these
# pins. Packages with C++/CUDA extensions built against the base's torch would fail to load (or
# load and crash) against torch 2.14.1, so they go before torch is swapped; names the base does
# not carry are skipped by pip with a warning.
# hadolint ignore=DL3059
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

# Training runs as the unprivileged user "trainer", uid and gid TRAINER_UID (USER at the end): neither the trainer nor the
# programs a code reward runs get root in the container. TRAINER_UID lets files written to mounted
# directories (outputs/) belong to the host user who starts the container; Ubuntu's default user
# gives up uid 1000 for it.
WORKDIR /workspace/megatron_gspo
ARG TRAINER_UID=1000
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && groupadd --gid "${TRAINER_UID}" trainer \
    && useradd --create-home --uid "${TRAINER_UID}" --gid trainer --shell /bin/bash trainer \
    && mkdir -p outputs \
    && chown trainer:trainer outputs

# Third-party dependencies of megatron_gspo[gpu] (sglang with its kernels, megatron-core, ...),
# resolved from setup.py alone so that editing the package's source does not invalidate this
# slow layer. A stub package stands in for the source until the next step. The versions are pinned
# in setup.py's "gpu" extra and the constraints file, which hadolint cannot see (DL3013).
COPY setup.py pyproject.toml ./
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    mkdir -p megatron_gspo \
    && touch megatron_gspo/__init__.py README.md \
    && pip install ".[gpu]" \
    && pip uninstall -y megatron_gspo \
    && rm -rf megatron_gspo README.md build ./*.egg-info

COPY . .
# Editable, so a checkout mounted over /workspace/megatron_gspo runs without reinstalling.
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import importlib.metadata as md, os, sys; \
pins = dict(line.split('==') for line in open(os.environ['PIP_CONSTRAINT']).read().split()); \
found = {name: md.version(name).split('+')[0] for name in pins}; \
drift = {name: (pins[name], found[name]) for name in pins if found[name] != pins[name]}; \
sys.exit(f'pinned version drifted (wanted, found): {drift}' if drift else 0)"

# An init as PID 1 (tini, -s: also as a subreaper under `docker run --init`, which docker_run.sh
# adds): it reaps the orphans of the trainer's process trees (every code sandbox leaves one);
# a trainer that is PID 1 itself would collect them as zombies. The base's entry point (NVIDIA's
# banner and its compatibility set-up) still runs, under tini.
ENTRYPOINT ["/usr/bin/tini", "-s", "--", "/opt/nvidia/nvidia_entrypoint.sh"]

USER ${TRAINER_UID}:${TRAINER_UID}
