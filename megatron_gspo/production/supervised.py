"""Supervised samples: a prompt followed by its reference answer (the supervised warm-up)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_gspo.production.task import Task
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt


def reference_sample(prompt: Prompt, task: Task) -> TrainSample:
    """The prompt followed by its reference answer (and EOS), advantage 1: a supervised sample."""
    if prompt.answer is None:
        raise ValueError(
            f"sft_warmup_steps > 0 but the prompt at {prompt.source} has no answer to imitate; "
            "set sft_warmup_steps=0 or give the data an answer column"
        )
    answer_ids = task.tokenizer.encode(prompt.answer, add_special_tokens=False)
    eos = [task.eos_token_id] if task.eos_token_id is not None else []
    return TrainSample(
        tokens=torch.tensor(list(prompt.prompt_ids) + answer_ids + eos, dtype=torch.long),
        prompt_length=len(prompt.prompt_ids),
        group_id=prompt.group_id,
        advantages=torch.tensor(1.0),
    )
