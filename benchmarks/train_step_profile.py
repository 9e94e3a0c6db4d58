"""Where the time of our training step goes, at the sizes of ``vs_trl.py``.

One process builds our ``TrainEngine`` for ``--size`` (seed weights, tp = pp = ep = 1, fp32) and
times, on the vs-TRL job's shapes (64 samples of 9 prompt + R response tokens, 4 mini-batches of
16, one micro-batch each), per mini-batch:

* ``forward_backward`` and ``optimizer_step`` (the training step) and, once per rollout step,
  ``forward_log_probs`` over the 64 samples (the recompute of old log-probs);
* the same model as a transformers model trained with plain autograd on the same batch, padded
  ``[16, S]`` (TRL's training path without TRL: forward, log-softmax of the response positions,
  backward, fused AdamW step), as a floor for the framework's overhead;
* utilisation: model FLOPs (``vs_trl_job.training_flops``) over time, against a large fp32 and
  bf16 matmul timed in the same process.

With ``--profile`` the torch profiler records ``--profile-steps`` training steps and prints where
they go: time per module type (forward, inclusive, from forward hooks), the top operators by
self CPU time, and the share of the step spent outside any operator (Python and framework
overhead). Those are wall times: on a shared machine other processes inflate them. With
``--cprofile`` Python's profiler, timed by this process's CPU clock, records the same steps and
prints the functions with the most self and inclusive CPU time: where the step's CPU time goes
(kernels appear as the Python calls that launch them) whatever else the machine runs.

    python benchmarks/train_step_profile.py --size medium --profile
    python benchmarks/train_step_profile.py --size medium --cprofile --skip-hf
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
for _path in (str(BENCHMARKS), str(BENCHMARKS.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from vs_trl_job import (  # noqa: E402
    GROUP_SIZE,
    MINI_BATCHES,
    PROMPTS_PER_STEP,
    SAMPLES_PER_STEP,
    SIZES,
    model_config,
    training_flops,
)

PROMPT_TOKENS = 9


_CLOCK = [time.process_time]


def clock() -> float:
    """CPU seconds of this process (all threads; ``--wall``: wall seconds). On a shared machine
    CPU time is much steadier than wall time, and at 1 thread on an idle one they agree."""
    return _CLOCK[0]()


def make_config(size_name: str):
    from dataclasses import asdict

    from megatron_gspo.config import TrainConfig, from_dict

    size = SIZES[size_name]
    return from_dict(
        TrainConfig,
        dict(
            seed=1234,
            model=asdict(model_config(size)),
            parallel=dict(micro_batch_tokens=4096),
            algo=dict(
                rollout_batch_size=PROMPTS_PER_STEP,
                num_return_sequences_in_group=GROUP_SIZE,
                num_mini_batches=MINI_BATCHES,
                response_length=size.response_tokens,
                importance_sampling="seq",
                clip_low=3e-4,
                clip_high=4e-4,
                loss_agg_mode="seq-mean-token-mean",
                log_routing_change=False,
            ),
            optim=dict(lr=1e-3, clip_grad=1.0, lr_decay_style="constant", lr_warmup_steps=0),
        ),
    )


def make_samples(size_name: str, seed: int = 0) -> list:
    import torch

    from megatron_gspo.samples import TrainSample

    size = SIZES[size_name]
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(SAMPLES_PER_STEP):
        length = PROMPT_TOKENS + size.response_tokens
        samples.append(
            TrainSample(
                tokens=torch.randint(0, size.vocab, (length,), generator=generator),
                prompt_length=PROMPT_TOKENS,
                group_id=index // GROUP_SIZE,
                advantages=torch.randn((), generator=generator),
                old_log_probs=-math.log(size.vocab)
                + 0.01 * torch.randn(size.response_tokens, generator=generator),
            )
        )
    return samples


def matmul_peak(size: int = 2048, seconds: float = 1.0) -> dict[str, float]:
    from vs_trl_workers import run_peak

    return run_peak(size, seconds)


class ModuleTimer:
    """Inclusive forward time per module type (forward pre/post hooks) and per token-dispatcher
    method. Modules inside the experts are not hooked: a hooked expert makes
    ``engine/experts.py`` fall back to upstream's per-expert modules."""

    def __init__(self, model) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._starts: dict[int, float] = {}
        self.handles = []
        self.restore: list = []
        inside_experts = set()
        for module in model.modules():
            if type(module).__name__ in ("SequentialMLP", "TEGroupedMLP", "GroupedMLP"):
                inside_experts.update(id(m) for m in module.modules() if m is not module)
        for module in model.modules():
            if id(module) in inside_experts:
                continue
            self.handles.append(module.register_forward_pre_hook(self._pre))
            self.handles.append(module.register_forward_hook(self._post))
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is not None and not self.restore:
                self._wrap_dispatcher(type(dispatcher))

    def _wrap_dispatcher(self, cls) -> None:
        for name in (
            "dispatch_preprocess",
            "token_dispatch",
            "dispatch_postprocess",
            "combine_preprocess",
            "token_combine",
            "combine_postprocess",
        ):
            original = cls.__dict__.get(name)
            if original is None:
                continue

            def timed(*args, _original=original, _label=f"{cls.__name__}.{name}", **kwargs):
                start = clock()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.seconds[_label] += clock() - start
                    self.calls[_label] += 1

            setattr(cls, name, timed)
            self.restore.append((cls, name, original))

    def _pre(self, module, args):
        self._starts[id(module)] = clock()

    def _post(self, module, args, output):
        start = self._starts.pop(id(module), None)
        if start is not None:
            name = type(module).__name__
            self.seconds[name] += clock() - start
            self.calls[name] += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for cls, name, original in self.restore:
            setattr(cls, name, original)


def time_ours(samples: list, cfg, steps: int, profile: int, cprofile: int) -> dict[str, Any]:
    from megatron_gspo.engine import TrainEngine
    from megatron_gspo.engine.model import unwrap

    engine = TrainEngine(cfg)
    mini = SAMPLES_PER_STEP // MINI_BATCHES
    batches = [samples[i * mini : (i + 1) * mini] for i in range(MINI_BATCHES)]
    times: dict[str, list[float]] = defaultdict(list)
    for step in range(steps + 1):  # the first is a warm-up
        start = clock()
        engine.forward_log_probs(samples)
        recompute = clock() - start
        for batch in batches:
            start = clock()
            metrics = engine.forward_backward(batch)
            middle = clock()
            engine.optimizer_step(metrics)
            end = clock()
            if step:
                times["forward_backward"].append(middle - start)
                times["optimizer"].append(end - middle)
        if step:
            times["recompute"].append(recompute)
    result = {name: statistics.median(values) for name, values in times.items()}
    if profile:
        result["profile"] = profile_steps(
            lambda batch: engine.optimizer_step(engine.forward_backward(batch)),
            batches,
            profile,
            unwrap(engine.model[0]),
        )
    if cprofile:
        result["cprofile"] = cprofile_steps(
            lambda batch: engine.optimizer_step(engine.forward_backward(batch)), batches, cprofile
        )
    return result


def time_hf(
    samples: list, size_name: str, steps: int, profile: int, cprofile: int
) -> dict[str, Any]:
    """The transformers model, trained with plain autograd as TRL trains it."""
    import torch

    from megatron_gspo.rollout.hf_model import build_hf_model

    size = SIZES[size_name]
    model = build_hf_model(model_config(size), seed=1234)
    model.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    mini = SAMPLES_PER_STEP // MINI_BATCHES
    response = size.response_tokens

    def train(batch: list) -> None:
        tokens = torch.stack([s.tokens for s in batch])
        advantages = torch.stack([s.advantages for s in batch])
        logits = model(input_ids=tokens, logits_to_keep=response + 1).logits[:, :-1]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        log_probs = log_probs.gather(-1, tokens[:, -response:, None]).squeeze(-1)
        (-(log_probs.mean(-1) * advantages).mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    batches = [samples[i * mini : (i + 1) * mini] for i in range(MINI_BATCHES)]
    times = []
    for step in range(steps + 1):
        for batch in batches:
            start = clock()
            train(batch)
            if step:
                times.append(clock() - start)
    result: dict[str, Any] = {"train": statistics.median(times)}
    if profile:
        result["profile"] = profile_steps(train, batches, profile, model)
    if cprofile:
        result["cprofile"] = cprofile_steps(train, batches, cprofile)
    return result


def profile_steps(train, batches: list, steps: int, model) -> dict[str, Any]:
    """Torch-profile ``steps`` training steps: self CPU time per operator, forward time per
    module type, and the time outside any operator."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    timer = ModuleTimer(model)
    # Wall time here whatever --wall says: the profiler's operator times are wall times.
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for step in range(steps):
            train(batches[step % len(batches)])
    wall = (time.perf_counter() - start) / steps
    timer.remove()
    events = profiler.key_averages()
    operators = sorted(
        (
            (event.key, event.self_cpu_time_total / 1e6 / steps, event.count // steps)
            for event in events
        ),
        key=lambda item: -item[1],
    )
    in_operators = sum(seconds for _, seconds, _ in operators)
    del torch
    return {
        "step_s_profiled": wall,
        "outside_operators_s": max(wall - in_operators, 0.0),
        "operators": operators[:25],
        "modules": sorted(
            (
                (name, seconds / steps, timer.calls[name] // steps)
                for name, seconds in timer.seconds.items()
            ),
            key=lambda item: -item[1],
        )[:20],
    }


def cprofile_steps(train, batches: list, steps: int, top: int = 25) -> dict[str, Any]:
    """Profile ``steps`` training steps with ``cProfile`` timed by the process CPU clock: the
    functions with the most self time and with the most inclusive time, seconds per step."""
    import cProfile
    import pstats

    profiler = cProfile.Profile(time.process_time)
    start = time.process_time()
    profiler.enable()
    for step in range(steps):
        train(batches[step % len(batches)])
    profiler.disable()
    total = (time.process_time() - start) / steps
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, ...)

    def label(key: tuple) -> str:
        filename, line, name = key
        if filename == "~":  # a builtin or C function: name is "<method 'x' of 'y' objects>"
            return name
        parts = Path(filename).parts
        short = "/".join(parts[-2:])
        return f"{short}:{line}({name})"

    rows = [
        (label(key), value[2] / steps, value[3] / steps, value[1] // steps)
        for key, value in stats.items()
    ]
    return {
        "step_cpu_s_profiled": total,
        "self": sorted(rows, key=lambda row: -row[1])[:top],
        "inclusive": sorted(rows, key=lambda row: -row[2])[:top],
    }


def print_cprofile(title: str, profile: dict[str, Any]) -> None:
    total = profile["step_cpu_s_profiled"]
    print(f"\n{title}: {total * 1e3:.1f} ms CPU per training step under cProfile")
    for kind, column in (("self", 1), ("inclusive", 2)):
        print(f"  top functions by {kind} CPU time (ms per step, share, calls per step):")
        for row in profile[kind]:
            print(
                f"    {row[column] * 1e3:8.2f}  {100 * row[column] / total:5.1f}%  "
                f"{row[3]:6d}  {row[0]}"
            )


def print_profile(title: str, profile: dict[str, Any]) -> None:
    wall = profile["step_s_profiled"]
    outside = profile["outside_operators_s"]
    print(f"\n{title}: {wall * 1e3:.1f} ms per training step under the profiler")
    print(
        f"  outside any operator (Python, framework): {outside * 1e3:.1f} ms "
        f"({100 * outside / wall:.0f}%)"
    )
    print("  top operators by self CPU time (ms per step, calls per step):")
    for name, seconds, calls in profile["operators"]:
        print(f"    {seconds * 1e3:8.2f}  {calls:6d}  {name}")
    print("  forward time per module type (inclusive, ms per step, calls per step):")
    for name, seconds, calls in profile["modules"]:
        print(f"    {seconds * 1e3:8.2f}  {calls:6d}  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument(
        "--steps", type=int, default=3, help="timed rollout steps (4 mini-batches each)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="print a torch profile")
    parser.add_argument(
        "--cprofile", action="store_true", help="print a cProfile by process CPU time"
    )
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--wall", action="store_true", help="time by wall clock, not CPU time")
    parser.add_argument("--skip-hf", action="store_true", help="only our trainer")
    args = parser.parse_args()

    import torch

    if args.wall:
        _CLOCK[0] = time.perf_counter
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    size = SIZES[args.size]
    samples = make_samples(args.size)
    flops_step = training_flops(
        size, size.vocab, [PROMPT_TOKENS] * PROMPTS_PER_STEP, size.response_tokens
    )
    flops_mini = flops_step / MINI_BATCHES
    peak = matmul_peak()
    profile_count = args.profile_steps if args.profile else 0
    cprofile_count = args.profile_steps if args.cprofile else 0
    ours = time_ours(samples, make_config(args.size), args.steps, profile_count, cprofile_count)
    hf = (
        None
        if args.skip_hf
        else time_hf(samples, args.size, args.steps, profile_count, cprofile_count)
    )
    peak_after = matmul_peak()
    suffix = "" if args.wall else "_cpu"
    fp32 = max(peak["fp32_gflops" + suffix], peak_after["fp32_gflops" + suffix])
    bf16 = max(peak["bf16_gflops" + suffix], peak_after["bf16_gflops" + suffix])

    def utilisation(seconds: float) -> str:
        gflops = flops_mini / seconds / 1e9
        return (
            f"{gflops:7.1f} GFLOP/s = {100 * gflops / fp32:5.1f}% of fp32, "
            f"{100 * gflops / bf16:5.1f}% of bf16"
        )

    clock_name = "wall" if args.wall else "CPU"
    print(
        f"size {args.size}, {args.threads} thread(s), {clock_name} time; "
        f"matmul peak {fp32:.0f} GFLOP/s fp32, {bf16:.0f} bf16"
    )
    print(f"model FLOPs of one mini-batch training step: {flops_mini / 1e9:.2f} GFLOP")
    train = ours["forward_backward"] + ours["optimizer"]
    print(
        f"ours: forward_backward {ours['forward_backward'] * 1e3:.1f} ms + optimizer "
        f"{ours['optimizer'] * 1e3:.1f} ms = {train * 1e3:.1f} ms per mini-batch: "
        f"{utilisation(train)}"
    )
    print(
        f"ours: old-log-prob recompute over {SAMPLES_PER_STEP} samples "
        f"{ours['recompute'] * 1e3:.1f} ms"
    )
    if hf is not None:
        print(
            f"HF autograd (TRL's path): {hf['train'] * 1e3:.1f} ms per mini-batch: "
            f"{utilisation(hf['train'])}; ours / HF = {train / hf['train']:.2f}"
        )
    if args.profile:
        print_profile("ours", ours["profile"])
        if hf is not None:
            print_profile("HF autograd", hf["profile"])
    if args.cprofile:
        print_cprofile("ours", ours["cprofile"])
        if hf is not None:
            print_cprofile("HF autograd", hf["cprofile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
