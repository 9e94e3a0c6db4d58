"""Endless, deterministic, resumable streams of prompts, and the builders the trainer calls.

A stream serves prompts one after another; ``next_batch(n)`` takes the next ``n`` (a batch may
span two epochs). Every served prompt gets ``group_id`` = its position in the stream (0, 1, 2, ...),
so group ids are unique within a run, also across a resume.

- :class:`FilePromptStream`: epoch ``e`` visits the dataset in the order
  ``numpy.random.default_rng([seed, e]).permutation(len(dataset))`` (file order without shuffle).
- :class:`SyntheticPromptStream`: prompt ``k`` is drawn from ``default_rng([seed, 0, k])``
  (:mod:`megatron_gspo.data.synthetic`), skipping prompts of the held-out eval set.

``state_dict()`` is the position (plus a fingerprint of the data); after ``load_state_dict`` a
stream built with the same config and seed serves the same prompts in the same order as the
stream that was saved.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any, Optional, Protocol

import numpy as np

from megatron_gspo.config import AlgoConfig, ConfigError, DataConfig
from megatron_gspo.data.prompts import Prompt, PromptDataset, load_prompt_dataset
from megatron_gspo.data.synthetic import (
    EVAL_STREAM,
    NUM_DIGITS,
    TRAIN_STREAM,
    check_task,
    draw_digits,
    task_example,
)
from megatron_gspo.data.tokenizer import TOOL_TASKS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class PromptStream(Protocol):
    """What the RL loop needs from a prompt source."""

    def next_batch(self, batch_size: int) -> list[Prompt]: ...

    def prompts_by_id(self, stream_ids: list[int]) -> list[Prompt]:
        """The prompts this stream served as ``stream_ids`` (their group ids), again: exactly-once
        resumes re-queue the prompts a checkpoint lists as served but not yet trained."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def stats(self) -> dict[str, float]: ...


class FilePromptStream:
    """Shuffled epochs over a :class:`PromptDataset`."""

    def __init__(self, dataset: PromptDataset, *, seed: int, shuffle: bool = True):
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        """Index into the current epoch's order of the next prompt."""
        self.consumed = 0
        """Prompts served so far, over all epochs (the next prompt's group id)."""
        self._order = self._epoch_order(0)
        self._content_hash: Optional[str] = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def next_batch(self, batch_size: int) -> list[Prompt]:
        batch = []
        for _ in range(batch_size):
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
                logger.info("%s: starting epoch %d", self.dataset.path, self.epoch)
            batch.append(self.dataset.prompt(int(self._order[self.position]), self.consumed))
            self.position += 1
            self.consumed += 1
        return batch

    def prompts_by_id(self, stream_ids: list[int]) -> list[Prompt]:
        # Prompt k of the stream is position k % n of epoch k // n (every epoch serves n).
        prompts = []
        for stream_id in stream_ids:
            _check_served(stream_id, self.consumed)
            epoch, position = divmod(int(stream_id), len(self.dataset))
            order = self._order if epoch == self.epoch else self._epoch_order(epoch)
            prompts.append(self.dataset.prompt(int(order[position]), int(stream_id)))
        return prompts

    def _fingerprint(self) -> dict[str, Any]:
        if self._content_hash is None:
            # Of the token ids, not the path: a moved file resumes, an edited one is refused.
            digest = hashlib.sha256()
            for ids in self.dataset.token_ids:
                digest.update(len(ids).to_bytes(4, "little"))
                digest.update(ids.astype("<i4").tobytes())
            self._content_hash = digest.hexdigest()[:16]
        return {
            "num_prompts": len(self.dataset),
            "prompts_sha256": self._content_hash,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "consumed": self.consumed,
            **self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_fingerprint(self._fingerprint(), state)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.consumed = int(state["consumed"])
        self._order = self._epoch_order(self.epoch)

    def stats(self) -> dict[str, float]:
        return {
            "data_epoch": float(self.epoch),
            "data_prompts": float(len(self.dataset)),
            "data_filtered_too_long": float(self.dataset.num_filtered),
        }


class SyntheticPromptStream:
    """Endless prompts of a synthetic task (:mod:`megatron_gspo.data.synthetic`)."""

    def __init__(self, task: str, *, seed: int, num_eval_prompts: int):
        check_task(task)
        self.task = task
        self.seed = seed
        self.consumed = 0
        """Prompts served so far (the next prompt's group id)."""
        self.index = 0
        """Next generator index to draw (ahead of consumed by the skipped eval prompts)."""
        self.num_skipped = 0
        self.num_eval_prompts = num_eval_prompts
        self._eval_digits = {
            tuple(draw_digits(seed, EVAL_STREAM, index)) for index in range(num_eval_prompts)
        }

    def next_batch(self, batch_size: int) -> list[Prompt]:
        batch = []
        while len(batch) < batch_size:
            digits = draw_digits(self.seed, TRAIN_STREAM, self.index)
            source = f"{self.task}:train:{self.index}"
            self.index += 1
            if tuple(digits) in self._eval_digits:
                self.num_skipped += 1
                continue
            batch.append(synthetic_prompt(self.task, digits, source, self.consumed))
            self.consumed += 1
        return batch

    def prompts_by_id(self, stream_ids: list[int]) -> list[Prompt]:
        wanted = {int(stream_id) for stream_id in stream_ids}
        for stream_id in wanted:
            _check_served(stream_id, self.consumed)
        # Walk the generator back from the cursor (skipped eval-overlap draws have no id): the
        # prompts a resume re-queues are the last few batches served.
        found: dict[int, Prompt] = {}
        index, stream_id = self.index - 1, self.consumed - 1
        while len(found) < len(wanted):
            digits = draw_digits(self.seed, TRAIN_STREAM, index)
            if tuple(digits) not in self._eval_digits:
                if stream_id in wanted:
                    source = f"{self.task}:train:{index}"
                    found[stream_id] = synthetic_prompt(self.task, digits, source, stream_id)
                stream_id -= 1
            index -= 1
        return [found[int(stream_id)] for stream_id in stream_ids]

    def _fingerprint(self) -> dict[str, Any]:
        return {"task": self.task, "seed": self.seed, "num_eval_prompts": self.num_eval_prompts}

    def state_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "consumed": self.consumed,
            "num_skipped": self.num_skipped,
            **self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_fingerprint(self._fingerprint(), state)
        self.index = int(state["index"])
        self.consumed = int(state["consumed"])
        self.num_skipped = int(state["num_skipped"])

    def stats(self) -> dict[str, float]:
        return {"data_skipped_eval_overlap": float(self.num_skipped)}


def synthetic_prompt(task: str, digits: list[int], source: str, group_id: int) -> Prompt:
    prompt_ids, prompt_text, answer = task_example(task, digits)
    return Prompt(
        prompt_ids=prompt_ids,
        prompt_text=prompt_text,
        answer=answer,
        metadata={"task": task},
        source=source,
        group_id=group_id,
    )


def _check_served(stream_id: int, consumed: int) -> None:
    if not 0 <= stream_id < consumed:
        raise ValueError(
            f"prompt {stream_id} of the stream was never served (the stream has served "
            f"{consumed}): a checkpoint's pending prompt ids must come from its own stream"
        )


def _check_fingerprint(expected: dict[str, Any], state: dict[str, Any]) -> None:
    for key, value in expected.items():
        if state.get(key) != value:
            raise ValueError(
                f"cannot resume the prompt stream: its state was saved with {key}="
                f"{state.get(key)!r}, this run has {key}={value!r}; the same prompts in the same "
                "order need the same data, seed and shuffle settings (restore them, or start "
                "without resume)"
            )


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------


def _check_synthetic_lengths(algo: AlgoConfig, task: str) -> None:
    # The digits and <sep>, and the '*' between the operands of the tool task.
    prompt_tokens = NUM_DIGITS + 1 + (task in TOOL_TASKS)
    if algo.prompt_length < prompt_tokens:
        raise ConfigError(
            "algo.prompt_length",
            f"{algo.prompt_length} is shorter than the synthetic prompts ({prompt_tokens} tokens)",
            "over-long prompts are dropped, so no prompt would remain",
            f"set algo.prompt_length >= {prompt_tokens}",
        )
    if algo.response_length < NUM_DIGITS:
        raise ConfigError(
            "algo.response_length",
            f"{algo.response_length} is shorter than the synthetic answers ({NUM_DIGITS} digits)",
            "the reward counts 8 digits, so no response could score 1",
            f"set algo.response_length >= {NUM_DIGITS + 1} (8 digits and <eos>)",
        )


def build_prompt_stream(
    data: DataConfig, algo: AlgoConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> PromptStream:
    """The training prompts: ``data.train_path`` if set, else the synthetic ``data.task``."""
    if data.train_path is None:
        _check_synthetic_lengths(algo, data.task)
        return SyntheticPromptStream(data.task, seed=seed, num_eval_prompts=data.num_eval_prompts)
    dataset = load_prompt_dataset(
        data.train_path,
        tokenizer,
        max_prompt_length=algo.prompt_length,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        apply_chat_template=data.apply_chat_template,
    )
    return FilePromptStream(dataset, seed=seed, shuffle=data.shuffle)


def build_eval_prompts(
    data: DataConfig, algo: AlgoConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> list[Prompt]:
    """Held-out prompts, in a fixed order with group ids 0, 1, ...: all of ``data.eval_path`` (over-
    long ones dropped), or ``data.num_eval_prompts`` synthetic prompts from the eval generator
    (disjoint from training). Empty when a file dataset has no ``eval_path``."""
    if data.train_path is None and data.eval_path is None:
        _check_synthetic_lengths(algo, data.task)
        return [
            synthetic_prompt(
                data.task,
                draw_digits(seed, EVAL_STREAM, index),
                f"{data.task}:eval:{index}",
                index,
            )
            for index in range(data.num_eval_prompts)
        ]
    if data.eval_path is None:
        return []
    dataset = load_prompt_dataset(
        data.eval_path,
        tokenizer,
        max_prompt_length=algo.prompt_length,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        apply_chat_template=data.apply_chat_template,
    )
    return [dataset.prompt(index, group_id=index) for index in range(len(dataset))]
