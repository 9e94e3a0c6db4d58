"""Worker of ``test_route_replay.py`` (a fresh process: the CPU shims change torch and Megatron
globals). Prints one JSON object ``{check: "ok" | failure}``.

The embedded engine, loaded with the trainer's weights, rolls out three-turn episodes with R3
routes; the trainer's forward replaying the assembled routes gives the engine's log-probs of
every turn's tokens. Routes of the observations changed to other experts change the later
turns' log-probs (the check can fail)."""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_gspo.config import TrainConfig, from_dict  # noqa: E402
from megatron_gspo.data.prompts import Prompt  # noqa: E402
from megatron_gspo.engine.hf_import_export import iter_hf_weights  # noqa: E402
from megatron_gspo.engine.train_step import TrainEngine  # noqa: E402
from megatron_gspo.production.episodes import EnvironmentProducer, EpisodeSettings  # noqa: E402
from megatron_gspo.production.sampling import Sampling  # noqa: E402
from megatron_gspo.production.task import Task  # noqa: E402
from megatron_gspo.rollout.embedded import EmbeddedEngine  # noqa: E402
from tests.envs.scripted import ScriptedEnvironment  # noqa: E402

VOCAB, EOS, OBSERVATION = 32, 31, [29, 30, 5]


def config() -> TrainConfig:
    return from_dict(
        TrainConfig,
        {
            "seed": 7,
            "model": {
                "vocab_size": VOCAB,
                "hidden_size": 64,
                "head_dim": 16,
                "num_layers": 2,
                "num_experts": 8,
                "moe_router_topk": 2,
                "init_std": 0.2,
            },
            "algo": {
                "rollout_batch_size": 3,
                "num_return_sequences_in_group": 2,
                "num_mini_batches": 1,
                "response_length": 40,
                "routing_replay": "r3",
            },
            "rollout": {"temperature": 0.9},
            "env": {
                "name": "single_turn",
                "options": {"turns": 3, "observation": OBSERVATION, "stop_token_ids": [1, 2, 3]},
            },
            "reward": {"functions": []},
        },
    )


def episodes(engine: TrainEngine, cfg: TrainConfig):
    rollout = EmbeddedEngine(cfg.model, seed=0)
    rollout.sync_weights(iter_hf_weights(engine.policy_chunks, cfg), version=1)
    batch = [
        Prompt([(7 * i + j) % 28 + 1 for j in range(3 + i)], "", None, {}, f"p{i}", i)
        for i in range(3)
    ]
    try:
        producer = EnvironmentProducer(
            rollout,
            Task(None, None, [], EOS),
            None,
            Sampling.training(cfg),
            EpisodeSettings.from_config(cfg),
            factory=ScriptedEnvironment,
        )
        return producer.produce(batch, 0).samples
    finally:
        rollout.close()


def gaps(engine: TrainEngine, samples) -> list[float]:
    """Per sample, the largest |trainer - engine| log-prob over the model's tokens."""
    computed = engine.forward_log_probs(samples).log_probs
    return [
        float((lp - s.rollout_log_probs)[s.loss_mask].abs().max())
        for lp, s in zip(computed, samples)
    ]


def main() -> None:
    cfg = config()
    engine = TrainEngine(cfg)
    samples = episodes(engine, cfg)
    results = {}

    def check(name, function):
        try:
            function()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=4)

    def episodes_have_several_turns():
        assert min(int(s.turns.max()) for s in samples) >= 1, [s.turns for s in samples]
        assert all((s.turns == -1).any() for s in samples)

    def replay_reproduces_every_turn():
        measured = gaps(engine, samples)
        assert max(measured) < 2e-5, measured

    def wrong_observation_routes_change_later_turns():
        changed = []
        for sample in samples:
            # Row t holds token t as an input: the observation tokens' own rows, each expert
            # moved to the next one (still K distinct experts).
            rows = (~sample.loss_mask).nonzero().flatten() + sample.prompt_length
            routes = sample.rollout_routes.clone()
            routes[rows] = (routes[rows].long() + 1).remainder(8).to(routes.dtype)
            changed.append(dataclasses.replace(sample, rollout_routes=routes))
        measured = gaps(engine, changed)
        assert max(measured) > 1e-3, measured

    def an_update_moves_towards_positive_advantages():
        """One optimizer step with +1 / -1 advantages per trajectory: the model's tokens of the
        +1 trajectories become more likely, of the -1 ones less (observations are context)."""
        for index, sample in enumerate(samples):
            sample.advantages = torch.tensor(1.0 if index % 2 == 0 else -1.0)
        before = engine.forward_log_probs(samples).log_probs
        for sample, values in zip(samples, before):
            sample.old_log_probs = values
        engine.train_step(samples)
        after = engine.forward_log_probs(samples).log_probs
        moved = [
            float((new - old)[s.loss_mask].mean()) for new, old, s in zip(after, before, samples)
        ]
        assert all(m > 0 for m in moved[0::2]) and all(m < 0 for m in moved[1::2]), moved

    check("episodes_have_several_turns", episodes_have_several_turns)
    check("replay_reproduces_every_turn", replay_reproduces_every_turn)
    check(
        "wrong_observation_routes_change_later_turns", wrong_observation_routes_change_later_turns
    )
    check(
        "an_update_moves_towards_positive_advantages", an_update_moves_towards_positive_advantages
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
