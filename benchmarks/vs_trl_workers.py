"""What runs inside one ``vs_trl.py`` worker process: the timeline, our run, TRL's run and the
matmul peak of this machine."""

from __future__ import annotations

import contextlib
import importlib
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from vs_trl_job import MINI_BATCHES, our_overrides, trl_config

PHASES = (
    "rollout",
    "old_log_probs",
    "reward",
    "forward_backward",
    "optimizer",
    "weight_sync",
    "other",
)


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only)")


def _reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


class Timeline:
    """Step marks and timed phases of one run: wall time (``time.perf_counter``) and, for the
    whole step, CPU time of the process (``time.process_time``, all threads)."""

    def __init__(self) -> None:
        self.step_starts: list[float] = []
        self.step_ends: list[float] = []
        self.cpu_starts: list[float] = []
        self.cpu_ends: list[float] = []
        self.events: list[tuple[str, float, float]] = []
        self.cpu_events: list[tuple[str, float, float]] = []

    def mark_start(self) -> None:
        self.step_starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def mark_end(self) -> None:
        self.step_ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())

    @contextlib.contextmanager
    def phase(self, name: str):
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.events.append((name, start, time.perf_counter() - start))
            self.cpu_events.append((name, start, time.process_time() - cpu_start))

    def wrap(self, name: str, function: Callable) -> Callable:
        """``function`` timed as phase ``name``."""

        def timed(*args, **kwargs):
            with self.phase(name):
                return function(*args, **kwargs)

        return timed

    def steps(self) -> list[dict[str, float]]:
        """Per rollout step: ``step`` (start to next start; the last: to its end) and phases."""
        starts = self.step_starts
        result = []
        for index, start in enumerate(starts):
            last = index + 1 == len(starts)
            end = self.step_ends[-1] if last else starts[index + 1]
            cpu_end = self.cpu_ends[-1] if last else self.cpu_starts[index + 1]
            phases = defaultdict(float)
            for name, event_start, seconds in self.events:
                if start <= event_start < end:
                    phases[name] += seconds
            step = {"step": end - start, "cpu": cpu_end - self.cpu_starts[index]}
            step.update({name: phases.get(name, 0.0) for name in PHASES if name != "other"})
            step["other"] = step["step"] - sum(step[name] for name in PHASES if name != "other")
            cpu = defaultdict(float)
            for name, event_start, seconds in self.cpu_events:
                if start <= event_start < end:
                    cpu[name] += seconds
            step["cpu_phases"] = dict(cpu)
            result.append(step)
        return result


def _finish(
    timeline: Timeline, rewards: list[float], baseline_kb: int, import_peak_kb: int, reset: bool
) -> dict[str, Any]:
    peak_kb = _proc_status_kb("VmHWM")
    return {
        "steps": timeline.steps(),
        "rewards": rewards,
        "rss_post_import_mb": baseline_kb / 1024,
        "peak_rss_mb": max(peak_kb, import_peak_kb) / 1024,
        "peak_above_import_mb": (peak_kb - baseline_kb) / 1024 if reset else None,
        "peak_reset_ok": reset,
    }


def run_ours(
    job: dict[str, Any], work_dir: str, *, old_log_probs: str, rollout_dtype: Optional[str]
) -> dict[str, Any]:
    # Everything the loop imports lazily, imported before the baseline is taken.
    import hydra  # noqa: F401
    import megatron.core  # noqa: F401
    import omegaconf  # noqa: F401
    import torch  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

    import megatron_gspo
    import megatron_gspo.convert.hf_config  # noqa: F401
    import megatron_gspo.data  # noqa: F401
    import megatron_gspo.reward  # noqa: F401
    import megatron_gspo.rollout.embedded  # noqa: F401
    import megatron_gspo.rollout.factory  # noqa: F401
    from megatron_gspo import loop
    from megatron_gspo.config.loader import load_config
    from megatron_gspo.engine import TrainEngine

    package = Path(megatron_gspo.__file__).parent  # the measured checkout's, not an installed one
    # The rank-0 driver: driver/rollout_driver.py since the package was divided, driver.py before.
    driver = importlib.import_module(
        "megatron_gspo.driver.rollout_driver"
        if (package / "driver" / "rollout_driver.py").exists()
        else "megatron_gspo.driver"
    )
    # The weight-export module under its name in the measured checkout (renamed after 50ab85b).
    for name in ("hf_import_export", "hf_weights"):
        if (package / "engine" / f"{name}.py").exists():
            importlib.import_module(f"megatron_gspo.engine.{name}")
            break
    import_peak_kb = _proc_status_kb("VmHWM")
    baseline_kb = _proc_status_kb("VmRSS")
    reset = _reset_peak_rss()

    timeline = Timeline()
    engines: list[Any] = []
    # Generation and scoring live in production/single_turn.py (production.py, then driver.py,
    # in older checkouts): patched where the producer looks them up.
    if (package / "production" / "single_turn.py").exists():
        stages = importlib.import_module("megatron_gspo.production.single_turn")
    elif (package / "production.py").exists():
        stages = importlib.import_module("megatron_gspo.production")
    else:
        stages = driver
    generate, sync_weights, build_rollout = (
        stages.generate,
        driver.RolloutDriver.sync_weights,
        driver.build_rollout,
    )

    def timed_generate(*args, **kwargs):
        timeline.mark_start()
        with timeline.phase("rollout"):
            return generate(*args, **kwargs)

    def timed_sync(*args, **kwargs):
        with timeline.phase("weight_sync"):
            result = sync_weights(*args, **kwargs)
        if timeline.step_starts:  # not the initial sync
            timeline.mark_end()
        return result

    def kept_rollout(*args, **kwargs):
        engine = build_rollout(*args, **kwargs)
        # The rollout engine's own copy of the weights (TRL generates with the trained model).
        tensors = [tensor for _, tensor in engine.hf_state()]
        engines.append(
            {
                "engine_weights_mb": sum(t.numel() * t.element_size() for t in tensors) / 2**20,
                "engine_dtype": str(tensors[0].dtype).removeprefix("torch."),
            }
        )
        return engine

    stages.generate, driver.RolloutDriver.sync_weights = timed_generate, timed_sync
    driver.build_rollout = kept_rollout
    stages.score = timeline.wrap("reward", stages.score)
    loop.set_old_log_probs = timeline.wrap("old_log_probs", loop.set_old_log_probs)
    TrainEngine.forward_backward = timeline.wrap("forward_backward", TrainEngine.forward_backward)
    TrainEngine.optimizer_step = timeline.wrap("optimizer", TrainEngine.optimizer_step)

    cfg = load_config(
        None,
        our_overrides(job, work_dir, old_log_probs=old_log_probs, rollout_dtype=rollout_dtype),
    )
    records = loop.run(cfg)
    rewards = [record["reward_mean"] for record in records]
    result = _finish(timeline, rewards, baseline_kb, import_peak_kb, reset)
    result.update(engines[0])
    return result


def run_trl(job: dict[str, Any], work_dir: str) -> dict[str, Any]:
    import datasets
    import torch
    import transformers
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
    import trl

    from megatron_gspo.data.synthetic import score_digit_response

    import_peak_kb = _proc_status_kb("VmHWM")
    baseline_kb = _proc_status_kb("VmRSS")
    reset = _reset_peak_rss()

    timeline = Timeline()
    rewards: list[float] = []
    rows = json.loads((Path(job["dir"]) / "prompts.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(job["dir"])
    for row in rows[:4]:
        ids = tokenizer(text=row["prompt"])["input_ids"]
        if ids != row["prompt_ids"]:
            raise RuntimeError(f"TRL would see prompt ids {ids}, ours {row['prompt_ids']}")

    def digit_reward(completions, completion_ids, answer, **kwargs):
        scores = [score_digit_response(ids, target) for ids, target in zip(completion_ids, answer)]
        rewards.append(sum(scores) / len(scores))
        return scores

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            timeline.mark_start()
            return super()._generate_and_score_completions(inputs)

        def _generate_single_turn(self, *args, **kwargs):
            with timeline.phase("rollout"):
                return super()._generate_single_turn(*args, **kwargs)

        def _calculate_rewards(self, *args, **kwargs):
            with timeline.phase("reward"):
                return super()._calculate_rewards(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            # Without grad: the old-log-prob forward; with grad: part of compute_loss.
            if torch.is_grad_enabled():
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with timeline.phase("old_log_probs"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def compute_loss(self, *args, **kwargs):
            with timeline.phase("forward_backward"):
                return super().compute_loss(*args, **kwargs)

        def _clip_grad_norm(self, *args, **kwargs):
            with timeline.phase("optimizer"):
                return super()._clip_grad_norm(*args, **kwargs)

    class StepMarks(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            timeline.events.append(("optimizer", self.start, time.perf_counter() - self.start))

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % MINI_BATCHES == 0:
                timeline.mark_end()

    dataset = datasets.Dataset.from_list(
        [{"prompt": row["prompt"], "answer": row["answer"]} for row in rows]
    )
    trainer = TimedGRPOTrainer(
        model=job["dir"],
        reward_funcs=digit_reward,
        args=trl.GRPOConfig(**trl_config(job, work_dir)),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepMarks()],
    )
    trainer.accelerator.backward = timeline.wrap("forward_backward", trainer.accelerator.backward)
    trainer.train()
    return _finish(timeline, rewards, baseline_kb, import_peak_kb, reset)


def run_peak(size: int = 2048, seconds: float = 1.0) -> dict[str, Any]:
    """This machine's matmul peak at the worker's thread count: the best of repeated
    ``[size, size] @ [size, size]`` products in fp32 and in bf16 (AMX where the CPU has it),
    each repeated for about ``seconds`` after a warm-up. GFLOP/s = 2 size^3 / time, by wall time
    (``fp32_gflops``) and by the process's CPU time (``fp32_gflops_cpu``: all threads, so at 2
    threads about half the wall figure; on a shared machine the steadier of the two)."""
    import torch

    result: dict[str, Any] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator).to(dtype)
        b = torch.randn(size, size, generator=generator).to(dtype)
        out = torch.empty(size, size, dtype=dtype)
        torch.mm(a, b, out=out)
        best_wall = best_cpu = float("inf")
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            wall, cpu = time.perf_counter(), time.process_time()
            torch.mm(a, b, out=out)
            best_wall = min(best_wall, time.perf_counter() - wall)
            best_cpu = min(best_cpu, time.process_time() - cpu)
        result[f"{name}_gflops"] = 2 * size**3 / best_wall / 1e9
        result[f"{name}_gflops_cpu"] = 2 * size**3 / max(best_cpu, 1e-9) / 1e9
    result["matmul_size"] = size
    return result
