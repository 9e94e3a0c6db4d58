"""Worker of ``test_route_replay.py`` (a fresh process: the CPU shims change torch and Megatron
globals). Prints one JSON object ``{check: "ok" | failure}``.

The embedded engine, loaded with the trainer's weights, rolls out three-turn episodes with R3
routes; the trainer's forward replaying the assembled routes gives the engine's log-probs of
every turn's tokens. Routes of the observations changed to other experts change the later
turns' log-probs (the check can fail). The episodes also carry the engine's combine weights
(R3 with ``algo.routing_replay_weights=replayed`` asks for them): every row's weights sit at its
ids, as a teacher-forced forward of the whole trajectory gives them, and a trainer replaying
ids and weights reproduces every turn's log-probs too."""

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
from megatron_gspo.engine.parallel import destroy_parallel  # noqa: E402
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


class FailsResetOnOddPrompts(ScriptedEnvironment):
    """The scripted environment, whose ``reset`` raises for prompts starting with an odd id."""

    def reset(self, prompt):
        if prompt.prompt_ids[0] % 2:
            raise RuntimeError("scripted reset failure")
        return super().reset(prompt)


def episodes(engine: TrainEngine, cfg: TrainConfig, factory=ScriptedEnvironment):
    rollout = EmbeddedEngine(cfg.model, seed=0)
    rollout.sync_weights(iter_hf_weights(engine.policy_chunks, cfg), version=1)
    batch = [
        Prompt([(7 * i + j) % 28 + 1 for j in range(3 + i)], "", None, {}, f"p{i}", i)
        for i in range(3)
    ]
    try:
        # The engine's combine weights too, as R3 with replayed weights asks for them: the same
        # episodes serve the recomputed and the replayed weights' checks.
        sampling = dataclasses.replace(Sampling.training(cfg), return_route_weights=True)
        producer = EnvironmentProducer(
            rollout,
            Task(None, None, [], EOS),
            None,
            sampling,
            EpisodeSettings.from_config(cfg),
            factory=factory,
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

    def route_weights_sit_at_their_ids():
        """Each row's weights (joined from the calls that first ran it: a turn's own decode
        steps, an observation's next prefill) are Qwen3-MoE's rule at that row's ids on the
        router logits of a teacher-forced forward of the whole trajectory (float64 softmax,
        renormalised over the ids), expert by expert in the ids' order."""
        reference = EmbeddedEngine(cfg.model, seed=0)
        reference.sync_weights(iter_hf_weights(engine.policy_chunks, cfg), version=1)
        try:
            assert reference.hf_model.config.norm_topk_prob
            for sample in samples:
                ids, weights = sample.rollout_routes.long(), sample.rollout_route_weights
                assert weights is not None and weights.dtype == torch.float32
                assert weights.shape == ids.shape, (weights.shape, ids.shape)
                with torch.no_grad():
                    output = reference.hf_model(
                        input_ids=sample.tokens[:-1].unsqueeze(0), output_router_logits=True
                    )
                for layer, logits in enumerate(output.router_logits):
                    chosen = logits.double().softmax(-1).gather(1, ids[:, layer])
                    expected = chosen / chosen.sum(-1, keepdim=True)
                    gap = float((expected - weights[:, layer].double()).abs().max())
                    assert gap < 1e-5, (layer, gap)
        finally:
            reference.close()

    def replayed_weights_reproduce_every_turn():
        """A trainer replaying the engine's ids and weights (R3, routing_replay_weights=
        replayed) gives every turn's log-probs as the engine did; with the weights of the
        observation rows halved, the later turns' log-probs move (the weights are used)."""
        replayed_cfg = config()
        replayed_cfg.algo.routing_replay_weights = "replayed"
        destroy_parallel(destroy_process_group=False)
        replaying = TrainEngine(replayed_cfg)
        measured = gaps(replaying, samples)
        assert max(measured) < 2e-5, measured
        changed = []
        for sample in samples:
            rows = (~sample.loss_mask).nonzero().flatten() + sample.prompt_length
            weights = sample.rollout_route_weights.clone()
            weights[rows] *= 0.5
            changed.append(dataclasses.replace(sample, rollout_route_weights=weights))
        measured = gaps(replaying, changed)
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

    def episodes_that_failed_at_reset_train_beside_the_others():
        """An episode whose environment failed in reset never reached the engine: no routes, one
        masked filler token. R3 replays filler routes for it; the other episodes still
        reproduce the engine's log-probs, and a training step takes the batch."""
        mixed = episodes(engine, cfg, factory=FailsResetOnOddPrompts)
        failed = [s for s in mixed if s.finish_reason == "abort"]
        assert failed and len(failed) < len(mixed), [s.finish_reason for s in mixed]
        assert all(s.rollout_routes is None and s.response_length == 1 for s in failed)
        computed = engine.forward_log_probs(mixed).log_probs
        measured = [
            float((lp - s.rollout_log_probs)[s.loss_mask].abs().max())
            for lp, s in zip(computed, mixed)
            if s.finish_reason != "abort"
        ]
        assert max(measured) < 2e-5, measured
        for sample, values in zip(mixed, computed):
            sample.old_log_probs, sample.advantages = values, torch.tensor(1.0)
        engine.train_step(mixed)

    check("episodes_have_several_turns", episodes_have_several_turns)
    check("replay_reproduces_every_turn", replay_reproduces_every_turn)
    check(
        "wrong_observation_routes_change_later_turns", wrong_observation_routes_change_later_turns
    )
    check("route_weights_sit_at_their_ids", route_weights_sit_at_their_ids)
    check(
        "an_update_moves_towards_positive_advantages", an_update_moves_towards_positive_advantages
    )
    check(
        "episodes_that_failed_at_reset_train_beside_the_others",
        episodes_that_failed_at_reset_train_beside_the_others,
    )
    # Last: it builds a second trainer (the first one's initial weights: the same seed).
    check("replayed_weights_reproduce_every_turn", replayed_weights_reproduce_every_turn)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
