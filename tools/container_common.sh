# shellcheck shell=bash
# What tools/container_image.sh and tools/container_rehearsal.sh share: the podman set-up of this
# kind of machine, logging and stage timing. Sourced, not run.
#
# Why the set-up is what it is (examples/moe/README.md, "Containers here"):
#   * podman, no daemon: these machines run no Docker engine; podman builds the same Dockerfile.
#   * runc: crun (podman's default) refuses this host's hybrid cgroup hierarchy.
#   * containers.conf with `default_ulimits = []`: the machine drops CAP_SYS_RESOURCE, so the
#     ulimits podman sets on every container by default cannot be set and every start fails.
#   * --network host: containers share the host's network (loopback included), which the
#     two-node rendezvous and the local torch index of the build need.

CONTAINER_CACHE_DIR="${CONTAINER_CACHE_DIR:-/var/cache/megatron-gspo-container}"
CONTAINER_IMAGE="${CONTAINER_IMAGE:-localhost/megatron-gspo:0.1.0-cpu}"
CONTAINER_BASE_IMAGE="${CONTAINER_BASE_IMAGE:-localhost/megatron-gspo-debian:bookworm}"
CONTAINER_PACKAGES=(podman runc debootstrap)

container_log() {
    printf '[%s] %s\n' "${CONTAINER_LOG_NAME:-container}" "$*" >&2
}

container_die() {
    printf '[%s] error: %s\n' "${CONTAINER_LOG_NAME:-container}" "$*" >&2
    exit 1
}

# STAGE_NAMES / STAGE_SECONDS: the stages run so far, in order, with their wall times.
STAGE_NAMES=()
STAGE_SECONDS=()
CURRENT_STAGE=""
STAGE_START=""

seconds_since() {
    awk -v start="$1" -v end="$(date +%s.%N)" 'BEGIN { printf "%.0f", end - start }'
}

# run_stage NAME COMMAND...: runs COMMAND and records its wall time. COMMAND runs under errexit
# (it is not called in a `||` list, where bash would switch errexit off inside functions): its
# first failing command ends the script, and container_on_exit names the stage.
run_stage() {
    local name="$1"
    shift
    CURRENT_STAGE="$name"
    STAGE_START=$(date +%s.%N)
    container_log "stage $name: starting"
    "$@"
    STAGE_NAMES+=("$name")
    STAGE_SECONDS+=("$(seconds_since "$STAGE_START")")
    container_log "stage $name: done in ${STAGE_SECONDS[-1]} s"
    CURRENT_STAGE=""
}

# container_on_exit: the EXIT trap of both scripts. On failure it names the stage that failed and
# prints the times of the stages before it; then it calls container_cleanup when the script
# defines one (containers, servers).
container_on_exit() {
    local status=$?
    if ((status != 0)) && [[ -n "$CURRENT_STAGE" ]]; then
        container_log "stage $CURRENT_STAGE FAILED (exit status $status) after $(seconds_since "$STAGE_START") s"
        print_stage_times
    fi
    if declare -F container_cleanup >/dev/null; then
        container_cleanup || true
    fi
    exit "$status"
}

print_stage_times() {
    local index
    container_log "wall time per stage:"
    for index in "${!STAGE_NAMES[@]}"; do
        printf '  %-22s %6s s\n' "${STAGE_NAMES[index]}" "${STAGE_SECONDS[index]}" >&2
    done
}

# container_setup: installs podman, runc and debootstrap when one is missing (apt-get, as root),
# writes the containers.conf this machine needs and exports CONTAINERS_CONF for every podman call.
container_setup() {
    local missing=() package
    for package in "${CONTAINER_PACKAGES[@]}"; do
        command -v "$package" >/dev/null 2>&1 || missing+=("$package")
    done
    if ((${#missing[@]})); then
        [[ "$(id -u)" == 0 ]] || container_die "missing ${missing[*]}; install them as root: apt-get install -y ${CONTAINER_PACKAGES[*]}"
        command -v apt-get >/dev/null 2>&1 || container_die "missing ${missing[*]} and no apt-get to install them with"
        container_log "installing ${CONTAINER_PACKAGES[*]} (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${CONTAINER_PACKAGES[@]}" >/dev/null
    fi
    mkdir -p "$CONTAINER_CACHE_DIR"
    printf '[containers]\ndefault_ulimits = []\n' >"$CONTAINER_CACHE_DIR/containers.conf"
    export CONTAINERS_CONF="$CONTAINER_CACHE_DIR/containers.conf"
    mkdir -p "$CONTAINER_CACHE_DIR/tmp"
    podman --runtime runc info >/dev/null || container_die "podman cannot start (podman --runtime runc info failed; see above)"
}

# podman_ ARGS...: podman with the runtime this machine needs. podman build keeps its
# RUN --mount=type=cache directories under TMPDIR (buildah-cache): inside the cache directory, so
# that --no-cache can drop them without touching anyone else's.
podman_() {
    TMPDIR="$CONTAINER_CACHE_DIR/tmp" podman --runtime runc "$@"
}
