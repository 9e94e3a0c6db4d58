"""How a producer samples: every parameter of its requests, their seeds, and the finishing rules
applied to the scored samples (:class:`FinishSettings`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from megatron_gspo.config import TrainConfig
from megatron_gspo.rollout import GenerateRequest
from megatron_gspo.runtime.seeds import step_seed


@dataclass(frozen=True)
class FinishSettings:
    """The rules :func:`~megatron_gspo.production.producer.finish_samples` applies after scoring:
    DAPO's over-long penalty and the truncation mask."""

    response_length: int
    """``algo.response_length``: the length the over-long buffer counts back from."""
    overlong_buffer: int
    """``reward.overlong_buffer``; 0: no over-long penalty."""
    overlong_penalty_factor: float
    """``reward.overlong_penalty_factor``."""
    mask_truncated: bool
    """``algo.mask_truncated``: truncated responses are kept out of the loss."""

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> FinishSettings:
        return cls(
            response_length=cfg.algo.response_length,
            overlong_buffer=cfg.reward.overlong_buffer,
            overlong_penalty_factor=cfg.reward.overlong_penalty_factor,
            mask_truncated=cfg.algo.mask_truncated,
        )


@dataclass(frozen=True)
class Sampling:
    """How a producer samples: the training settings (:meth:`training`) or evaluation's
    (:meth:`evaluation`). :meth:`request` is the one place a request is built."""

    temperature: float
    """0: greedy."""
    top_p: float
    """1: no nucleus truncation."""
    top_k: int
    """-1: no top-k truncation."""
    min_new_tokens: int
    """The stop tokens cannot be sampled before a response has this many tokens."""
    max_new_tokens: int
    """``algo.response_length``: the tokens after the prompt (of an episode: all of its turns and
    observations together)."""
    group_size: int
    """Samples per prompt."""
    return_routes: bool
    """Ask the engine for the routes of every token (R3, the routing metrics)."""
    seed: int
    """The base of the sampling seeds (:meth:`prompt_seed`): ``rollout.seed``, or the run's seed
    when that is null."""
    finish: Optional[FinishSettings] = None
    """The finishing rules of the scored samples (training); None: the rewards are left as they
    are (evaluation, which reports the rewards themselves)."""
    retokenize: bool = False
    """``rollout.retokenize_responses``: decode every response and encode it again before
    scoring (:mod:`megatron_gspo.production.retokenization`); training only."""
    return_route_weights: bool = False
    """With ``return_routes``: also the combine weights of the engine's routes (R3 with
    ``algo.routing_replay_weights=replayed``, the embedded engine)."""

    @classmethod
    def training(cls, cfg: TrainConfig) -> Sampling:
        return cls(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            min_new_tokens=cfg.rollout.min_new_tokens,
            max_new_tokens=cfg.algo.response_length,
            group_size=cfg.algo.num_return_sequences_in_group,
            return_routes=cfg.requests_rollout_routes,
            return_route_weights=cfg.requests_rollout_route_weights,
            seed=cfg.rollout.seed if cfg.rollout.seed is not None else cfg.seed,
            finish=FinishSettings.from_config(cfg),
            retokenize=cfg.rollout.retokenize_responses,
        )

    @classmethod
    def evaluation(cls, cfg: TrainConfig, *, temperature: float, group_size: int) -> Sampling:
        """The training settings at ``temperature`` (0: greedy) and ``group_size``, without
        routes, finishing or retokenization (evaluation measures the task on what the model
        wrote). Arguments, not a modified config, because the config rejects
        ``rollout.temperature=0``."""
        return dataclasses.replace(
            cls.training(cfg),
            temperature=temperature,
            group_size=group_size,
            return_routes=False,
            return_route_weights=False,
            finish=None,
            retokenize=False,
        )

    def prompt_seed(self, step: int, index: int) -> int:
        """Seed of the requests of prompt ``index`` of step ``step`` (evaluation: step -1)."""
        return step_seed(self.seed, step) * 100_003 + index

    def request(
        self,
        input_ids: Sequence[int],
        *,
        seed: int,
        stop_token_ids: Sequence[int] = (),
        max_new_tokens: Optional[int] = None,
    ) -> GenerateRequest:
        """The request to complete ``input_ids`` at these settings; ``max_new_tokens`` lowers
        the limit (an episode's turn: what is left of its budget)."""
        return GenerateRequest(
            input_ids=input_ids,
            max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=stop_token_ids,
            min_new_tokens=self.min_new_tokens,
            seed=seed,
            return_logprob=True,
            return_routed_experts=self.return_routes,
            return_routed_expert_weights=self.return_route_weights,
        )
