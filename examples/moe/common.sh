# shellcheck shell=bash
# Helpers shared by launch_single_node.sh, launch_multi_node.sh and sglang_server.sh. Sourced, not
# run. The scripts read every setting they act on (model path, SGLang sizes, transport) from the
# resolved preset, so a script and the trainer it launches can never disagree about the config.

PYTHON="${PYTHON:-python}"
TORCHRUN="${TORCHRUN:-torchrun}"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

die() {
    printf 'error: %s\n' "$*" >&2
    exit 2
}

# Prints a command the way a user would type it (each word shell-quoted), the value of an
# --api-key replaced by *** (logs and dry runs must not carry the secret; the scripts' own servers
# take it from a file: add_sglang_key_file).
print_command() {
    local word quoted=() hide=false
    for word in "$@"; do
        if [[ "$hide" == true ]]; then
            word='***'
            hide=false
        elif [[ "$word" == --api-key ]]; then
            hide=true
        elif [[ "$word" == --api-key=* ]]; then
            word='--api-key=***'
        fi
        quoted+=("$(printf '%q' "$word")")
    done
    printf '%s\n' "${quoted[*]}"
}

# sglang_api_key SHARED
# The secret of the SGLang servers these scripts start (their --api-key) and of the trainer's
# calls to them, in MEGATRON_GSPO_SGLANG_API_KEY (megatron_gspo/rollout/auth.py). A single node
# makes a fresh one when it is unset; with SHARED=true (servers on several nodes, one trainer
# talking to all of them) every node needs the same one, so it must be set.
sglang_api_key() {
    local shared="$1"
    if [[ -n "${MEGATRON_GSPO_SGLANG_API_KEY:-}" ]]; then
        export MEGATRON_GSPO_SGLANG_API_KEY
        return
    fi
    if [[ "$shared" == true ]]; then
        die "colocated SGLang on several nodes needs MEGATRON_GSPO_SGLANG_API_KEY: the same secret on every node (the servers refuse calls without it), e.g. export MEGATRON_GSPO_SGLANG_API_KEY=\$(openssl rand -hex 32) once and pass it to every node through the scheduler's environment"
    fi
    MEGATRON_GSPO_SGLANG_API_KEY="$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))')"
    export MEGATRON_GSPO_SGLANG_API_KEY
}

# read_config PRESET WORLD_SIZE [OVERRIDE...]
# Resolves the preset with the overrides (and MEGATRON_GSPO_OVERRIDES, as the trainer does),
# checks that the parallel layout fits WORLD_SIZE processes (0 skips the check) and sets the CFG_*
# variables the scripts branch on. A configuration error is printed as the trainer would print it, and the script stops
# before anything slow (an SGLang start-up takes minutes) has begun.
read_config() {
    local assignments
    assignments="$(
        "$PYTHON" - "$@" <<'PYTHON_END'
import shlex
import sys

from megatron_gspo.config import ConfigError
from megatron_gspo.config.loader import load_config, overrides_from_env

preset, world_size, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
try:
    config = load_config(preset, overrides_from_env() + overrides)
    if world_size:
        config.parallel.check_world(world_size)
except ConfigError as error:
    print(error, file=sys.stderr)
    sys.exit(2)
values = {
    "OUTPUT_DIR": config.output_dir,
    "ENGINE": config.rollout.engine,
    "SGLANG_PORT": config.rollout.sglang.port,
    "WEIGHT_TRANSPORT": config.rollout.weight_transport,
}
for name, value in values.items():
    print(f"CFG_{name}={shlex.quote(str(value))}")
PYTHON_END
    )" || exit $?
    eval "$assignments"
    CFG_PRESET="$1"
    CFG_OVERRIDES=("${@:3}")
}

# build_sglang_command HOST PORT RELEASE_MEMORY [EXTRA_SGLANG_ARG...]
# Fills SGLANG_COMMAND with the `python -m sglang.launch_server` call for the preset read by
# read_config, built by the same function the trainer uses when it launches servers itself
# (megatron_gspo.rollout.sglang_launcher.build_launch_command), so the flags the trainer's client
# relies on (--skip-tokenizer-init, --weight-version, --enable-return-routed-experts for R3) are
# always there. RELEASE_MEMORY=true adds --enable-memory-saver, which /release_memory_occupation
# needs.
build_sglang_command() {
    local host="$1" port="$2" release_memory="$3" words
    shift 3
    local extra=("$@")
    if [[ "$release_memory" == true ]]; then
        extra=(--enable-memory-saver "${extra[@]}")
    fi
    words="$(
        "$PYTHON" - "$host" "$port" "$CFG_PRESET" "${#extra[@]}" "${extra[@]}" "${CFG_OVERRIDES[@]}" <<'PYTHON_END'
import shlex
import sys

from megatron_gspo.config.loader import load_config, overrides_from_env
from megatron_gspo.rollout.sglang_launcher import build_launch_command

host, port, preset, extra_count = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
extra, overrides = sys.argv[5 : 5 + extra_count], sys.argv[5 + extra_count :]
config = load_config(preset, overrides_from_env() + overrides)
rollout = config.rollout
if not config.model.hf_path:
    sys.exit(
        "error: the preset has no model.hf_path: SGLang serves a Hugging Face checkpoint "
        "directory (set model.hf_path=/models/...)"
    )
try:
    command = build_launch_command(
        config.model.hf_path,
        port=port,
        host=host,
        tp_size=rollout.sglang.tp,
        ep_size=rollout.sglang.ep,
        mem_fraction_static=rollout.sglang.mem_fraction,
        enable_return_routed_experts=config.algo.routing_replay == "r3",
        extra_args=[*rollout.sglang.extra_args, *extra],
    )
except ValueError as error:
    sys.exit(f"error: cannot start SGLang with this configuration: {error}")
print(shlex.join(command))
PYTHON_END
    )" || exit 2
    eval "SGLANG_COMMAND=($words)"
}

# add_sglang_key_file DRY_RUN
# With MEGATRON_GSPO_SGLANG_API_KEY set, appends SGLang's own `--config FILE.yaml` holding the key
# to SGLANG_COMMAND: a key on the command line is readable by every local user
# (/proc/PID/cmdline, ps). The file is private (mktemp: mode 0600) and removed once the server
# answers (remove_sglang_key_file). A dry run names it without writing it.
add_sglang_key_file() {
    local dry_run="$1"
    [[ -n "${MEGATRON_GSPO_SGLANG_API_KEY:-}" ]] || return 0
    if [[ "$dry_run" == true ]]; then
        SGLANG_COMMAND+=(--config '<private file with the API key>')
        return
    fi
    SGLANG_KEY_FILE="$(mktemp --suffix=.yaml "${TMPDIR:-/tmp}/megatron_gspo_sglang_XXXXXX")"
    "$PYTHON" -c 'from megatron_gspo.rollout.auth import api_key_from_environment as key
import json, sys; json.dump({"api-key": key()}, sys.stdout)' >"$SGLANG_KEY_FILE"
    SGLANG_COMMAND+=(--config "$SGLANG_KEY_FILE")
}

remove_sglang_key_file() {
    if [[ -n "${SGLANG_KEY_FILE:-}" ]]; then
        rm -f "$SGLANG_KEY_FILE"
        SGLANG_KEY_FILE=
    fi
}

# wait_for_sglang URL PID LOG_FILE TIMEOUT_SECONDS
# Polls /health_generate (a real one-token generation, unlike /health) until the server answers,
# the server process dies, or the time-out passes. Loading a 60 GB checkpoint and capturing CUDA
# graphs takes several minutes. SGLANG_POLL_SECONDS sets the interval between polls.
wait_for_sglang() {
    local url="$1" pid="$2" log_file="$3" timeout="$4" waited=0 interval="${SGLANG_POLL_SECONDS:-10}"
    log "waiting for SGLang at $url (log: $log_file)"
    while ((waited < timeout)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 30 "$log_file" >&2 || true
            die "the SGLang server exited during start-up (last lines of $log_file above)"
        fi
        if "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health_generate", timeout=30).read()' "$url" 2>/dev/null; then
            log "SGLang at $url is ready after ${waited}s"
            return 0
        fi
        sleep "$interval"
        waited=$((waited + interval))
    done
    die "SGLang at $url did not answer /health_generate within ${timeout}s (see $log_file; raise --sglang-timeout for large checkpoints on slow storage)"
}

# start_sglang_server LOG_FILE HOST PORT RELEASE_MEMORY
# Starts the server in the background in a session of its own, so that stop_sglang_server can end
# it and every process it spawned (one scheduler per GPU, the detokenizer) by its group id.
start_sglang_server() {
    local log_file="$1" host="$2" port="$3" release_memory="$4"
    build_sglang_command "$host" "$port" "$release_memory"
    add_sglang_key_file false
    mkdir -p "$(dirname "$log_file")"
    log "starting SGLang: $(print_command "${SGLANG_COMMAND[@]}")"
    setsid "${SGLANG_COMMAND[@]}" >"$log_file" 2>&1 &
    SGLANG_PID=$!
}

stop_sglang_server() {
    remove_sglang_key_file
    if [[ -n "${SGLANG_PID:-}" ]] && kill -0 "$SGLANG_PID" 2>/dev/null; then
        log "stopping the SGLang server (process group $SGLANG_PID)"
        kill -TERM -- "-$SGLANG_PID" 2>/dev/null || true
        wait "$SGLANG_PID" 2>/dev/null || true
    fi
}

# default_sglang_mode: without --sglang, SGLang runs colocated when the preset's rollout engine
# is sglang (none otherwise); without --sglang-port, on the preset's rollout.sglang.port.
default_sglang_mode() {
    if [[ -z "$SGLANG_MODE" ]]; then
        SGLANG_MODE=none
        if [[ "$CFG_ENGINE" == sglang ]]; then
            SGLANG_MODE=colocated
        fi
    fi
    SGLANG_PORT="${SGLANG_PORT:-$CFG_SGLANG_PORT}"
}

# run_trainer SGLANG_HOST SGLANG_LOG DESCRIPTION TRAIN_COMMAND...
# --dry-run: print the commands (this node's colocated SGLang server, then the trainer) and exit.
# Otherwise start the colocated server on SGLANG_HOST, logging to SGLANG_LOG, wait until it
# answers (it is stopped when the script exits), then run the trainer.
run_trainer() {
    local host="$1" sglang_log="$2" description="$3"
    shift 3
    if [[ "$DRY_RUN" == true ]]; then
        if [[ "$SGLANG_MODE" == colocated ]]; then
            build_sglang_command "$host" "$SGLANG_PORT" true
            add_sglang_key_file true
            print_command "${SGLANG_COMMAND[@]}"
        fi
        print_command "$@"
        exit 0
    fi
    if [[ "$SGLANG_MODE" == colocated ]]; then
        trap stop_sglang_server EXIT
        trap 'exit 130' INT TERM
        start_sglang_server "$sglang_log" "$host" "$SGLANG_PORT" true
        wait_for_sglang "http://$host:$SGLANG_PORT" "$SGLANG_PID" "$sglang_log" "$SGLANG_TIMEOUT"
        remove_sglang_key_file # read at start-up: the server answers, so it holds the key now
    fi
    log "$description: $(print_command "$@")"
    "$@"
}

# The URL list as a Hydra override value: [http://a:30000,http://b:30000].
hydra_list() {
    local IFS=,
    printf '[%s]' "$*"
}

# parse_launch_args MULTI_NODE USAGE_FUNCTION "$@"
# Options of the two launchers. Sets PRESET, GPUS_PER_NODE, SGLANG_MODE, SGLANG_PORT,
# SGLANG_TIMEOUT, DRY_RUN, OVERRIDES, URLS and, with MULTI_NODE=true, NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT, NODE_HOSTS and RDZV_ID (each of these also read from the environment).
# shellcheck disable=SC2034
parse_launch_args() {
    local multi_node="$1" usage_function="$2"
    shift 2
    PRESET="${PRESET:-}"
    GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
    SGLANG_MODE=""
    SGLANG_PORT=""
    SGLANG_TIMEOUT=1800
    DRY_RUN=false
    OVERRIDES=()
    URLS=()
    if [[ -n "${SGLANG_URLS:-}" ]]; then
        IFS=, read -r -a URLS <<<"$SGLANG_URLS"
    fi
    # Slurm exports the node count and this node's index; explicit values win.
    NNODES="${NNODES:-${SLURM_NNODES:-}}"
    NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-}}"
    MASTER_ADDR="${MASTER_ADDR:-}"
    MASTER_PORT="${MASTER_PORT:-29500}"
    NODE_HOSTS="${NODE_HOSTS:-}"
    RDZV_ID="${RDZV_ID:-megatron_gspo}"
    while (($#)); do
        case "$1" in
            -h | --help)
                "$usage_function"
                exit 0
                ;;
            --preset | --gpus | --sglang | --sglang-url | --sglang-port | --sglang-timeout)
                (($# >= 2)) || die "$1 needs a value"
                case "$1" in
                    --preset) PRESET="$2" ;;
                    --gpus) GPUS_PER_NODE="$2" ;;
                    --sglang) SGLANG_MODE="$2" ;;
                    --sglang-url) URLS+=("$2") ;;
                    --sglang-port) SGLANG_PORT="$2" ;;
                    --sglang-timeout) SGLANG_TIMEOUT="$2" ;;
                esac
                shift 2
                ;;
            --nnodes | --node-rank | --master-addr | --master-port | --node-hosts | --rdzv-id)
                [[ "$multi_node" == true ]] || die "$1 is an option of launch_multi_node.sh"
                (($# >= 2)) || die "$1 needs a value"
                case "$1" in
                    --nnodes) NNODES="$2" ;;
                    --node-rank) NODE_RANK="$2" ;;
                    --master-addr) MASTER_ADDR="$2" ;;
                    --master-port) MASTER_PORT="$2" ;;
                    --node-hosts) NODE_HOSTS="$2" ;;
                    --rdzv-id) RDZV_ID="$2" ;;
                esac
                shift 2
                ;;
            --dry-run)
                DRY_RUN=true
                shift
                ;;
            *=*)
                OVERRIDES+=("$1")
                shift
                ;;
            *)
                "$usage_function" >&2
                die "unknown argument '$1'"
                ;;
        esac
    done
    [[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "--gpus must be a positive integer, got '$GPUS_PER_NODE'"
    [[ "$SGLANG_TIMEOUT" =~ ^[0-9]+$ ]] || die "--sglang-timeout must be a number of seconds, got '$SGLANG_TIMEOUT'"
}

# rollout_overrides_for MODE COLOCATED_URL...
# Sets ROLLOUT_OVERRIDES, the Hydra overrides that point the trainer at its SGLang servers: the
# colocated servers' URLs (given), or the dedicated ones (URLS). Needs read_config's CFG_*.
rollout_overrides_for() {
    local mode="$1"
    shift
    ROLLOUT_OVERRIDES=()
    case "$mode" in
        colocated)
            ROLLOUT_OVERRIDES=(
                rollout.engine=sglang
                "rollout.sglang.urls=$(hydra_list "$@")"
                rollout.sglang.release_memory=true
            )
            ;;
        dedicated)
            ((${#URLS[@]})) || die "--sglang dedicated needs the servers' URLs: --sglang-url http://HOST:PORT (repeatable) or SGLANG_URLS=url1,url2"
            ROLLOUT_OVERRIDES=(
                rollout.engine=sglang
                "rollout.sglang.urls=$(hydra_list "${URLS[@]}")"
                rollout.sglang.release_memory=false
            )
            # CUDA IPC handles only work between processes on the same GPUs.
            if [[ "$CFG_WEIGHT_TRANSPORT" == tensor ]]; then
                ROLLOUT_OVERRIDES+=(rollout.weight_transport=distributed)
            fi
            ;;
        none) ;;
        *) die "--sglang must be colocated, dedicated or none, got '$mode'" ;;
    esac
}
