"""The task of a run: its prompts, tokenizer and held-out prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron_gspo.config import ConfigError, TrainConfig
from megatron_gspo.data import build_eval_prompts, build_prompt_stream, build_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_gspo.data.prompts import Prompt
    from megatron_gspo.data.stream import PromptStream


@dataclass
class Task:
    """Prompts, tokenizer and held-out prompts of a run."""

    tokenizer: PreTrainedTokenizerBase
    stream: PromptStream
    eval_prompts: list[Prompt]
    eos_token_id: Optional[int]

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens that end a response: EOS, when the tokenizer has one."""
        return [self.eos_token_id] if self.eos_token_id is not None else []


def build_task(cfg: TrainConfig) -> Task:
    tokenizer = build_tokenizer(cfg.data, cfg.model)
    vocab = len(tokenizer)
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"the tokenizer has {vocab} tokens but model.vocab_size={cfg.model.vocab_size}",
            "every token id must have an embedding row",
            f"set model.vocab_size >= {vocab}",
        )
    stream = build_prompt_stream(cfg.data, cfg.algo, tokenizer, seed=cfg.seed)
    eval_prompts = build_eval_prompts(cfg.data, cfg.algo, tokenizer, seed=cfg.seed)
    return Task(tokenizer, stream, eval_prompts, getattr(tokenizer, "eos_token_id", None))
