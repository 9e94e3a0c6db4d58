"""The synthetic digit tasks: reward values on hand-made responses, and the tokenizers."""

import pytest
from transformers import AutoTokenizer

from megatron_gspo.data import (
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    SEP_TOKEN_ID,
    build_byte_tokenizer,
    build_synthetic_tokenizer,
    correct_response_ids,
    score_digit_response,
)
from megatron_gspo.data.synthetic import response_ids_from_text, task_example

BOS_ID = 11


def ids(text: str) -> list[int]:
    """Hand-written responses: digits, 'E' for <eos>, 'S' for <sep>, 'P' for <pad>, 'B' for <bos>."""
    special = {"E": EOS_TOKEN_ID, "S": SEP_TOKEN_ID, "P": PAD_TOKEN_ID, "B": BOS_ID}
    return [special[c] if c in special else int(c) for c in text]


@pytest.mark.parametrize(
    "response, expected",
    [
        ("87654321E", 1.0),  # the correct response
        ("87654321", 1.0),  # <eos> does not change the reward
        ("87654321999E", 1.0),  # nor do tokens after the 8 positions
        ("12345678E", 8 * 0.1 / 8),  # every digit wrong
        ("87654000E", (5 + 3 * 0.1) / 8),
        ("8765E", 4 / 8),  # missing positions score 0
        ("E87654321", 0.0),  # everything after the first <eos> is gone
        ("8765E4321", 4 / 8),
        ("S7654321E", 7 / 8),  # a non-digit token scores 0 at its position
        ("8P6B4321E", 6 / 8),
        ("", 0.0),
        ("9S9S9S9SE", 4 * 0.1 / 8),
    ],
)
def test_digit_reward_on_hand_made_responses(response, expected):
    assert score_digit_response(ids(response), "87654321") == pytest.approx(expected, abs=1e-12)


def test_text_and_ids_give_the_same_reward():
    tokenizer = build_synthetic_tokenizer()
    for text in ["87654321<eos>", "8765<eos>4321", "87<sep>54321", "8x654321", "<pad>7654321"]:
        token_ids = tokenizer(text).input_ids
        assert score_digit_response(response_ids_from_text(text), "87654321") == pytest.approx(
            score_digit_response(token_ids, "87654321")
        )


def test_answer_must_be_digits():
    with pytest.raises(ValueError, match="digit string"):
        score_digit_response([1, 2], "")
    with pytest.raises(ValueError, match="digit string"):
        score_digit_response([1, 2], "1a")


def test_tasks_answers_and_correct_responses():
    digits = [3, 1, 4, 1, 5, 9, 2, 6]
    prompt_ids, text, answer = task_example("digit_reversal", digits)
    assert prompt_ids == [*digits, SEP_TOKEN_ID] and text == "31415926<sep>"
    assert answer == "62951413"
    assert correct_response_ids(answer) == [6, 2, 9, 5, 1, 4, 1, 3, EOS_TOKEN_ID]
    assert score_digit_response(correct_response_ids(answer), answer) == 1.0
    assert task_example("digit_sort", digits)[2] == "11234569"


def test_synthetic_tokenizer_round_trip(tmp_path):
    tokenizer = build_synthetic_tokenizer()
    assert len(tokenizer) == 15 <= 64
    assert [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)] == list(range(10))
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (10, 11, 12)
    assert tokenizer.sep_token_id == SEP_TOKEN_ID == 13
    text = "31415926<sep>62951413<eos>"
    encoded = tokenizer(text).input_ids  # no BOS is added
    assert encoded == [3, 1, 4, 1, 5, 9, 2, 6, 13, 6, 2, 9, 5, 1, 4, 1, 3, 12]
    assert tokenizer.decode(encoded) == text
    assert tokenizer.decode(encoded, skip_special_tokens=True) == "3141592662951413"
    assert tokenizer("7 a").input_ids == [7, 14, 14]  # anything else is <unk>
    # Saved and reloaded through the Hugging Face API, with its chat template.
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(text).input_ids == encoded and reloaded.eos_token_id == EOS_TOKEN_ID
    rendered = reloaded.apply_chat_template(
        [{"role": "user", "content": "31415926<sep>"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "31415926<sep>"


def test_byte_tokenizer_round_trip():
    tokenizer = build_byte_tokenizer()
    text = "Héllo\n\twörld  ∑ 日本 <|im_start|>"
    encoded = tokenizer(text, add_special_tokens=False).input_ids
    assert encoded[: len(b"H\xc3\xa9")] == list(b"H\xc3\xa9")  # id = byte
    assert encoded[-1] == 257 and len(tokenizer) == 259
    assert tokenizer.decode(encoded) == text
