"""Real dataset layouts: chat-message prompts and answers at nested keys (dotted key paths), in
Parquet files written here in the layout of verl's preprocessed math sets, and in JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_gspo.config import AlgoConfig, ConfigError, DataConfig
from megatron_gspo.data import (
    PromptFileError,
    build_byte_tokenizer,
    build_prompt_stream,
    load_prompt_dataset,
    read_prompt_rows,
)
from megatron_gspo.data.prompts import check_prompt_file


def math_row(index: int, question: str, answer, **changes) -> dict:
    """One row as verl's GSM8K preprocessing writes it."""
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Put the final answer after ####."},
            {"role": "user", "content": question},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index, "question": question},
    }
    row.update(changes)
    return row


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture
def math_parquet(tmp_path) -> Path:
    rows = [
        math_row(0, "What is 2 + 3?", "5"),
        math_row(1, "Half of 84?", "42"),
        math_row(2, "Seven squared?", "49"),
    ]
    return write_parquet(tmp_path / "train.parquet", rows)


def test_verl_math_layout_reads_chat_prompts_and_nested_answers(tokenizer, math_parquet):
    dataset = load_prompt_dataset(
        math_parquet, tokenizer, max_prompt_length=512, answer_key="reward_model.ground_truth"
    )
    assert len(dataset) == 3
    first = dataset.prompt(0)
    assert first.answer == "5"
    assert first.prompt_text == (
        "<|im_start|>system\nPut the final answer after ####.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert first.prompt_ids == tokenizer(first.prompt_text, add_special_tokens=False)["input_ids"]
    # The prompt's own column leaves the metadata; the struct holding the answer stays whole.
    assert first.metadata == {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"split": "train", "index": 0, "question": "What is 2 + 3?"},
    }
    assert first.source == f"{math_parquet}:row 0"
    assert [dataset.prompt(i).answer for i in range(3)] == ["5", "42", "49"]


def test_a_nested_string_prompt(tokenizer, math_parquet):
    rows = list(
        read_prompt_rows(
            math_parquet, prompt_key="extra_info.question", answer_key="reward_model.ground_truth"
        )
    )
    assert [row.prompt for row in rows] == ["What is 2 + 3?", "Half of 84?", "Seven squared?"]
    assert "prompt" in rows[0].metadata  # not the prompt column here: an ordinary column


def test_the_training_stream_takes_the_configured_paths(tokenizer, math_parquet):
    data = DataConfig(train_path=str(math_parquet), answer_key="reward_model.ground_truth")
    stream = build_prompt_stream(data, AlgoConfig(prompt_length=512), tokenizer, seed=0)
    answers = sorted(prompt.answer for prompt in stream.next_batch(3))
    assert answers == ["42", "49", "5"]


def test_nested_keys_in_jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(math_row(0, "What is 2 + 3?", 5)) + "\n")
    (row,) = read_prompt_rows(path, answer_key="reward_model.ground_truth")
    assert row.answer == "5"  # numbers become strings, also at a nested key
    # A key that itself contains dots is taken as it is.
    flat = tmp_path / "flat.jsonl"
    flat.write_text(json.dumps({"a.b": "a prompt"}) + "\n")
    (row,) = read_prompt_rows(flat, prompt_key="a.b")
    assert row.prompt == "a prompt" and row.metadata == {}


def test_malformed_rows_are_named_by_file_and_row(math_parquet, tmp_path):
    struct = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    schema = pa.schema(
        [
            ("prompt", messages),
            ("reward_model", struct),
            ("extra_info", pa.struct([("q", pa.string())])),
        ]
    )
    rows = [
        {
            "prompt": [{"role": "user", "content": "fine"}],
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"q": "x"},
        },
        {
            "prompt": [{"role": "user", "content": None}],
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"q": "x"},
        },
        {
            "prompt": [{"role": "user", "content": "no struct"}],
            "reward_model": None,
            "extra_info": None,
        },
        {
            "prompt": None,
            "reward_model": {"style": "rule", "ground_truth": "4"},
            "extra_info": None,
        },
    ]
    path = write_parquet(tmp_path / "bad.parquet", rows, schema)
    problems = check_prompt_file(path, answer_key="reward_model.ground_truth")
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"{path}:row 1: message 0 of the prompt 'prompt' has no string")
    assert problems[1].startswith(f"{path}:row 3: no prompt under 'prompt'")
    # An answer is optional: row 2 (no reward_model struct) has none, it is not malformed.
    nested = check_prompt_file(
        path, prompt_key="extra_info.q", answer_key="reward_model.ground_truth"
    )
    assert [p.split(": ", 1)[0] for p in nested] == [f"{path}:row 2", f"{path}:row 3"]
    assert "'extra_info' is a NoneType, not an object with 'q'" in nested[0]
    with pytest.raises(PromptFileError, match=r"bad.parquet:row 1: message 0"):
        list(read_prompt_rows(path))


def test_an_answer_struct_instead_of_its_leaf_is_named(math_parquet):
    with pytest.raises(
        PromptFileError, match=r"train.parquet:row 0: the answer 'reward_model' is a dict"
    ):
        list(read_prompt_rows(math_parquet, answer_key="reward_model"))


def test_a_missing_top_level_column_is_reported_once(math_parquet):
    (problem,) = check_prompt_file(math_parquet, prompt_key="question.text")
    assert "every row lacks the prompt column 'question'" in problem


@pytest.mark.parametrize("key", ["", "reward_model..ground_truth", ".x", "x."])
def test_bad_key_paths_are_config_errors(key):
    with pytest.raises(ConfigError, match="data.answer_key"):
        DataConfig(answer_key=key)
