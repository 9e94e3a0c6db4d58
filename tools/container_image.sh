#!/usr/bin/env bash
# Build the image's CPU flavour here, with podman, from a Debian bookworm root file system that
# debootstrap makes from Debian's package mirror: no container registry is needed (none can be
# reached from these machines). examples/moe/README.md, "Containers here", has the measured times.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

script_dir="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd -- "$script_dir/.." && pwd)"
CONTAINER_LOG_NAME=container_image
# shellcheck source=container_common.sh
source "$script_dir/container_common.sh"

usage() {
    cat <<'EOF'
Usage: tools/container_image.sh [options]

Builds the repository's Dockerfile with podman:
  1. setup:  installs podman, runc and debootstrap when missing (apt-get, as root), writes
             CACHE_DIR/containers.conf ([containers] default_ulimits = []) for CONTAINERS_CONF;
  2. base:   debootstraps Debian bookworm (--variant=minbase, plus ca-certificates) into
             CACHE_DIR/rootfs-bookworm, reused when a complete one is there, adds this machine's
             extra CA certificates (/usr/local/share/ca-certificates) so that pip and apt trust
             the same egress as the host, and imports it as the base image (BASE);
  3. build:  podman build --build-arg FLAVOUR=cpu --build-arg CPU_BASE=BASE -t IMAGE, with
             torch's CPU wheel from PyTorch's CPU index, or, where that index cannot be reached,
             from a local copy served on 127.0.0.1 (--torch-wheel-dir).

Options:
  --cache-dir DIR        root file system, containers.conf, build cache (default:
                         /var/cache/megatron-gspo-container, or CONTAINER_CACHE_DIR)
  --image NAME           tag of the built image (default: localhost/megatron-gspo:0.1.0-cpu,
                         or CONTAINER_IMAGE)
  --flavour cpu|gpu      gpu tries the GPU flavour (it stops where its NGC base image cannot be
                         pulled) and prints how far it got (default: cpu)
  --torch-wheel-dir DIR  directory holding torch's CPU wheel (torch-VERSION+cpu-cp311-...whl),
                         served to the build over loopback; default: PyTorch's CPU index when it
                         answers, else the first of pip's find-links directories holding the wheel
  --torch-port PORT      loopback port of that local index (default: 38170; the same port keeps
                         podman's cached layers valid, as the index URL is a build argument)
  --no-cache             rebuild every layer (the root file system cache is kept) and drop the
                         build's pip cache: the time of a fresh build on a machine with the base
  --from-scratch         --no-cache, and also debootstrap again and re-import the base: the time
                         of a fresh machine
  -h, --help             this help

The image is built as root's podman image (/var/lib/containers/storage); nothing is written into
the repository. tools/container_rehearsal.sh runs the image (CPU demo, two-node torchrun with kill
and resume, the code sandbox, an HF export).
EOF
}

flavour=cpu
torch_wheel_dir="${TORCH_WHEEL_DIR:-}"
torch_port=38170
no_cache=false
from_scratch=false
while (($#)); do
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
        --cache-dir | --image | --flavour | --torch-wheel-dir | --torch-port)
            (($# >= 2)) || container_die "$1 needs a value"
            case "$1" in
                --cache-dir) CONTAINER_CACHE_DIR="$2" ;;
                --image) CONTAINER_IMAGE="$2" ;;
                --flavour) flavour="$2" ;;
                --torch-wheel-dir) torch_wheel_dir="$2" ;;
                --torch-port) torch_port="$2" ;;
            esac
            shift 2
            ;;
        --no-cache)
            no_cache=true
            shift
            ;;
        --from-scratch)
            no_cache=true
            from_scratch=true
            shift
            ;;
        *)
            usage >&2
            container_die "unknown argument '$1'"
            ;;
    esac
done
[[ "$flavour" == cpu || "$flavour" == gpu ]] || container_die "--flavour must be cpu or gpu, got '$flavour'"
if ! [[ "$torch_port" =~ ^[0-9]+$ ]] || ((torch_port < 1 || torch_port > 65535)); then
    container_die "--torch-port must be a port number, got '$torch_port'"
fi
if [[ -n "$torch_wheel_dir" && ! -d "$torch_wheel_dir" ]]; then
    container_die "--torch-wheel-dir $torch_wheel_dir is not a directory"
fi
CONTAINER_CACHE_DIR="$(realpath -m "$CONTAINER_CACHE_DIR")"
case "$CONTAINER_CACHE_DIR/" in
    "$repo_root"/*) container_die "--cache-dir must be outside the repository (the build context would include it), got $CONTAINER_CACHE_DIR" ;;
esac
rootfs="$CONTAINER_CACHE_DIR/rootfs-bookworm"
debian_mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

container_cleanup() {
    if [[ -n "$TORCH_SERVER_PID" ]]; then
        kill "$TORCH_SERVER_PID" 2>/dev/null || true
        wait "$TORCH_SERVER_PID" 2>/dev/null || true
    fi
}
trap container_on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

scratch() {
    container_log "removing the image and the pip cache of its build (with --from-scratch also the base image and the root file system)"
    podman_ rmi --force "$CONTAINER_IMAGE" >/dev/null 2>&1 || true
    rm -rf "$CONTAINER_CACHE_DIR/tmp/buildah-cache"
    if [[ "$from_scratch" == true ]]; then
        podman_ rmi --force "$CONTAINER_BASE_IMAGE" >/dev/null 2>&1 || true
        container_log "removing the root file system cache $rootfs"
        rm -rf "$rootfs"
    fi
}

# The root file system is complete once debootstrap returned and the certificates are in: a
# marker file written last, so that an interrupted debootstrap is redone, not reused.
make_base() {
    local marker="$rootfs/.megatron-gspo-rootfs-complete" certificate
    if [[ ! -f "$marker" ]]; then
        rm -rf "$rootfs"
        container_log "debootstrap bookworm into $rootfs from $debian_mirror"
        debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs" "$debian_mirror" \
            >"$CONTAINER_CACHE_DIR/debootstrap.log" 2>&1 ||
            { tail -n 20 "$CONTAINER_CACHE_DIR/debootstrap.log" >&2; return 1; }
        # This machine's egress proxy re-signs HTTPS with a CA of its own; the host trusts it
        # through /usr/local/share/ca-certificates, and so must the image's apt and pip.
        for certificate in /usr/local/share/ca-certificates/*.crt; do
            [[ -f "$certificate" ]] || continue
            cp "$certificate" "$rootfs/usr/local/share/ca-certificates/"
            container_log "trusting $certificate in the base"
        done
        chroot "$rootfs" update-ca-certificates >/dev/null
        # pip carries its own CA bundle (certifi); point it at the system's, which holds them.
        printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$rootfs/etc/pip.conf"
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        date -u +%FT%TZ >"$marker"
    else
        container_log "reusing the root file system $rootfs (from $(cat "$marker"))"
    fi
    if podman_ image exists "$CONTAINER_BASE_IMAGE" &&
        [[ "$(podman_ image inspect --format '{{index .Labels "rootfs"}}' "$CONTAINER_BASE_IMAGE" 2>/dev/null)" == "$(cat "$marker")" ]]; then
        container_log "reusing the base image $CONTAINER_BASE_IMAGE"
        return 0
    fi
    container_log "importing $rootfs as $CONTAINER_BASE_IMAGE"
    tar --numeric-owner -C "$rootfs" -c . |
        podman_ import --change "LABEL rootfs=$(cat "$marker")" --change 'CMD ["/bin/bash"]' \
            - "$CONTAINER_BASE_IMAGE" >/dev/null
}

# find_torch_index: sets TORCH_INDEX, the index the build installs torch's CPU wheel from. PyTorch's own CPU
# index when it answers; else a loopback HTTP server over a directory with the wheel (its
# directory listing is a valid pip index page), which the build reaches through --network host.
TORCH_SERVER_PID=""
TORCH_INDEX=""
find_torch_index() {
    local version wheel="" directory
    version="$(sed -n 's/^torch==//p' "$repo_root/constraints.txt")"
    [[ -n "$version" ]] || container_die "constraints.txt pins no torch version"
    if [[ -z "$torch_wheel_dir" ]] &&
        python3 -c 'import urllib.request; urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=15)' 2>/dev/null; then
        TORCH_INDEX="https://download.pytorch.org/whl/cpu"
        return 0
    fi
    if [[ -n "$torch_wheel_dir" ]]; then
        wheel="$(find "$torch_wheel_dir" -maxdepth 1 -name "torch-${version}+cpu-cp311-*.whl" | head -n 1)"
        [[ -n "$wheel" ]] || container_die "no torch-${version}+cpu-cp311-*.whl in $torch_wheel_dir"
    else
        for directory in $(pip config get global.find-links 2>/dev/null) ${PIP_FIND_LINKS:-}; do
            [[ -d "$directory" ]] || continue
            wheel="$(find "$directory" -maxdepth 1 -name "torch-${version}+cpu-cp311-*.whl" | head -n 1)"
            if [[ -n "$wheel" ]]; then break; fi
        done
        [[ -n "$wheel" ]] || container_die "PyTorch's CPU index (download.pytorch.org) cannot be reached and no local torch-${version}+cpu-cp311 wheel was found: pass --torch-wheel-dir DIR"
    fi
    rm -rf "$CONTAINER_CACHE_DIR/torch-index"
    mkdir -p "$CONTAINER_CACHE_DIR/torch-index/torch"
    cp "$wheel" "$CONTAINER_CACHE_DIR/torch-index/torch/"
    # A fixed port: the index URL is a build argument, part of the cache key of the torch layer
    # and of every layer after it, so another port would rebuild them all. A free one if taken.
    local port="$torch_port"
    if ! python3 -c 'import socket, sys; socket.socket().bind(("127.0.0.1", int(sys.argv[1])))' "$port" 2>/dev/null; then
        port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
        container_log "port $torch_port is taken: serving torch on $port (the layers from torch's on are rebuilt)"
    fi
    python3 -m http.server --bind 127.0.0.1 --directory "$CONTAINER_CACHE_DIR/torch-index" "$port" \
        >"$CONTAINER_CACHE_DIR/torch-index.log" 2>&1 &
    TORCH_SERVER_PID=$!
    local waited
    for waited in $(seq 50); do
        python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
            "http://127.0.0.1:$port/torch/" 2>/dev/null && break
        ((waited < 50)) || container_die "the local torch index on port $port did not answer"
        sleep 0.2
    done
    container_log "serving $(basename "$wheel") at http://127.0.0.1:$port/torch/ (PyTorch's CPU index is unreachable)"
    TORCH_INDEX="http://127.0.0.1:$port"
}

build_image() {
    local arguments=(build --network host --format docker --file "$repo_root/Dockerfile"
        --tag "$CONTAINER_IMAGE" --build-arg "FLAVOUR=$flavour")
    if [[ "$no_cache" == true ]]; then
        arguments+=(--no-cache)
    fi
    if [[ "$flavour" == cpu ]]; then
        find_torch_index
        arguments+=(--build-arg "CPU_BASE=$CONTAINER_BASE_IMAGE" --build-arg "TORCH_CPU_INDEX_URL=$TORCH_INDEX")
    fi
    container_log "podman $(printf '%q ' "${arguments[@]}")$repo_root"
    local status=0
    podman_ "${arguments[@]}" "$repo_root" 2>&1 | tee "$CONTAINER_CACHE_DIR/build-$flavour.log" || status=$?
    container_cleanup
    TORCH_SERVER_PID=""
    if ((status != 0)) && [[ "$flavour" == gpu ]]; then
        container_log "the GPU flavour stopped at: $(grep -m 1 -E '^\[[0-9]+/[0-9]+\] STEP' "$CONTAINER_CACHE_DIR/build-gpu.log" | tail -n 1)"
        container_log "$(grep -m 1 -E '^Error' "$CONTAINER_CACHE_DIR/build-gpu.log")"
    fi
    return "$status"
}

run_stage setup container_setup
if [[ "$no_cache" == true ]]; then
    run_stage scratch scratch
fi
if [[ "$flavour" == cpu ]]; then
    run_stage base make_base
fi
run_stage "build-$flavour" build_image
print_stage_times
container_log "built $CONTAINER_IMAGE ($(podman_ image inspect --format '{{.Size}}' "$CONTAINER_IMAGE" | awk '{ printf "%.1f GB", $1 / 1e9 }'))"
