"""The OpenAI-compatible endpoint with the real ``openai`` client and a real tiny engine.

A harness that sends the whole conversation back each turn must still give a session whose
token history is exactly the engine's tokens: each call's input extends the previous call's
input and output, and the recorded ids and log-probs are those the engine gives for that input
(checked against a separate engine call). A model taught one tool call answers with it, and the
client receives it parsed.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from megatron_gspo.data.tokenizer import CHATML_TOOLS_TEMPLATE, IM_END, build_byte_tokenizer
from megatron_gspo.rollout.chat_endpoint import SESSION_HEADER, ChatEndpoint, SessionSettings
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.hf_model import build_hf_model
from megatron_gspo.rollout.types import GenerateRequest
from tests.rollout.conftest import tiny_model_config

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer(CHATML_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def model_config():
    return tiny_model_config(vocab_size=260, max_position_embeddings=1024)


def settings(tokenizer, **overrides) -> SessionSettings:
    fields = dict(
        seed=7,
        response_budget=400,
        max_turns=4,
        max_tokens_per_turn=12,
        stop_token_ids=(tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)),
    )
    return SessionSettings(**{**fields, **overrides})


def client(endpoint: ChatEndpoint, session_id: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=endpoint.base_url,
        api_key=endpoint.api_key,
        default_headers={SESSION_HEADER: session_id},
        max_retries=0,
    )


def test_whole_conversation_harness_gives_the_engine_tokens(tokenizer, model_config):
    engine = EmbeddedEngine(model_config, seed=3)
    with ChatEndpoint(engine, tokenizer) as endpoint:
        session_id = endpoint.open_session(settings(tokenizer))
        chat = client(endpoint, session_id)
        messages = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]
        for turn in range(2):
            answer = chat.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            # The harness sends everything back: the answer as the client's object dumped with
            # every field, then a tool result.
            messages.append(answer.choices[0].message.model_dump())
            messages.append({"role": "tool", "tool_call_id": f"c{turn}", "content": str(turn)})
        session = endpoint.close_session(session_id)
    calls = session.calls
    assert len(calls) == 2 and all(call.appended for call in calls)
    reencoded_differs = False
    for previous, call in zip(calls, calls[1:]):
        history = previous.input_ids + previous.result.output_ids
        assert call.input_ids[: len(history)] == history
        text = tokenizer.decode(previous.result.output_ids)
        reencoded_differs |= tokenizer(text, add_special_tokens=False)["input_ids"] != (
            previous.result.output_ids
        )
    # The model's bytes are random: decode-then-encode changes some of them (invalid UTF-8
    # becomes U+FFFD), so a re-encoding endpoint would fail the prefix check above.
    assert reencoded_differs
    for index, call in enumerate(calls):
        (again,) = engine.generate(
            [
                GenerateRequest(
                    input_ids=call.input_ids,
                    max_new_tokens=12,
                    stop_token_ids=settings(tokenizer).stop_token_ids,
                    seed=_turn_seed(index),
                )
            ]
        )
        assert again.output_ids == call.result.output_ids
        torch.testing.assert_close(
            torch.as_tensor(again.output_log_probs),
            torch.as_tensor(call.result.output_log_probs),
            rtol=0,
            atol=1e-6,
        )


def _turn_seed(index: int) -> int:
    from megatron_gspo.rollout.types import derive_turn_seed

    return derive_turn_seed(7, index)


def _taught_engine(tokenizer, model_config, prompt_ids: list[int], target_ids: list[int]):
    """A tiny model fitted to answer ``prompt_ids`` with ``target_ids`` (greedy)."""
    model = build_hf_model(model_config, dtype=torch.float32, seed=0)
    sequence = torch.tensor([prompt_ids + target_ids])
    labels = sequence.clone()
    labels[0, : len(prompt_ids)] = -100
    model.requires_grad_(True)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    model.train()
    for _ in range(150):
        output = model(input_ids=sequence, labels=labels)
        # Greedy decoding needs only the right argmax at every target position.
        predicted = output.logits[0, len(prompt_ids) - 1 : -1].argmax(-1)
        if predicted.tolist() == target_ids:
            break
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
    model.requires_grad_(False)
    return EmbeddedEngine(model_config, hf_model=model)


def test_tool_calls_parse(tokenizer, model_config):
    messages = [{"role": "user", "content": "2+3?"}]
    # No tools in the request: a short prompt keeps the fitting quick (parsing needs none).
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    target = tokenizer(CALL_TEXT + IM_END, add_special_tokens=False)["input_ids"]
    engine = _taught_engine(tokenizer, model_config, list(prompt), target)
    with ChatEndpoint(engine, tokenizer) as endpoint:
        session_id = endpoint.open_session(
            settings(tokenizer, temperature=0.0, max_tokens_per_turn=len(target) + 4)
        )
        chat = client(endpoint, session_id)
        answer = chat.chat.completions.create(model="policy", messages=messages)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
        assert choice.message.content == ""
        # A sampling setting other than the run's is refused, not trained on.
        with pytest.raises(openai.BadRequestError, match="temperature"):
            chat.chat.completions.create(model="policy", messages=messages, temperature=0.5)
        # Unknown sessions and wrong keys are refused.
        with pytest.raises(openai.NotFoundError):
            client(endpoint, "nobody").chat.completions.create(model="p", messages=messages)
        wrong_key = openai.OpenAI(base_url=endpoint.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong_key.chat.completions.create(model="p", messages=messages)
        session = endpoint.close_session(session_id)
    assert session.calls[0].result.output_ids == target
