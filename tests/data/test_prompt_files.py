"""Prompt files: JSONL and Parquet loading, chat template, over-long filtering, malformed rows."""

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_gspo.data import (
    PromptFileError,
    build_byte_tokenizer,
    load_prompt_dataset,
    read_prompt_rows,
)

FIXTURE = Path(__file__).parent / "fixtures" / "prompts.jsonl"
IM_START, IM_END = 257, 258


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def fixture_rows() -> list[dict]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    # from_pylist takes its columns from the first row: give every row every key.
    keys = list(dict.fromkeys(key for row in rows for key in row))
    pq.write_table(
        pa.Table.from_pylist([{key: row.get(key) for key in keys} for row in rows]), path
    )
    return path


def test_jsonl_rows_prompt_answer_and_metadata():
    rows = list(read_prompt_rows(FIXTURE))
    assert [row.source for row in rows] == [f"{FIXTURE}:{line}" for line in (1, 2, 4, 5, 6)]
    assert rows[0].prompt == "What is 2 + 3?" and rows[0].answer == "5"
    assert rows[1].answer == "42"  # numbers become strings
    assert rows[0].metadata == {"level": 1}
    assert rows[2].prompt[1] == {"role": "user", "content": "How many legs has a spider?"}
    assert rows[3].answer is None and rows[3].metadata == {"tests": ["assert add(1, 2) == 3"]}
    assert rows[4].metadata == {}


def test_chat_template_applied(tokenizer):
    dataset = load_prompt_dataset(FIXTURE, tokenizer, max_prompt_length=512)
    first = dataset.prompt(0)
    expected_text = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert first.prompt_text == expected_text
    expected_ids = [IM_START, *b"user\nWhat is 2 + 3?", IM_END, *b"\n", IM_START, *b"assistant\n"]
    assert first.prompt_ids == expected_ids
    # A message list keeps its roles, system turn included.
    spider = dataset.prompt(2)
    assert spider.prompt_text.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n")
    assert spider.prompt_text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(spider.prompt_ids) == spider.prompt_text
    assert dataset.num_rows == 5 and dataset.num_filtered == 0


def test_without_chat_template_the_string_is_encoded_as_is(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "plain.jsonl", [json.dumps({"prompt": "abc", "answer": "x"})])
    dataset = load_prompt_dataset(path, tokenizer, max_prompt_length=8, apply_chat_template=False)
    assert dataset.prompt(0).prompt_ids == list(b"abc")
    with pytest.raises(PromptFileError, match=r"fixtures/prompts.jsonl:4: .*chat messages"):
        load_prompt_dataset(FIXTURE, tokenizer, max_prompt_length=512, apply_chat_template=False)


def test_missing_chat_template_is_an_error(tmp_path):
    no_template = build_byte_tokenizer(chat_template=None)
    with pytest.raises(PromptFileError, match="no chat template.*apply_chat_template=false"):
        load_prompt_dataset(FIXTURE, no_template, max_prompt_length=512)


def test_parquet_matches_jsonl(tokenizer, tmp_path):
    # A Parquet column has one type: string prompts here, message lists in the next test.
    rows = [row for row in fixture_rows() if isinstance(row["prompt"], str)]
    rows[1]["answer"] = "42"
    parquet_path = write_parquet(tmp_path / "prompts.parquet", rows)
    jsonl_path = write_jsonl(tmp_path / "prompts.jsonl", [json.dumps(row) for row in rows])
    from_parquet = load_prompt_dataset(parquet_path, tokenizer, max_prompt_length=512)
    from_jsonl = load_prompt_dataset(jsonl_path, tokenizer, max_prompt_length=512)
    assert len(from_parquet) == len(from_jsonl) == 4
    for index in range(4):
        a, b = from_parquet.prompt(index), from_jsonl.prompt(index)
        assert a.prompt_ids == b.prompt_ids and a.answer == b.answer
    assert from_parquet.prompt(0).source == f"{parquet_path}:row 0"
    # Parquet fills absent columns with null.
    assert from_parquet.prompt(2).metadata["tests"] == ["assert add(1, 2) == 3"]
    assert from_parquet.prompt(0).metadata == {"level": 1, "tests": None}


def test_parquet_chat_messages(tokenizer, tmp_path):
    rows = [row for row in fixture_rows() if isinstance(row["prompt"], list)]
    path = write_parquet(tmp_path / "messages.parquet", rows)
    prompt = load_prompt_dataset(path, tokenizer, max_prompt_length=512).prompt(0)
    expected = load_prompt_dataset(FIXTURE, tokenizer, max_prompt_length=512).prompt(2)
    assert prompt.prompt_ids == expected.prompt_ids and prompt.answer == "8"


def test_custom_keys(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [json.dumps({"question": "2+2?", "solution": "4"})])
    dataset = load_prompt_dataset(
        path, tokenizer, max_prompt_length=64, prompt_key="question", answer_key="solution"
    )
    assert dataset.prompt(0).answer == "4" and dataset.prompt(0).metadata == {}
    assert "2+2?" in dataset.prompt(0).prompt_text


def test_over_long_prompts_are_filtered_counted_and_logged(tokenizer, tmp_path, caplog):
    lengths = [5, 30, 10, 31, 29]
    lines = [json.dumps({"prompt": "x" * n, "answer": str(n)}) for n in lengths]
    path = write_jsonl(tmp_path / "lengths.jsonl", lines)
    with caplog.at_level(logging.WARNING):
        dataset = load_prompt_dataset(
            path, tokenizer, max_prompt_length=30, apply_chat_template=False, chunk_size=2
        )
    assert [prompt.answer for prompt in map(dataset.prompt, range(len(dataset)))] == [
        "5",
        "30",
        "10",
        "29",
    ]
    assert all(len(ids) <= 30 for ids in dataset.token_ids)
    assert dataset.num_rows == 5 and dataset.num_filtered == 1
    assert dataset.filtered_sources == [f"{path}:4"]
    assert any("dropped 1 of 5 prompts" in record.getMessage() for record in caplog.records)
    with pytest.raises(PromptFileError, match="all 5 prompts are longer than.*prompt_length=4"):
        load_prompt_dataset(path, tokenizer, max_prompt_length=4, apply_chat_template=False)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "ok", "answer": "1"', r"line_test.jsonl:3: invalid JSON"),
        (
            '{"question": "no prompt key"}',
            r"line_test.jsonl:3: no prompt under 'prompt' .*'question'",
        ),
        ('{"prompt": 17}', r"line_test.jsonl:3: the prompt 'prompt' is a int"),
        ('{"prompt": ""}', r"line_test.jsonl:3: the prompt 'prompt' is empty"),
        ('{"prompt": [{"role": "user"}]}', r"line_test.jsonl:3: message 0 .* no string 'content'"),
        ('{"prompt": ["hi"]}', r"line_test.jsonl:3: message 0 .* is a str"),
        ('{"prompt": "ok", "answer": ["a"]}', r"line_test.jsonl:3: the answer 'answer' is a list"),
        ('["prompt", "answer"]', r"line_test.jsonl:3: expected a JSON object, got list"),
    ],
)
def test_malformed_jsonl_row_names_file_and_line(tokenizer, tmp_path, bad_line, message):
    good = json.dumps({"prompt": "fine", "answer": "1"})
    path = write_jsonl(tmp_path / "line_test.jsonl", [good, good, bad_line, good])
    with pytest.raises(PromptFileError, match=message):
        load_prompt_dataset(path, tokenizer, max_prompt_length=64)


def test_invalid_utf8_names_the_line(tokenizer, tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(PromptFileError, match=r"bytes.jsonl:2: not UTF-8"):
        load_prompt_dataset(path, tokenizer, max_prompt_length=64)


def test_malformed_parquet_row_names_file_and_row(tokenizer, tmp_path):
    rows = [{"prompt": "fine", "answer": "1"}] * 3 + [{"prompt": None, "answer": "2"}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(PromptFileError, match=r"bad.parquet:row 3: no prompt under 'prompt'"):
        load_prompt_dataset(path, tokenizer, max_prompt_length=64)
    typed = write_parquet(tmp_path / "typed.parquet", [{"prompt": 5}, {"prompt": 6}])
    with pytest.raises(PromptFileError, match=r"typed.parquet:row 0: the prompt 'prompt' is a int"):
        load_prompt_dataset(typed, tokenizer, max_prompt_length=64)
    other = write_parquet(tmp_path / "other.parquet", [{"question": "q"}])
    with pytest.raises(
        PromptFileError, match=r"other.parquet: every row lacks .*columns: question"
    ):
        load_prompt_dataset(other, tokenizer, max_prompt_length=64)


def test_unreadable_files(tokenizer, tmp_path):
    with pytest.raises(PromptFileError, match="no such file"):
        load_prompt_dataset(tmp_path / "missing.jsonl", tokenizer, max_prompt_length=64)
    with pytest.raises(PromptFileError, match="unknown format '.csv'"):
        (tmp_path / "data.csv").write_text("prompt\nhi\n")
        load_prompt_dataset(tmp_path / "data.csv", tokenizer, max_prompt_length=64)
    with pytest.raises(PromptFileError, match="not a readable Parquet file"):
        (tmp_path / "broken.parquet").write_bytes(b"not parquet")
        load_prompt_dataset(tmp_path / "broken.parquet", tokenizer, max_prompt_length=64)
    with pytest.raises(PromptFileError, match="holds no rows"):
        write_jsonl(tmp_path / "empty.jsonl", [""])
        load_prompt_dataset(tmp_path / "empty.jsonl", tokenizer, max_prompt_length=64)


def test_check_lists_every_malformed_row(tmp_path):
    from megatron_gspo.data.prompts import check_prompt_file

    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            '{"prompt": "fine", "answer": "1"}',
            '{"prompt": "no closing brace"',
            '{"question": "wrong key"}',
            '{"prompt": "fine again"}',
            '{"prompt": 7}',
        ],
    )
    problems = check_prompt_file(path)
    assert [problem.split(": ")[0] for problem in problems] == [
        f"{path}:2",
        f"{path}:3",
        f"{path}:5",
    ]
    assert "invalid JSON" in problems[0] and "'question'" in problems[1] and "int" in problems[2]
    assert check_prompt_file(FIXTURE) == []


def test_check_caps_the_listed_rows_and_reports_unreadable_files(tmp_path):
    from megatron_gspo.data.prompts import check_prompt_file

    path = write_jsonl(tmp_path / "bad.jsonl", ['{"x": 1}'] * 15)
    problems = check_prompt_file(path, max_listed=10)
    assert len(problems) == 11 and problems[-1].endswith("and 5 more malformed rows")
    (missing,) = check_prompt_file(tmp_path / "missing.jsonl")
    assert "no such file" in missing
    (empty,) = check_prompt_file(write_jsonl(tmp_path / "empty.jsonl", [""]))
    assert "holds no rows" in empty
    parquet = write_parquet(tmp_path / "bad.parquet", [{"prompt": "a"}, {"prompt": ""}])
    (row,) = check_prompt_file(parquet)
    assert row.startswith(f"{parquet}:row 1: ")
