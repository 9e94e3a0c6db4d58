"""Prompt data: files (JSONL, Parquet), the built-in synthetic tasks, tokenizers, and resumable
prompt streams. No Megatron import.

The trainer's calls::

    tokenizer = build_tokenizer(config.data, config.model)
    stream = build_prompt_stream(config.data, config.algo, tokenizer, seed=config.seed)
    prompts = stream.next_batch(config.algo.rollout_batch_size)  # list[Prompt]
    eval_prompts = build_eval_prompts(config.data, config.algo, tokenizer, seed=config.seed)
    checkpoint["data"] = stream.state_dict();  stream.load_state_dict(checkpoint["data"])
"""

from megatron_gspo.data.prompts import (
    Prompt,
    PromptDataset,
    PromptFileError,
    PromptRow,
    format_prompts,
    load_prompt_dataset,
    read_prompt_rows,
)
from megatron_gspo.data.stream import (
    FilePromptStream,
    PromptStream,
    SyntheticPromptStream,
    build_eval_prompts,
    build_prompt_stream,
)
from megatron_gspo.data.synthetic import (
    NUM_DIGITS,
    SYNTHETIC_TASKS,
    correct_response_ids,
    score_digit_response,
)
from megatron_gspo.data.tokenizer import (
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    SEP_TOKEN_ID,
    build_byte_tokenizer,
    build_synthetic_tokenizer,
    build_tokenizer,
)

__all__ = [
    "EOS_TOKEN_ID",
    "NUM_DIGITS",
    "PAD_TOKEN_ID",
    "SEP_TOKEN_ID",
    "SYNTHETIC_TASKS",
    "FilePromptStream",
    "Prompt",
    "PromptDataset",
    "PromptFileError",
    "PromptRow",
    "PromptStream",
    "SyntheticPromptStream",
    "build_byte_tokenizer",
    "build_eval_prompts",
    "build_prompt_stream",
    "build_synthetic_tokenizer",
    "build_tokenizer",
    "correct_response_ids",
    "format_prompts",
    "load_prompt_dataset",
    "read_prompt_rows",
    "score_digit_response",
]
