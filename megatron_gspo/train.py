"""Entry point: ``python -m megatron_gspo.train [--preset NAME|PATH] [key=value ...]``.

With no arguments it runs the CPU demo: a tiny MoE learns to repeat 8 random digits
(``data.task=digit_copy``), a 20-step supervised cold start and then 40 GSPO steps. Under
``torchrun --nproc_per_node N`` it uses the configured layout (``parallel.tp=2 parallel.ep=2``).
Overrides use Hydra's grammar; the schema is :class:`megatron_gspo.config.TrainConfig`.

Examples::

    python -m megatron_gspo.train                                   # CPU demo
    python -m megatron_gspo.train steps=20 algo.importance_sampling=token \\
        algo.clip_low=0.2 algo.clip_high=0.27                       # GRPO baseline
    torchrun --nproc_per_node 4 -m megatron_gspo.train parallel.tp=2 parallel.ep=2
    python -m megatron_gspo.train --preset roll_gspo model.hf_path=/models/Qwen3-30B-A3B
    python -m megatron_gspo.train --cfg                             # print the resolved config
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import threading
import time

import yaml

from megatron_gspo.config import ConfigError, to_dict
from megatron_gspo.config.loader import load_config, overrides_from_env
from megatron_gspo.runtime.checkpoint_files import (
    CheckpointError,
    checkpoint_root,
    latest_checkpoint,
)
from megatron_gspo.runtime.console import configure_logging, describe_outputs, summarize
from megatron_gspo.runtime.health import EXIT_CODE as STOPPED_EXIT_CODE
from megatron_gspo.runtime.health import RunStopped, catch_interrupts

logger = logging.getLogger("megatron_gspo.train")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_gspo.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset",
        "--config-name",
        "-cn",
        dest="preset",
        default=None,
        help="preset name (the YAML files of examples/moe/, shipped with the package), e.g. "
        "roll_gspo, or a YAML path",
    )
    parser.add_argument(
        "--cfg", action="store_true", help="print the resolved configuration as YAML and exit"
    )
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. algo.clip_low=3e-4 parallel.tp=2"
    )
    # Intermixed: overrides may stand before and after --preset, as Hydra users write them.
    return parser.parse_intermixed_args(argv)


def exit_with_agent(rank: int, poll_seconds: float = 1.0) -> None:
    """Under torchrun, end this worker when its agent dies.

    torchrun starts every worker in a session of its own, so a SIGKILLed agent (or its process
    group) leaves the workers running unsupervised: the run goes on half-alive, and the other
    node's agent waits at its exit barrier (300 s) or for the collective timeout. A worker that
    finds itself re-parented exits instead, so the other ranks' next collective fails at once
    (gloo: connection reset by peer) and their agents report the failure.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(poll_seconds)
        print(
            f"[rank{rank}] the torchrun agent (pid {agent}) is gone: exiting so that the other "
            "ranks stop instead of waiting on this one",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)  # from a thread: the main thread may sit in a collective that never returns

    threading.Thread(target=watch, name="exit-with-agent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(rank)
    try:
        config = load_config(args.preset, overrides_from_env() + list(args.overrides))
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    if args.cfg:
        print(yaml.safe_dump(to_dict(config), sort_keys=False))
        return 0
    configure_logging(rank, config.logging.log_level)
    if rank == 0:  # the driver owns the outputs, data, rewards and rollout servers
        # Imported here: --help and --cfg load neither torch nor the data and reward packages.
        from megatron_gspo.startup.preflight import check_before_start, prepare_output_dir

        try:
            check_before_start(config)
        except ConfigError as error:
            print(error, file=sys.stderr)
            return 2
        prepare_output_dir(config)
        logger.info("%s", describe_outputs(config))

    # Imported here: the loop pulls torch, which --help and --cfg never need.
    from megatron_gspo.loop import run

    exit_with_agent(rank)
    catch_interrupts()
    started = time.monotonic()
    try:
        records = run(config)
    except ConfigError as error:
        # What only the runtime can check (world size vs layout, tokenizer vs vocab size, a
        # checkpoint's shapes) is still a configuration error: same message, same exit code.
        print(f"[rank{rank}] {error}", file=sys.stderr)
        return 2
    except CheckpointError as error:
        # Its message names the checkpoint and what to do; the traceback is PyTorch's reader.
        print(f"[rank{rank}] checkpoint error: {error}", file=sys.stderr)
        return 1
    except RunStopped as error:
        # A guard (megatron_gspo.runtime.health) found that the run can no longer learn: its message
        # says why and what to do; a traceback would only bury it.
        print(f"[rank{rank}] {error}", file=sys.stderr)
        return STOPPED_EXIT_CODE
    except KeyboardInterrupt:
        if rank == 0:
            print(f"\n{interrupted_message(config, args)}", file=sys.stderr)
        return 130  # 128 + SIGINT, the shell's code for an interrupted command
    if rank == 0:
        logger.info("%s", summarize(records, config, time.monotonic() - started))
    return 0


def interrupted_message(config, args: argparse.Namespace) -> str:
    """What to do after Ctrl-C: the command that resumes the run, or why there is none."""
    latest = latest_checkpoint(checkpoint_root(config.output_dir))
    if latest is None:
        return (
            f"interrupted before any checkpoint was saved (checkpoint.interval="
            f"{config.checkpoint.interval}), so the run cannot be resumed; start it again with "
            "overwrite_output_dir=true, and set checkpoint.interval=N to make it resumable"
        )
    words = [word for word in args.overrides if not word.startswith("resume=")]
    if args.preset:
        words = ["--preset", args.preset, *words]
    command = shlex.join(["python", "-m", "megatron_gspo.train", *words, "resume=true"])
    return (
        f"interrupted; the latest checkpoint is {latest}. Resume "
        f"with:\n  {command}\n(under torchrun: the same torchrun command with resume=true)"
    )


if __name__ == "__main__":
    sys.exit(main())
