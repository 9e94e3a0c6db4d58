r"""``rollout.retokenize_responses``: the generated samples' responses decoded and encoded again,
as naive agent harnesses do, a mismatch-attribution knob (``tools/compare_attribution.py``,
source ``retokenize``).

:class:`Retokenizer` is applied by :class:`~megatron_gspo.production.single_turn.
SingleTurnProducer` between generation and scoring, so the rewards, the finishing rules and
the trainer see the re-encoded ids. Each sample's response ids become the re-encoded ones, its
behaviour log-probs (and weight versions) are carried to them by
:func:`megatron_gspo.data.retokenization.carry_log_probs`, and its routes are dropped (the
engine never routed the new tokens; R3 is refused with this knob). Aborted samples are left as
they are (never trained). A response whose text is empty (only ids past the tokenizer, which an
untrained model can sample) would have no tokens after re-encoding, which a trained sample
cannot be: it keeps its ids, out of the loss (nothing a harness could train on), and counts as
changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from megatron_gspo.data.retokenization import EmptyRetokenization, retokenize, token_byte_table
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Retokenizer:
    """Decode-then-encode of samples with one tokenizer (its byte table is built once)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.table = token_byte_table(tokenizer)

    def __call__(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """Retokenize ``samples`` in place; the metrics: ``retokenized_frac_seq`` (responses
        whose ids changed) and ``retokenized_frac_token`` (re-encoded tokens in changed
        segments, whose log-probs are spread totals), over the samples not aborted."""
        live = changed_samples = tokens = changed_tokens = 0
        for sample in samples:
            if sample.finish_reason == "abort":
                continue
            if sample.rollout_log_probs is None:
                raise ValueError(
                    "rollout.retokenize_responses carries the engine's log-probs to the new "
                    "tokens, and this sample has none"
                )
            prompt = sample.tokens[: sample.prompt_length]
            sample.rollout_routes = sample.rollout_route_weights = None
            live += 1
            try:
                result = retokenize(
                    sample.tokens[sample.prompt_length :].tolist(),
                    sample.rollout_log_probs.tolist(),
                    self.tokenizer,
                    self.table,
                    None
                    if sample.rollout_weight_versions is None
                    else sample.rollout_weight_versions.tolist(),
                )
            except EmptyRetokenization:
                sample.loss_mask = torch.zeros(sample.response_length, dtype=torch.bool)
                changed_samples += 1
                continue
            sample.tokens = torch.cat([prompt, torch.tensor(result.ids, dtype=torch.long)])
            sample.rollout_log_probs = torch.tensor(result.log_probs, dtype=torch.float32)
            if result.weight_versions is not None:
                sample.rollout_weight_versions = torch.tensor(
                    result.weight_versions, dtype=torch.int64
                )
            changed_samples += result.changed
            tokens += len(result.ids)
            changed_tokens += result.changed_tokens
        return {
            "retokenized_frac_seq": changed_samples / live if live else 0.0,
            "retokenized_frac_token": changed_tokens / tokens if tokens else 0.0,
        }
