"""The embedded engine on Qwen's vocabulary: chat-templated text prompts in, ids and text out.

A tiny Qwen3-MoE with Qwen3's 151,936 embedding rows (hidden 32) generates from the arithmetic
word problems (:mod:`megatron_gspo.data.arithmetic_text`) rendered with the real tokenizer's
ChatML template; the responses are decoded as the reward sees them, cut at stop strings and
scored by the math reward. Untrained, the model scores 0; the boxed reference answer scores 1.
"""

from __future__ import annotations

import pytest

from megatron_gspo.data import load_prompt_dataset
from megatron_gspo.data.arithmetic_text import boxed_answer, write_arithmetic_prompt_file
from megatron_gspo.data.stop_strings import cut_at_stop_string
from megatron_gspo.reward.functions import RewardInput
from megatron_gspo.reward.math_answer import math_reward
from megatron_gspo.rollout.types import GenerateRequest

from .conftest import tiny_model_config

IM_END, ENDOFTEXT = 151_645, 151_643


@pytest.fixture(scope="module")
def qwen_vocab_engine():
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(tiny_model_config(vocab_size=151_936), seed=3)
    yield engine
    engine.close()


def test_text_prompts_generate_decode_and_score(qwen_vocab_engine, qwen_tokenizer, tmp_path):
    path = write_arithmetic_prompt_file(tmp_path / "arithmetic.jsonl", 4, seed=1)
    dataset = load_prompt_dataset(path, qwen_tokenizer, max_prompt_length=96)
    prompts = [dataset.prompt(index) for index in range(len(dataset))]
    stops = (IM_END, ENDOFTEXT)
    results = qwen_vocab_engine.generate(
        [
            GenerateRequest(p.prompt_ids, 12, stop_token_ids=stops, min_new_tokens=4, seed=index)
            for index, p in enumerate(prompts)
        ]
    )
    for prompt, result in zip(prompts, results):
        assert result.prompt_length == len(prompt.prompt_ids) and prompt.prompt_ids[0] == 151_644
        assert len(result.output_ids) >= 4 and not set(result.output_ids[:3]) & set(stops)
        assert all(0 <= token < 151_936 for token in result.output_ids)
        response = qwen_tokenizer.decode(result.output_ids, skip_special_tokens=True)
        sample = RewardInput(prompt=prompt.prompt_text, response=response, answer=prompt.answer)
        assert math_reward(sample) == 0.0  # random weights do not write \boxed{answer}
        right = RewardInput(prompt.prompt_text, boxed_answer(prompt.answer), prompt.answer)
        assert math_reward(right) == 1.0


def test_stop_strings_cut_embedded_responses(qwen_vocab_engine, qwen_tokenizer):
    """The embedded engine stops on token ids only; a stop string is applied to its ids after
    generation, at the token SGLang would stop on (checked against SGLang in
    tests/real_sglang/test_real_tokenizer.py)."""
    prompt = qwen_tokenizer.apply_chat_template(
        [{"role": "user", "content": "写一句话 ✍️"}], tokenize=False, add_generation_prompt=True
    )
    ids = qwen_tokenizer.encode(prompt, add_special_tokens=False)
    (result,) = qwen_vocab_engine.generate([GenerateRequest(ids, 12, temperature=0.0)])
    text = qwen_tokenizer.decode(result.output_ids)
    stop = next(
        text[index : index + 2]
        for index in range(len(text) // 2, len(text) - 1)
        if text[index : index + 2].strip() and "\ufffd" not in text[index : index + 2]
    )
    length, matched = cut_at_stop_string(qwen_tokenizer, result.output_ids, [stop])
    assert matched == stop and stop in qwen_tokenizer.decode(result.output_ids[:length])
    assert stop not in qwen_tokenizer.decode(result.output_ids[: length - 1])
