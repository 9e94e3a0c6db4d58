"""The prompt ledger: served, pending and trained prompts; the exactly-once record."""

from __future__ import annotations

import json

import pytest

from megatron_gspo.data import SyntheticPromptStream
from megatron_gspo.driver.ledger import TRAINED_PROMPTS_FILE, PromptLedger, read_trained_prompts


def make_ledger(output_dir) -> PromptLedger:
    return PromptLedger(SyntheticPromptStream("digit_copy", seed=3, num_eval_prompts=4), output_dir)


def ids(prompts) -> list[int]:
    return [prompt.group_id for prompt in prompts]


def test_requeued_prompts_come_first_and_leave_pending_once_trained(tmp_path):
    ledger = make_ledger(tmp_path)
    ledger.start(0)
    first, second = ledger.take(3), ledger.take(3)
    assert ids(first) == [0, 1, 2] and ids(second) == [3, 4, 5] and ledger.num_pending == 6
    ledger.requeue([second[2], first[1]])
    assert ids(ledger.take(4)) == [1, 5, 6, 7] and ledger.num_requeued == 2
    ledger.mark_trained(0, [0, 2])
    ledger.mark_trained(1, [3, 4, 1, 5])
    assert ledger.num_pending == 2  # 6 and 7
    with pytest.raises(ValueError, match="not pending"):
        ledger.mark_trained(2, [4])
    with pytest.raises(ValueError, match="not pending"):
        ledger.requeue(first[:1])
    assert read_trained_prompts(tmp_path) == [
        {"step": 0, "prompt_ids": [0, 2]},
        {"step": 1, "prompt_ids": [3, 4, 1, 5]},
    ]


def test_resume_requeues_the_pending_prompts_and_drops_later_lines(tmp_path):
    ledger = make_ledger(tmp_path)
    ledger.start(0)
    served = ledger.take(4)
    ledger.mark_trained(0, [0, 1])
    state = json.loads(json.dumps(ledger.state_dict()))  # it travels in checkpoint.json
    assert state["pending_prompt_ids"] == [2, 3]
    ledger.take(2)  # served after the checkpoint: the stream serves them again after a resume
    ledger.mark_trained(1, [2, 3])
    with (tmp_path / TRAINED_PROMPTS_FILE).open("a") as handle:
        handle.write('{"step": 2, "prompt_')  # a line cut short by a kill

    resumed = make_ledger(tmp_path)
    resumed.load_state_dict(state)
    resumed.start(1)
    assert read_trained_prompts(tmp_path) == [{"step": 0, "prompt_ids": [0, 1]}]
    again = resumed.take(4)
    assert again[:2] == served[2:] and ids(again) == [2, 3, 4, 5]
    resumed.mark_trained(1, [2, 3, 4, 5])
    trained = [i for line in read_trained_prompts(tmp_path) for i in line["prompt_ids"]]
    assert trained == list(range(6))

    fresh = make_ledger(tmp_path)
    fresh.start(0)
    assert read_trained_prompts(tmp_path) == []
