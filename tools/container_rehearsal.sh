#!/usr/bin/env bash
# Rehearse, in containers of the image's CPU flavour built here with podman, what users do with
# the image on a cluster: the CPU demo, a two-node torchrun job (one container per node) killed
# and resumed with its checkpoint on a mounted volume, the code sandbox as the image's non-root
# user, and an HF export read back with transformers. Every stage must pass; the first failure
# stops the script, names the stage and exits non-zero. --record writes the result into
# examples/moe/README.md ("Containers here"), which tests/docker/test_container_record.py compares
# with the checkout: CI does not build images (it would not fit its 30 minutes), so a change to
# the Dockerfile or to what its build copies fails CI until this script has been run again.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

script_dir="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd -- "$script_dir/.." && pwd)"
CONTAINER_LOG_NAME=container_rehearsal
# shellcheck source=container_common.sh
source "$script_dir/container_common.sh"

# The files whose change asks for a new rehearsal: the Dockerfile, its ignore file, what the build
# reads before `COPY . .` (setup.py, pyproject.toml, constraints.txt, the entry script), the
# build's pin check, and the scripts and checks of the rehearsal itself. The package's own source
# is left out: CI tests it without containers, and the image runs it unchanged.
HASHED_FILES=(
    Dockerfile
    .dockerignore
    setup.py
    pyproject.toml
    constraints.txt
    tools/container_entrypoint.sh
    tools/check_image_pins.py
    tools/container_common.sh
    tools/container_image.sh
    tools/container_rehearsal.sh
    tools/container_checks.py
)
README="$repo_root/examples/moe/README.md"
RECORD_START='<!-- container-rehearsal:start -->'
RECORD_END='<!-- container-rehearsal:end -->'
# The overrides that make a step of the tiny model take about a second per process (the same as
# tests/e2e/harness.py's TINY), a checkpoint after every step, no progress bar in the logs.
TWO_NODE_OVERRIDES=(
    algo.rollout_batch_size=2
    algo.num_return_sequences_in_group=4
    algo.num_mini_batches=2
    algo.response_length=8
    sft_warmup_steps=0
    logging.progress_bar=false
    checkpoint.interval=1
    output_dir=outputs/two_nodes
)
# What podman needs so that bubblewrap can make its namespaces and a fresh /proc in a container:
# its default seccomp profile refuses them, and its masked /proc paths stop the mount. Docker's
# equivalents are in examples/moe/docker_run.sh (CODE_SANDBOX=1).
SANDBOX_OPTIONS=(--security-opt seccomp=unconfined --security-opt unmask=ALL)

usage() {
    cat <<'EOF'
Usage: tools/container_rehearsal.sh [options]

Stages (each timed; the first failure stops the script with the stage's name):
  build-MODE    tools/container_image.sh builds the CPU image (see --build)
  demo          the CPU demo as README.md gives it, `python -m megatron_gspo.train --preset
                cpu_demo`, in one container; checks its metrics (every step once, finite losses)
  two-nodes     examples/moe/launch_multi_node.sh in two containers (--network host, one per
                node, NNODES=2, 2 processes each, rendezvous on 127.0.0.1): cpu_tiny_4proc
                (tp2 x ep2), killed (both containers, SIGKILL) once a step is logged and a
                checkpoint saved, then the same command with resume=true; checks the resumed
                run logged every step once and trained every served prompt exactly once
  sandbox       the code sandbox as the image's user "trainer": bubblewrap's probe, a program's
                view from inside, the code reward on a correct and a wrong program (with
                --security-opt seccomp=unconfined --security-opt unmask=ALL); and, without those
                options, that the sandbox refuses to run rather than run unconfined
  hf-export     tools/convert_checkpoint.py megatron-to-hf of the two-node run's checkpoint onto
                the volume, then transformers loads it in a new container and runs a forward
  gpu-flavour   (with --record or --gpu-attempt) the GPU flavour's build, which must get as far
                as pulling its NGC base (nvcr.io cannot be reached here) and no further fail

Options:
  --build MODE        cached (default: reuses podman's layers), no-cache (every layer again, the
                      debootstrap cache kept), from-scratch (also debootstrap again), skip (use the
                      existing image); repeatable, each build a stage of its own
  --volume DIR        host directory mounted at /workspace/megatron_gspo/outputs in every
                      container, emptied first (default: CACHE_DIR/rehearsal-outputs)
  --steps N           steps of the two-node run (default: 8)
  --port PORT         rendezvous port of the two-node run (default: a free one)
  --cache-dir DIR     as for tools/container_image.sh (default: /var/cache/megatron-gspo-container)
  --image NAME        the image (default: localhost/megatron-gspo:0.1.0-cpu)
  --gpu-attempt       also run the gpu-flavour stage
  --record            also run gpu-flavour, then rewrite the recorded section of
                      examples/moe/README.md with this run (date, commit, CPU, stage times, the
                      sha256 of every file listed in it); needs a build in this run
  -h, --help          this help

To refresh the record after changing the Dockerfile or a file the record lists (as root):
  tools/container_rehearsal.sh --build from-scratch --build no-cache --record
EOF
}

original_arguments=("$@")
builds=()
volume=""
steps=8
port=""
gpu_attempt=false
record=false
while (($#)); do
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
        --build | --volume | --steps | --port | --cache-dir | --image)
            (($# >= 2)) || container_die "$1 needs a value"
            case "$1" in
                --build) builds+=("$2") ;;
                --volume) volume="$2" ;;
                --steps) steps="$2" ;;
                --port) port="$2" ;;
                --cache-dir) CONTAINER_CACHE_DIR="$2" ;;
                --image) CONTAINER_IMAGE="$2" ;;
            esac
            shift 2
            ;;
        --gpu-attempt)
            gpu_attempt=true
            shift
            ;;
        --record)
            record=true
            gpu_attempt=true
            shift
            ;;
        *)
            usage >&2
            container_die "unknown argument '$1'"
            ;;
    esac
done
((${#builds[@]})) || builds=(cached)
for mode in "${builds[@]}"; do
    case "$mode" in
        cached | no-cache | from-scratch | skip) ;;
        *) container_die "--build must be cached, no-cache, from-scratch or skip, got '$mode'" ;;
    esac
done
if [[ "$record" == true && " ${builds[*]} " == *" skip "* ]]; then
    container_die "--record needs the image built in this run (the record vouches for the files it lists): drop --build skip"
fi
if ! [[ "$steps" =~ ^[0-9]+$ ]] || ((steps < 3)); then
    container_die "--steps must be a whole number of at least 3 (one to kill after, more to resume), got '$steps'"
fi
if [[ -n "$port" ]] && { ! [[ "$port" =~ ^[0-9]+$ ]] || ((port < 1 || port > 65535)); }; then
    container_die "--port must be a port number, got '$port'"
fi
CONTAINER_CACHE_DIR="$(realpath -m "$CONTAINER_CACHE_DIR")"
volume="$(realpath -m "${volume:-$CONTAINER_CACHE_DIR/rehearsal-outputs}")"
case "$volume/" in
    "$repo_root"/*) container_die "--volume must be outside the repository, got $volume" ;;
esac
# Containers of this run carry its process id, so that cleaning up never touches anyone else's.
run_id="mgspo-rehearsal-$$"
# The machine's load when the run started, for the record: the times mean little without it.
load_at_start="$(cut -d ' ' -f 1-3 /proc/loadavg)"
CONTAINER_OUTPUTS=/workspace/megatron_gspo/outputs
gpu_stop=""

container_cleanup() {
    local name
    for name in $(podman_ ps --all --format '{{.Names}}' --filter "name=^$run_id-" 2>/dev/null); do
        podman_ rm --force --time 0 "$name" >/dev/null 2>&1 || true
    done
}
trap container_on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# in_container NAME [podman run options...] -- COMMAND...: runs COMMAND in a new container of the
# image, with the volume at the outputs directory, the host's network and IPC namespaces (as
# docker_run.sh: torchrun and gloo meet on the host's addresses, shared memory is the host's),
# removed when it ends.
in_container() {
    local name="$1" options=()
    shift
    while [[ "$1" != -- ]]; do
        options+=("$1")
        shift
    done
    shift
    podman_ run --rm --name "$run_id-$name" --network host --ipc host \
        --volume "$volume:$CONTAINER_OUTPUTS" "${options[@]}" "$CONTAINER_IMAGE" "$@"
}

build() {
    local mode="$1" arguments=(--cache-dir "$CONTAINER_CACHE_DIR" --image "$CONTAINER_IMAGE")
    case "$mode" in
        no-cache) arguments+=(--no-cache) ;;
        from-scratch) arguments+=(--from-scratch) ;;
    esac
    "$script_dir/container_image.sh" "${arguments[@]}"
}

# The volume belongs to the image's user (TRAINER_UID), who writes every output into it.
prepare_volume() {
    podman_ image exists "$CONTAINER_IMAGE" || container_die "no image $CONTAINER_IMAGE: build it (drop --build skip)"
    local user
    user="$(podman_ image inspect --format '{{.Config.User}}' "$CONTAINER_IMAGE")"
    [[ "$user" =~ ^[1-9][0-9]*:[0-9]+$ ]] || container_die "the image's user is '$user', expected the non-root UID:GID"
    rm -rf "$volume"
    mkdir -p "$volume/logs"
    chown -R "$user" "$volume"
}

demo() {
    local demo_steps
    demo_steps="$(sed -n 's/^steps: *//p' "$repo_root/examples/moe/cpu_demo.yaml")"
    in_container demo -- python -m megatron_gspo.train --preset cpu_demo \
        >"$volume/logs/demo.log" 2>&1 || { tail -n 30 "$volume/logs/demo.log" >&2; return 1; }
    in_container demo-check -- python tools/container_checks.py run outputs/cpu_demo --steps "$demo_steps"
}

# start_node RANK TAG OVERRIDE...: node RANK of the two-node job, detached, as the README's
# multi-node section launches it (launch_multi_node.sh with NNODES, NODE_RANK, MASTER_ADDR and
# MASTER_PORT from the environment), 2 processes on the node. Each container gets a host name of
# its own, at an address of its own on the loopback, and knows the other's, as cluster nodes do:
# torchrun tells nodes apart by host name and agent process id, and both agents would otherwise
# have the host's name and the same process id (41) in their own PID namespaces, so the
# rendezvous would take them for one node and wait for the second forever.
start_node() {
    local rank="$1" tag="$2"
    shift 2
    podman_ run --detach --name "$run_id-node$rank-$tag" --network host --ipc host \
        --hostname "node$rank" --add-host node0:127.0.0.1 --add-host node1:127.0.0.2 \
        --volume "$volume:$CONTAINER_OUTPUTS" \
        --env NNODES=2 --env NODE_RANK="$rank" --env MASTER_ADDR=127.0.0.1 \
        --env MASTER_PORT="$port" --env RDZV_ID="$run_id" \
        "$CONTAINER_IMAGE" examples/moe/launch_multi_node.sh --gpus 2 --preset cpu_tiny_4proc \
        "steps=$steps" "${TWO_NODE_OVERRIDES[@]}" "$@" >/dev/null
}

running() {
    [[ "$(podman_ inspect --format '{{.State.Running}}' "$1" 2>/dev/null)" == true ]]
}

save_logs() {
    local tag="$1" rank
    for rank in 0 1; do
        podman_ logs "$run_id-node$rank-$tag" >"$volume/logs/node$rank-$tag.log" 2>&1 || true
    done
}

metrics_lines() {
    if [[ -f "$volume/two_nodes/metrics.jsonl" ]]; then
        grep -c . "$volume/two_nodes/metrics.jsonl" || true
    else
        echo 0
    fi
}

two_nodes() {
    if [[ -z "$port" ]]; then
        port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    fi
    container_log "two nodes, rendezvous on 127.0.0.1:$port, $steps steps; killing both once a step is logged and checkpointed"
    start_node 0 first
    start_node 1 first
    local waited=0 rank
    until (($(metrics_lines) >= 1)) && [[ -f "$volume/two_nodes/checkpoints/latest" ]]; do
        for rank in 0 1; do
            if ! running "$run_id-node$rank-first"; then
                save_logs first
                tail -n 30 "$volume/logs/node$rank-first.log" >&2
                container_die "node $rank ended before its first step was logged (log: $volume/logs/node$rank-first.log)"
            fi
        done
        if ((waited >= 1800)); then
            save_logs first
            container_die "no step logged and checkpointed within 900 s (logs in $volume/logs)"
        fi
        sleep 0.5
        waited=$((waited + 1))
    done
    podman_ kill --signal KILL "$run_id-node0-first" "$run_id-node1-first" >/dev/null
    local at_kill
    at_kill="$(metrics_lines)"
    save_logs first
    container_log "killed both nodes with $at_kill of $steps steps logged, checkpoint $(cat "$volume/two_nodes/checkpoints/latest")"
    ((at_kill < steps)) || container_die "the run finished before it was killed: nothing to resume (raise --steps)"
    podman_ rm --force "$run_id-node0-first" "$run_id-node1-first" >/dev/null

    start_node 0 resumed resume=true
    start_node 1 resumed resume=true
    # A node whose peer died stops within minutes (train.exit_with_agent, gloo's errors); the
    # limit only keeps a hung run from hanging the rehearsal.
    waited=0
    while running "$run_id-node0-resumed" || running "$run_id-node1-resumed"; do
        if ((waited >= 1800)); then
            save_logs resumed
            container_die "the resumed run did not finish within 1800 s (logs in $volume/logs)"
        fi
        sleep 1
        waited=$((waited + 1))
    done
    local status0 status1
    status0="$(podman_ inspect --format '{{.State.ExitCode}}' "$run_id-node0-resumed")"
    status1="$(podman_ inspect --format '{{.State.ExitCode}}' "$run_id-node1-resumed")"
    save_logs resumed
    if [[ "$status0" != 0 || "$status1" != 0 ]]; then
        tail -n 30 "$volume/logs/node0-resumed.log" "$volume/logs/node1-resumed.log" >&2
        container_die "the resumed run failed: node 0 exited $status0, node 1 exited $status1 (logs in $volume/logs)"
    fi
    # Global rank 0, which logs where it resumed from, is on whichever node the rendezvous made it.
    local resumed
    resumed="$(cat "$volume/logs/node0-resumed.log" "$volume/logs/node1-resumed.log" | grep -m 1 -o 'resuming from .*' || true)"
    [[ -n "$resumed" ]] || container_die "the resumed run did not resume from a checkpoint (no 'resuming from' in $volume/logs/node*-resumed.log)"
    container_log "resumed: $resumed"
    in_container two-nodes-check -- python tools/container_checks.py run outputs/two_nodes --steps "$steps"
    in_container two-nodes-check -- python tools/container_checks.py exactly-once outputs/two_nodes --steps "$steps"
}

sandbox() {
    # Without the options: the sandbox must refuse (and say why), never run code unconfined.
    local refused status=0
    refused="$(in_container sandbox-default -- python -c 'from megatron_gspo.reward.sandbox import check_isolation; check_isolation()' 2>&1)" || status=$?
    if ((status == 0)); then
        container_log "without ${SANDBOX_OPTIONS[*]} bubblewrap isolates here too"
    elif grep -q SandboxUnavailableError <<<"$refused"; then
        container_log "without ${SANDBOX_OPTIONS[*]}: refused, as documented: $(grep -m 1 -o 'SandboxUnavailableError: .*' <<<"$refused" | cut -c 1-200)"
    else
        printf '%s\n' "$refused" >&2
        container_die "without ${SANDBOX_OPTIONS[*]} the sandbox check failed otherwise than by refusing"
    fi
    in_container sandbox "${SANDBOX_OPTIONS[@]}" -- python tools/container_checks.py sandbox
}

hf_export() {
    in_container hf-export -- python tools/convert_checkpoint.py megatron-to-hf \
        --ckpt outputs/two_nodes/checkpoints --out outputs/hf_export \
        >"$volume/logs/hf-export.log" 2>&1 || { tail -n 30 "$volume/logs/hf-export.log" >&2; return 1; }
    if ! compgen -G "$volume/hf_export/*.safetensors" >/dev/null || [[ ! -f "$volume/hf_export/config.json" ]]; then
        container_die "the export left no config.json and safetensors in $volume/hf_export"
    fi
    in_container hf-load -- python tools/container_checks.py hf-load outputs/hf_export
}

# The GPU flavour cannot be built here: its base is on nvcr.io. The stage passes when the build
# stops exactly there (everything before it, the parse of the whole file and the stage selection,
# went through) or builds; any other failure fails it.
gpu_flavour() {
    local log="$CONTAINER_CACHE_DIR/build-gpu.log" status=0
    "$script_dir/container_image.sh" --cache-dir "$CONTAINER_CACHE_DIR" --flavour gpu \
        --image localhost/megatron-gspo:0.1.0-gpu >/dev/null 2>&1 || status=$?
    if ((status == 0)); then
        gpu_stop="built (nvcr.io was reachable)"
        return 0
    fi
    local step error
    step="$(grep -E '^\[[0-9]+/[0-9]+\] STEP' "$log" | tail -n 1)"
    error="$(grep -m 1 -E '^Error' "$log" || true)"
    if [[ "$step" == *"FROM nvcr.io/nvidia/pytorch"* && "$error" == *nvcr.io* ]]; then
        gpu_stop="$step -- $error"
        container_log "the GPU flavour stopped where expected: $gpu_stop"
        return 0
    fi
    tail -n 20 "$log" >&2
    container_die "the GPU flavour's build failed before reaching its NGC base (log: $log)"
}

write_record() {
    local commit dirty cpu section index file
    commit="$(git -C "$repo_root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    dirty=""
    if [[ -n "$(git -C "$repo_root" status --porcelain -- "${HASHED_FILES[@]}" 2>/dev/null)" ]]; then
        dirty=" with uncommitted changes to the files listed below"
    fi
    cpu="$(lscpu | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) cores"
    section="$(
        echo "$RECORD_START"
        echo "Last run of \`tools/container_rehearsal.sh $*\`: $(date -u '+%Y-%m-%d %H:%M UTC'), commit"
        echo "$commit$dirty; $cpu (load average $load_at_start when it started);"
        echo "$(podman --version), runc $(runc --version | sed -n 's/^runc version //p')."
        echo
        echo "| stage | wall time |"
        echo "|---|---:|"
        for index in "${!STAGE_NAMES[@]}"; do
            echo "| ${STAGE_NAMES[index]} | ${STAGE_SECONDS[index]} s |"
        done
        echo
        echo "GPU flavour: ${gpu_stop:-not attempted}"
        echo
        echo "sha256 of the files this record vouches for (tests/docker/test_container_record.py):"
        echo
        echo '```'
        for file in "${HASHED_FILES[@]}"; do
            (cd "$repo_root" && sha256sum "$file")
        done
        echo '```'
        echo "$RECORD_END"
    )"
    if ! grep -qF "$RECORD_START" "$README" || ! grep -qF "$RECORD_END" "$README"; then
        container_die "$README has no recorded section ($RECORD_START ... $RECORD_END)"
    fi
    SECTION="$section" python3 - "$README" "$RECORD_START" "$RECORD_END" <<'PYTHON'
import os, sys
path, start, end = sys.argv[1:4]
text = open(path).read()
before, rest = text.split(start, 1)
after = rest.split(end, 1)[1]
open(path, "w").write(before + os.environ["SECTION"] + after)
PYTHON
    container_log "recorded this run in $README"
}

for mode in "${builds[@]}"; do
    if [[ "$mode" != skip ]]; then
        run_stage "build-$mode" build "$mode"
    fi
done
run_stage setup container_setup
run_stage volume prepare_volume
run_stage demo demo
run_stage two-nodes two_nodes
run_stage sandbox sandbox
run_stage hf-export hf_export
if [[ "$gpu_attempt" == true ]]; then
    run_stage gpu-flavour gpu_flavour
fi
print_stage_times
if [[ "$record" == true ]]; then
    write_record "${original_arguments[@]}"
fi
container_log "every stage passed; outputs and logs in $volume"
