"""The embedded engine on Qwen's vocabulary: chat-templated text prompts in, ids and text out.

A tiny Qwen3-MoE with Qwen3's 151,936 embedding rows (hidden 32) generates from the arithmetic
word problems (:mod:`megatron_gspo.data.arithmetic_text`) rendered with the real tokenizer's
ChatML template; the responses are decoded as the reward sees them, cut at stop strings and
scored by the math reward. Untrained, the model scores 0; the boxed reference answer scores 1.
"""

from __future__ import annotations

import pytest
import torch

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


def test_retokenized_samples_carry_the_engines_log_probs(
    qwen_vocab_engine, qwen_tokenizer, tmp_path
):
    """``rollout.retokenize_responses`` on samples this engine generated: the ids become the
    decode-then-encode ones, each response's log-prob total is kept, an unchanged response keeps
    its values bit for bit, and up to the first changed token the carried values are the ones
    the engine gives the new ids (teacher-forced: the context is the same there)."""
    from megatron_gspo.production.retokenization import Retokenizer
    from megatron_gspo.production.sampling import Sampling
    from megatron_gspo.production.single_turn import generate
    from megatron_gspo.production.task import Task

    path = write_arithmetic_prompt_file(tmp_path / "arithmetic.jsonl", 4, seed=2)
    dataset = load_prompt_dataset(path, qwen_tokenizer, max_prompt_length=96)
    prompts = [dataset.prompt(index) for index in range(len(dataset))]
    task = Task(qwen_tokenizer, stream=None, eval_prompts=[], eos_token_id=IM_END)
    sampling = Sampling(1.0, 1.0, -1, 0, 16, group_size=4, return_routes=True, seed=5)
    samples, _ = generate(qwen_vocab_engine, task, prompts, sampling, step=0)
    before = [
        (s.tokens[s.prompt_length :].tolist(), s.rollout_log_probs.double().clone())
        for s in samples
    ]
    metrics = Retokenizer(qwen_tokenizer)(samples)
    changed = 0
    for sample, (old_ids, old_log_probs) in zip(samples, before):
        new_ids = sample.tokens[sample.prompt_length :].tolist()
        text = qwen_tokenizer.decode(old_ids, skip_special_tokens=False)
        assert new_ids == qwen_tokenizer.encode(text, add_special_tokens=False)
        assert sample.rollout_routes is None and sample.rollout_log_probs.numel() == len(new_ids)
        new_log_probs = sample.rollout_log_probs.double()
        assert float(new_log_probs.sum()) == pytest.approx(float(old_log_probs.sum()), abs=1e-4)
        if new_ids == old_ids:
            assert torch.equal(new_log_probs, old_log_probs)
            continue
        changed += 1
        first = next(i for i, (a, b) in enumerate(zip(old_ids, new_ids)) if a != b)
        (scored,) = qwen_vocab_engine.score(
            [sample.tokens[: sample.prompt_length].tolist()], [new_ids]
        )
        assert new_log_probs[:first].tolist() == pytest.approx(scored[:first].tolist(), abs=1e-5)
    assert changed > 0, "no response changed: the test would not check the carrying"
    assert metrics["retokenized_frac_seq"] == changed / len(samples)
    assert 0 < metrics["retokenized_frac_token"] < 1
