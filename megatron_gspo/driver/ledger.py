"""Exactly once: which prompts of the stream were served, which wait to be trained, and the record
of what every step trained.

A prompt is *served* when the driver takes it from the stream, *pending* until a step trains its
samples, and *trained* once. The checkpoint holds the stream's position and the pending prompt
ids (:meth:`PromptLedger.state_dict`); a resumed run re-queues the pending prompts first
(:meth:`load_state_dict`), so that across kills and resumes every prompt the stream served is
trained exactly once, also when an asynchronous producer had generated (or was generating)
samples of it that were never trained: their samples are generated again.

``output_dir/trained_prompts.jsonl`` is the record checked from outside: one line per RL step,
``{"step": s, "prompt_ids": [...]}``, the stream ids (``Prompt.group_id``) of the prompts whose
samples step ``s`` trained (and ``dropped_prompt_ids``: prompts the step consumed without training
them, the uninformative groups of DAPO's dynamic sampling). The loop writes it before the checkpoint of the step (a kill between
the two resumes from the checkpoint before, and the resumed run drops the lines of the steps it
runs again), so the lines of the final file are the steps that count, each once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt
    from megatron_gspo.data.stream import PromptStream

logger = logging.getLogger(__name__)

TRAINED_PROMPTS_FILE = "trained_prompts.jsonl"
PENDING_KEY = "pending_prompt_ids"
"""Key of the pending prompt ids in the data state (beside the stream's own keys, which the
stream reads and ignores this one)."""


class PromptLedger:
    """Served, pending and trained prompts of a run (the driver's, on global rank 0).

    Thread-safe: an asynchronous producer takes and re-queues prompts while the loop marks steps
    trained and saves the state.
    """

    def __init__(self, stream: PromptStream, output_dir: str):
        self.stream = stream
        self.path = Path(output_dir) / TRAINED_PROMPTS_FILE
        self._pending: dict[int, Optional[Prompt]] = {}
        """Served and not yet trained, by stream id (None: a replayed prompt, not served here)."""
        self._requeued: list[Prompt] = []
        self._lock = threading.Lock()
        self.num_requeued = 0
        """Prompts re-queued so far (stale samples, lost requests, resumes)."""

    # ------------------------------------------------------------------ serving

    def take(self, count: int) -> list[Prompt]:
        """The next ``count`` prompts: re-queued ones first (oldest first), then the stream's."""
        with self._lock:
            taken, self._requeued = self._requeued[:count], self._requeued[count:]
            if len(taken) < count:
                fresh = self.stream.next_batch(count - len(taken))
                self._pending.update((prompt.group_id, prompt) for prompt in fresh)
                taken += fresh
            return taken

    def take_recorded(self, prompt_ids: Sequence[int]) -> None:
        """A replayed step's prompts (``rollout.replay_dir``) become pending without this run's
        stream serving them: their samples come from the recording, and marking them trained
        writes the recording's lines of ``trained_prompts.jsonl`` again."""
        with self._lock:
            already = [int(i) for i in prompt_ids if int(i) in self._pending]
            if already:
                raise ValueError(f"replayed prompts {already} are pending already")
            self._pending.update((int(prompt_id), None) for prompt_id in prompt_ids)

    def requeue(self, prompts: Sequence[Prompt]) -> None:
        """Serve ``prompts`` again before new ones (their samples are not going to be trained)."""
        with self._lock:
            unknown = [p.group_id for p in prompts if p.group_id not in self._pending]
            if unknown:
                raise ValueError(f"re-queued prompts {unknown} are not pending")
            self._requeued = sorted([*self._requeued, *prompts], key=lambda p: p.group_id)
            self.num_requeued += len(prompts)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    # ------------------------------------------------------------------ the record

    def start(self, step: int) -> None:
        """Open the record at RL step ``step``: a fresh run (0) starts an empty one, a resumed
        run drops the lines of steps ``>= step`` (the interrupted run's, trained again now) and
        a line cut short by a kill."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if step > 0 and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record["step"] < step:
                    kept.append(line)
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        os.replace(temporary, self.path)

    def mark_trained(
        self, step: int, prompt_ids: Sequence[int], *, dropped: Sequence[int] = ()
    ) -> None:
        """Step ``step`` trained the samples of ``prompt_ids`` (and consumed ``dropped`` without
        training them: DAPO's uninformative groups): they leave the pending set and the step's
        line is appended to ``trained_prompts.jsonl`` (``dropped_prompt_ids`` when some were)."""
        with self._lock:
            missing = [i for i in [*prompt_ids, *dropped] if i not in self._pending]
            if missing:
                raise ValueError(
                    f"step {step} trained prompts {missing} that are not pending (trained twice, "
                    "or never served)"
                )
            for prompt_id in [*prompt_ids, *dropped]:
                del self._pending[prompt_id]
        record: dict[str, Any] = {"step": step, "prompt_ids": [int(i) for i in prompt_ids]}
        if dropped:
            record["dropped_prompt_ids"] = [int(i) for i in dropped]
        line = json.dumps(record)
        with self.path.open("a") as handle:
            handle.write(line + "\n")

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The stream's position and the pending prompt ids, taken together (consistent while a
        producer takes prompts)."""
        with self._lock:
            return {**self.stream.state_dict(), PENDING_KEY: sorted(self._pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the stream's position and re-queue the pending prompts."""
        with self._lock:
            self.stream.load_state_dict(state)
            pending = [int(i) for i in state.get(PENDING_KEY, [])]
            prompts = self.stream.prompts_by_id(pending)
            self._pending = {prompt.group_id: prompt for prompt in prompts}
            self._requeued = list(prompts)
        if pending:
            logger.info(
                "resume: %d prompts were served but not trained before the checkpoint; they are "
                "generated again first",
                len(pending),
            )


def read_trained_prompts(output_dir: str) -> list[dict[str, Any]]:
    """The complete lines of ``output_dir/trained_prompts.jsonl`` (for tools and tests)."""
    records = []
    for line in (Path(output_dir) / TRAINED_PROMPTS_FILE).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
