"""Held-out evaluation: greedy accuracy, mean reward and pass@k of the run's producer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_gspo.config import TrainConfig
from megatron_gspo.metrics.step import pass_at_k
from megatron_gspo.production.producer import SampleProducer, warn_aborted
from megatron_gspo.production.sampling import Sampling

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt


def evaluate(
    make_producer: Callable[[Sampling], SampleProducer], prompts: list[Prompt], cfg: TrainConfig
) -> dict[str, float]:
    """Held-out prompts: greedy accuracy, mean reward and pass@k of sampled responses, with the
    run's producer (``make_producer``) at evaluation's sampling settings.

    A response counts as correct when its reward reaches ``eval.correct_reward``.
    """
    if not prompts:
        return {}
    samples_per_prompt = cfg.eval.num_samples
    metrics = {}
    for name, temperature, n in (
        ("greedy", 0.0, 1),
        ("sampled", cfg.eval.temperature, samples_per_prompt),
    ):
        producer = make_producer(Sampling.evaluation(cfg, temperature=temperature, group_size=n))
        samples = producer.produce(prompts, step=-1).samples
        warn_aborted(samples, f"{name} evaluation samples", "they are scored as they stopped")
        correct = [s.reward >= cfg.eval.correct_reward for s in samples]
        metrics[f"eval/{name}_reward_mean"] = sum(s.reward for s in samples) / len(samples)
        if name == "greedy":
            metrics["eval/greedy_accuracy"] = sum(correct) / len(correct)
        else:
            for k in sorted({1, n}):
                values = [
                    pass_at_k(n, sum(correct[i * n : (i + 1) * n]), k) for i in range(len(prompts))
                ]
                metrics[f"eval/pass@{k}"] = sum(values) / len(values)
    return metrics
