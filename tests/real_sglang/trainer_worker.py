"""Worker of ``test_trainer_sync.py``: the training engine (Megatron-Core, one process, gloo)
against the real SGLang server. Prints one JSON object ``{check: "ok" | failure text}``.

Usage: ``python trainer_worker.py URL`` with the server's key in ``MEGATRON_GSPO_SGLANG_API_KEY``.

Each weight-sync check gives the trainer new weights, syncs them with one transport (through
``sync_weights_paused``, as the RL loop does), samples from the server and recomputes the
samples' log-probs with the trainer (``TrainEngine.forward_log_probs``, R3 replaying the
server's routes): the two agree to float32 rounding, the server reports the new weight version,
and the transport reports exactly the bytes of the model.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_gspo.config import TrainConfig  # noqa: E402
from megatron_gspo.engine.hf_import_export import iter_hf_weights  # noqa: E402
from megatron_gspo.engine.train_step import TrainEngine  # noqa: E402
from megatron_gspo.rollout.auth import api_key_from_environment  # noqa: E402
from megatron_gspo.rollout.sglang_client import SGLangEngine  # noqa: E402
from megatron_gspo.rollout.sglang_protocol import RouteLayout  # noqa: E402
from megatron_gspo.rollout.types import GenerateRequest, sync_weights_paused  # noqa: E402
from megatron_gspo.samples import TrainSample  # noqa: E402
from megatron_gspo.samples.routes import topk_sets_differ  # noqa: E402
from megatron_gspo.weight_sync import (  # noqa: E402
    DiskTransport,
    DistributedTransport,
    TensorTransport,
)
from tests.engine.worker_launch import run_checks  # noqa: E402
from tests.real_sglang.server import server_model_config  # noqa: E402

TOLERANCE = 1e-5
"""Largest |trainer - server| log-prob: float32 rounding of two different kernels (the measured
gap is about 1e-6)."""

PROMPTS = [[1, 2, 3], [7, 7, 1, 0, 5], [4], [9, 8, 7, 6, 5, 4, 3], [3, 3], [0, 1, 2, 3, 4, 5]]


def make_engine() -> TrainEngine:
    model = server_model_config()
    cfg = TrainConfig(seed=3, model=model)
    cfg.algo.routing_replay = "r3"
    cfg.rollout.temperature = 0.8
    return TrainEngine(cfg)


ENGINE = None
URL = ""
VERSION = [0]


def engine() -> TrainEngine:
    global ENGINE
    if ENGINE is None:
        ENGINE = make_engine()
    return ENGINE


def perturb(trainer: TrainEngine, seed: int) -> None:
    """New trainer weights: every parameter moves by 5% of its scale (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in trainer.policy_chunks:
            for parameter in chunk.parameters():
                noise = torch.randn(parameter.shape, generator=generator)
                parameter.add_(0.05 * parameter.abs().mean() * noise)


def model_bytes(trainer: TrainEngine) -> tuple[int, int]:
    pairs = list(iter_hf_weights(trainer.policy_chunks, trainer.cfg))
    return len(pairs), sum(t.numel() * t.element_size() for _, t in pairs)


def sample_and_compare(client: SGLangEngine, trainer: TrainEngine, version: int) -> dict:
    """Generate with routes from the server, recompute with the trainer replaying them."""
    cfg = trainer.cfg
    results = client.generate(
        [
            GenerateRequest(
                prompt,
                max_new_tokens=10,
                temperature=cfg.rollout.temperature,
                return_routed_experts=True,
            )
            for prompt in PROMPTS
        ]
    )
    samples = [
        TrainSample(
            tokens=torch.tensor(list(prompt) + result.output_ids),
            prompt_length=len(prompt),
            rollout_log_probs=torch.from_numpy(result.output_log_probs),
            rollout_routes=torch.from_numpy(result.routed_experts),
        )
        for prompt, result in zip(PROMPTS, results)
    ]
    assert {r.weight_version for r in results} == {version}, [r.weight_version for r in results]
    forward = trainer.forward_log_probs(samples, record_routes=True)
    gap = max(
        float((ours - s.rollout_log_probs).abs().max())
        for ours, s in zip(forward.log_probs, samples)
    )
    moved = torch.cat(
        [
            topk_sets_differ(ours, s.rollout_routes).view(-1)
            for ours, s in zip(forward.routes, samples)
        ]
    )
    return {"gap": gap, "route_change": float(moved.float().mean()), "samples": samples}


def sync_and_check(transport, seed: int) -> None:
    trainer = engine()
    perturb(trainer, seed)
    VERSION[0] += 1
    version = VERSION[0]
    client = SGLangEngine(
        [URL],
        RouteLayout.from_model_config(trainer.cfg.model),
        weight_transport=transport,
        api_key=api_key_from_environment(),
        request_timeout_s=120,
    )
    try:
        stats = sync_weights_paused(
            client, iter_hf_weights(trainer.policy_chunks, trainer.cfg), version
        )
        count, size = model_bytes(trainer)
        assert (stats.num_tensors, stats.num_bytes) == (count, size), (stats, count, size)
        assert stats.seconds > 0
        assert client.info()["servers"][0]["weight_version"] == str(version)
        outcome = sample_and_compare(client, trainer, version)
    finally:
        client.close()
    assert outcome["gap"] < TOLERANCE, outcome["gap"]
    # Same weights, so the trainer's native routes are the server's (fp32 near-ties aside).
    assert outcome["route_change"] < 0.01, outcome["route_change"]
    print(f"# {transport.name}: gap {outcome['gap']:.2e}, {stats.num_bytes} bytes", file=sys.stderr)


def check_sync_by_disk() -> None:
    sync_and_check(DiskTransport(config_json=_config_json()), seed=1)


def check_sync_by_tensor() -> None:
    sync_and_check(TensorTransport(bucket_bytes=200_000), seed=2)


def check_sync_by_distributed() -> None:
    transport = DistributedTransport("127.0.0.1", 0, [1], backend="gloo", bucket_bytes=200_000)
    sync_and_check(transport, seed=3)
    assert transport._group is None  # close() destroyed the group here and on the server


def check_r3_replay_is_what_reproduces_the_log_probs() -> None:
    """Replaying the server's routes is what makes the trainer's log-probs equal the server's:
    with the routes of other tokens (each sample's routes rolled by one row) the log-probs
    move far beyond rounding."""
    trainer = engine()
    client = SGLangEngine(
        [URL],
        RouteLayout.from_model_config(trainer.cfg.model),
        api_key=api_key_from_environment(),
        request_timeout_s=120,
    )
    try:
        outcome = sample_and_compare(client, trainer, VERSION[0])
    finally:
        client.close()
    assert outcome["gap"] < TOLERANCE, outcome["gap"]
    samples = outcome["samples"]
    for sample in samples:
        sample.rollout_routes = torch.roll(sample.rollout_routes, 1, dims=0)
    shifted = trainer.forward_log_probs(samples).log_probs
    gap = max(float((ours - s.rollout_log_probs).abs().max()) for ours, s in zip(shifted, samples))
    assert gap > 1e-2, gap


def _config_json() -> str:
    from megatron_gspo.convert.hf_config import hf_config_from_model_config

    return hf_config_from_model_config(server_model_config()).to_json_string()


CHECKS = {
    name[len("check_") :]: function
    for name, function in list(globals().items())
    if name.startswith("check_")
}


def main() -> None:
    global URL
    URL = sys.argv[1]
    print(json.dumps(run_checks(CHECKS, traceback_limit=8)))


if __name__ == "__main__":
    sys.exit(main())
