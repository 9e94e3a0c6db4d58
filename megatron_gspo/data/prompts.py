"""Prompt files (JSONL, Parquet) -> validated rows -> token ids, with over-long prompts filtered.

A row holds a prompt under ``prompt_key`` (a string, or chat messages ``[{"role", "content"},
...]``), an optional answer under ``answer_key`` (string or number; null or absent means none) and
any other columns, which become the prompt's ``metadata`` (e.g. ``tests`` for the code reward).

Keys are dotted paths into nested objects (Parquet struct columns, JSON objects), so the layout of
the common RL math sets (verl's preprocessed GSM8K / MATH Parquet files: ``prompt`` a list of chat
messages, the answer at ``reward_model.ground_truth``) reads with ``answer_key:
reward_model.ground_truth``. A top-level column named by a key is not repeated in the metadata; a
column that only contains a key (``reward_model``) stays there whole.

Formatting: with ``apply_chat_template`` the tokenizer's chat template renders the messages (a
string prompt is one user message) with ``add_generation_prompt=True``, and the text is encoded
without adding special tokens (the template writes them); without it a string prompt is encoded
as is, with the tokenizer's own special tokens (e.g. BOS).

Prompts longer than ``max_prompt_length`` tokens are dropped, counted and logged; nothing is
truncated. A malformed row raises :class:`PromptFileError` naming the file, the line (JSONL) or row
(Parquet), and what is wrong.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]


class PromptFileError(ValueError):
    """A prompt file that cannot be read, or a malformed row in it."""


@dataclass(frozen=True)
class Prompt:
    """One prompt, ready for the rollout engine."""

    prompt_ids: list[int]
    """Token ids, at most ``algo.prompt_length`` of them."""
    prompt_text: str
    """The text the ids encode (after the chat template)."""
    answer: Optional[str]
    metadata: dict[str, Any]
    source: str
    """Where it came from: ``"train.jsonl:12"`` (line), ``"train.parquet:row 11"``, or
    ``"digit_reversal:train:37"`` (synthetic stream and index)."""
    group_id: int = -1
    """Id of the prompt's group, unique within a run: the prompt's position in the stream that
    served it (eval prompts: their index). -1 until a stream serves the prompt."""


@dataclass(frozen=True)
class PromptRow:
    """A validated row of a prompt file, before tokenization."""

    prompt: Union[str, Messages]
    answer: Optional[str]
    metadata: dict[str, Any]
    source: str


@dataclass
class PromptDataset:
    """The prompts of one file that fit ``max_prompt_length``, in file order."""

    path: str
    rows: list[PromptRow]
    texts: list[str]
    token_ids: list[np.ndarray]
    """int32 ids per kept prompt (numpy rather than lists: a tenth of the memory)."""
    num_rows: int
    """Rows in the file, kept or not."""
    num_filtered: int
    """Rows dropped for being longer than max_prompt_length."""
    filtered_sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def prompt(self, index: int, group_id: int = -1) -> Prompt:
        row = self.rows[index]
        return Prompt(
            prompt_ids=self.token_ids[index].tolist(),
            prompt_text=self.texts[index],
            answer=row.answer,
            metadata=dict(row.metadata),  # a copy: consumers may annotate it
            source=row.source,
            group_id=group_id,
        )


# --------------------------------------------------------------------------------------------
# Reading and validating rows
# --------------------------------------------------------------------------------------------


def read_prompt_rows(
    path: Union[str, Path], *, prompt_key: str = "prompt", answer_key: str = "answer"
) -> Iterator[PromptRow]:
    """Validated rows of a ``.jsonl`` / ``.json`` (one object per line) or ``.parquet`` file;
    the first malformed row raises :class:`PromptFileError`."""
    for row in _rows_or_problems(Path(path), prompt_key, answer_key):
        if isinstance(row, PromptFileError):
            raise row
        yield row


def check_prompt_file(
    path: Union[str, Path],
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    max_listed: int = 10,
) -> list[str]:
    """Every problem of a prompt file, without tokenizing it: an unreadable file, or each
    malformed row (file and line or row). At most ``max_listed`` rows are listed, then a count of
    the others. An empty list means every row is well formed."""
    problems: list[str] = []
    num_bad = num_rows = 0
    for row in _rows_or_problems(Path(path), prompt_key, answer_key):
        num_rows += 1
        if isinstance(row, PromptFileError):
            num_bad += 1
            if num_bad <= max_listed:
                problems.append(str(row))
    if num_bad > max_listed:
        problems.append(f"{path}: ... and {num_bad - max_listed} more malformed rows")
    if num_rows == 0 and not problems:
        problems.append(f"{path}: the file holds no rows")
    return problems


def _rows_or_problems(
    path: Path, prompt_key: str, answer_key: str
) -> Iterator[Union[PromptRow, PromptFileError]]:
    """Each row of the file, validated, or the :class:`PromptFileError` that describes it; a
    file that cannot be read at all yields one error and ends."""
    if not path.is_file():
        yield PromptFileError(
            f"{path}: no such file (set data.train_path / data.eval_path to a JSONL or Parquet file)"
        )
        return
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        yield from _read_jsonl(path, prompt_key, answer_key)
    elif suffix in (".parquet", ".pq"):
        yield from _read_parquet(path, prompt_key, answer_key)
    else:
        yield PromptFileError(
            f"{path}: unknown format {suffix!r} (prompt files are .jsonl or .parquet)"
        )


def _read_jsonl(
    path: Path, prompt_key: str, answer_key: str
) -> Iterator[Union[PromptRow, PromptFileError]]:
    # Binary lines, decoded one by one, so that a decoding error names its own line.
    with path.open("rb") as handle:
        for line_number, raw_line in enumerate(handle, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as error:
                yield PromptFileError(f"{where}: not UTF-8 text ({error})")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                yield PromptFileError(
                    f"{where}: invalid JSON ({error.msg} at column {error.colno}); each line must "
                    "be one JSON object"
                )
                continue
            yield _row_or_problem(record, where, prompt_key, answer_key)


def _read_parquet(
    path: Path, prompt_key: str, answer_key: str
) -> Iterator[Union[PromptRow, PromptFileError]]:
    import pyarrow.parquet as parquet

    try:
        parquet_file = parquet.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ... for unreadable files
        yield PromptFileError(f"{path}: not a readable Parquet file ({error})")
        return
    columns = parquet_file.schema_arrow.names
    if prompt_key not in columns and prompt_key.split(".")[0] not in columns:
        yield PromptFileError(
            f"{path}: every row lacks the prompt column {prompt_key.split('.')[0]!r} (columns: "
            f"{', '.join(columns)}); set data.prompt_key to the prompt column (a dotted path "
            "for a key inside a struct column)"
        )
        return
    row_number = 0
    for batch in parquet_file.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield _row_or_problem(record, f"{path}:row {row_number}", prompt_key, answer_key)
            row_number += 1


def _row_or_problem(
    record: Any, where: str, prompt_key: str, answer_key: str
) -> Union[PromptRow, PromptFileError]:
    try:
        return _validate_row(record, where, prompt_key, answer_key)
    except PromptFileError as error:
        return error


_MISSING = object()


def lookup_key_path(record: dict, key_path: str) -> tuple[Any, Optional[str]]:
    """The value at dotted ``key_path`` in nested dicts, and None; or (``_MISSING``, what is
    missing: the first absent key and the keys present beside it). An exact key that contains
    dots (``{"a.b": ...}``) wins over the path."""
    if key_path in record:
        return record[key_path], None
    value: Any = record
    walked: list[str] = []
    for part in key_path.split("."):
        if not isinstance(value, dict):
            where = ".".join(walked)
            return _MISSING, f"{where!r} is a {type(value).__name__}, not an object with {part!r}"
        if part not in value:
            present = ", ".join(repr(key) for key in value) or "none"
            if not walked:
                return _MISSING, f"keys present: {present}"
            return _MISSING, f"no key {part!r} in {'.'.join(walked)!r}, which has: {present}"
        value = value[part]
        walked.append(part)
    return value, None


def _validate_row(record: Any, where: str, prompt_key: str, answer_key: str) -> PromptRow:
    if not isinstance(record, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt, missing = lookup_key_path(record, prompt_key)
    if prompt is _MISSING or prompt is None:
        detail = missing or "it is null"
        raise PromptFileError(
            f"{where}: no prompt under {prompt_key!r} ({detail}); set data.prompt_key to the "
            "prompt's key (a dotted path for nested keys)"
        )
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptFileError(f"{where}: the prompt {prompt_key!r} is empty")
    elif isinstance(prompt, list):
        _check_messages(prompt, where, prompt_key)
    else:
        raise PromptFileError(
            f"{where}: the prompt {prompt_key!r} is a {type(prompt).__name__}; it must be a string "
            'or a list of chat messages [{"role": ..., "content": ...}]'
        )
    answer, _ = lookup_key_path(record, answer_key)
    if answer is _MISSING:
        answer = None  # answers are optional per row
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float, type(None))):
        raise PromptFileError(
            f"{where}: the answer {answer_key!r} is a {type(answer).__name__}; it must be a string, "
            "a number or null"
        )
    if isinstance(answer, float) and not math.isfinite(answer):
        raise PromptFileError(f"{where}: the answer {answer_key!r} is {answer}")
    metadata = {key: value for key, value in record.items() if key not in (prompt_key, answer_key)}
    return PromptRow(
        prompt=prompt,
        answer=None if answer is None else str(answer),
        metadata=metadata,
        source=where,
    )


def _check_messages(messages: list, where: str, prompt_key: str) -> None:
    if not messages:
        raise PromptFileError(f"{where}: the prompt {prompt_key!r} is an empty message list")
    for position, message in enumerate(messages):
        problem = None
        if not isinstance(message, dict):
            problem = f"is a {type(message).__name__}, not an object"
        elif not isinstance(message.get("role"), str):
            problem = "has no string 'role'"
        elif not isinstance(message.get("content"), str):
            problem = "has no string 'content'"
        if problem:
            raise PromptFileError(
                f"{where}: message {position} of the prompt {prompt_key!r} {problem}; messages "
                'look like {"role": "user", "content": "..."}'
            )


# --------------------------------------------------------------------------------------------
# Formatting, tokenizing and filtering
# --------------------------------------------------------------------------------------------


def format_prompts(
    prompts: Sequence[Union[str, Messages]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    apply_chat_template: bool,
    sources: Optional[Sequence[str]] = None,
) -> tuple[list[str], list[list[int]]]:
    """``(texts, token_ids)`` of prompts, formatted as the module docstring says."""
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise PromptFileError(
            f"the tokenizer ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '')!r}) "
            "has no chat template but data.apply_chat_template is true; set "
            "data.apply_chat_template=false to encode string prompts as they are, or use a "
            "tokenizer with a chat template"
        )
    texts = []
    for position, prompt in enumerate(prompts):
        if apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            texts.append(
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            )
        elif isinstance(prompt, str):
            texts.append(prompt)
        else:
            where = sources[position] if sources else f"prompt {position}"
            raise PromptFileError(
                f"{where}: the prompt is a list of chat messages but data.apply_chat_template is "
                "false; set data.apply_chat_template=true (messages need the chat template)"
            )
    if not texts:
        return [], []
    # The template writes its own special tokens (BOS included); adding them again would double.
    encoded = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"]
    return texts, [list(ids) for ids in encoded]


def load_prompt_dataset(
    path: Union[str, Path],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_length: int,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    apply_chat_template: bool = True,
    chunk_size: int = 1024,
) -> PromptDataset:
    """Read, validate, format and tokenize a prompt file; drop (and count) over-long prompts.

    Raises :class:`PromptFileError` for an unreadable file, a malformed row, or a file in which
    no prompt fits ``max_prompt_length``.
    """
    dataset = PromptDataset(
        path=str(path), rows=[], texts=[], token_ids=[], num_rows=0, num_filtered=0
    )
    longest_filtered = 0
    chunk: list[PromptRow] = []

    def flush() -> None:
        nonlocal longest_filtered
        texts, token_ids = format_prompts(
            [row.prompt for row in chunk],
            tokenizer,
            apply_chat_template=apply_chat_template,
            sources=[row.source for row in chunk],
        )
        for row, text, ids in zip(chunk, texts, token_ids):
            if len(ids) > max_prompt_length:
                dataset.num_filtered += 1
                longest_filtered = max(longest_filtered, len(ids))
                if len(dataset.filtered_sources) < 20:
                    dataset.filtered_sources.append(row.source)
                continue
            dataset.rows.append(row)
            dataset.texts.append(text)
            dataset.token_ids.append(np.asarray(ids, dtype=np.int32))
        chunk.clear()

    for row in read_prompt_rows(path, prompt_key=prompt_key, answer_key=answer_key):
        dataset.num_rows += 1
        chunk.append(row)
        if len(chunk) >= chunk_size:
            flush()
    if chunk:
        flush()

    if dataset.num_rows == 0:
        raise PromptFileError(f"{path}: the file holds no rows")
    if dataset.num_filtered:
        logger.warning(
            "%s: dropped %d of %d prompts longer than algo.prompt_length=%d tokens (longest %d; "
            "first ones: %s)",
            path,
            dataset.num_filtered,
            dataset.num_rows,
            max_prompt_length,
            longest_filtered,
            ", ".join(dataset.filtered_sources[:5]),
        )
    if not dataset.rows:
        raise PromptFileError(
            f"{path}: all {dataset.num_rows} prompts are longer than algo.prompt_length="
            f"{max_prompt_length} tokens (longest {longest_filtered}); raise algo.prompt_length"
        )
    without_answer = sum(row.answer is None for row in dataset.rows)
    logger.info(
        "%s: %d prompts (%d dropped as too long, %d without an answer)",
        path,
        len(dataset.rows),
        dataset.num_filtered,
        without_answer,
    )
    return dataset
