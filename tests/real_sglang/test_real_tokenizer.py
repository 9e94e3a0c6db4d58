"""A real SGLang 0.5.23 server WITH a tokenizer (no ``--skip-tokenizer-init``) on Qwen's vocabulary.

The model is the CPU demo's Qwen3-MoE shape with Qwen3's embedding size (151,936 rows; 20 M
parameters, nearly all embedding and output layer); its directory holds the real BPE tokenizer of
``tests/conftest.py``. The embedded engine with the same seed has the same weights, and is the
reference for: the ids and log-probs of greedy generation, SGLang's detokenized ``text``, stop
strings (:func:`megatron_gspo.data.stop_strings.cut_at_stop_string`: SGLang's rule on the
embedded engine's ids) and ``min_new_tokens`` (same ids; SGLang's log-probs are of the
distribution with the stop tokens masked, ``docs/sglang-protocol.md`` section 1). One server for
the module, beside the package's float32 server (``docs/sglang-protocol.md`` section 8).

Slow tier (``--full``): this module's own server (a 20 M-parameter export and SGLang's start,
about 40 s of CI's budget) is the cost. CI keeps the real tokenizer through the embedded engine
(``tests/rollout/test_real_tokenizer.py``, ``tests/data/test_real_tokenizer.py``) and SGLang through
the package's float32 server.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

from megatron_gspo.data.stop_strings import cut_at_stop_string
from megatron_gspo.rollout.types import GenerateRequest

from .server import SKIP_REASON, export_model, server_model_config, sglang_python, start_server

pytestmark = pytest.mark.slow

QWEN3_VOCAB_SIZE = 151_936
IM_END = 151_645
PROMPT_MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "小明有 3 个苹果 🍎, he buys 4 more. How many? 答案用 \\boxed{}"},
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def text_model():
    return server_model_config(vocab_size=QWEN3_VOCAB_SIZE)


@pytest.fixture(scope="module")
def text_server(tmp_path_factory, qwen_tokenizer, text_model):
    python = sglang_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    directory = tmp_path_factory.mktemp("real_sglang_text")
    export_model(text_model, directory / "model")
    qwen_tokenizer.save_pretrained(str(directory / "model"))
    server = start_server(
        python,
        text_model,
        directory / "model",
        directory / "server.log",
        free_port("127.0.0.1"),
        skip_tokenizer_init=False,
    )
    try:
        yield server
    finally:
        left = server.stop()
        assert not left, f"processes of the SGLang server outlived it and were killed: {left}"


@pytest.fixture(scope="module")
def embedded(text_model):
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(text_model, seed=0)  # export_model's seed: the server's weights
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt_ids(qwen_tokenizer) -> list[int]:
    text = qwen_tokenizer.apply_chat_template(
        PROMPT_MESSAGES, tokenize=False, add_generation_prompt=True
    )
    return qwen_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def greedy(embedded, prompt_ids):
    """The embedded engine's greedy response: no stop token, ``NEW_TOKENS`` tokens."""
    (result,) = embedded.generate([GenerateRequest(prompt_ids, NEW_TOKENS, temperature=0.0)])
    assert result.response_length == NEW_TOKENS
    return result


def sglang_generate(server, prompt_ids, **sampling) -> dict:
    """One greedy ``/generate`` with text: SGLang's answer item."""
    params = {
        "max_new_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        **sampling,
    }
    return server.post(
        "/generate",
        {
            "input_ids": prompt_ids,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
        },
    )


def log_probs_of(item: dict) -> np.ndarray:
    return np.array([entry[0] for entry in item["meta_info"]["output_token_logprobs"]])


def test_text_and_log_probs_equal_the_embedded_engine(
    text_server, greedy, prompt_ids, qwen_tokenizer
):
    """Greedy ids, per-token log-probs (temperature 1 for greedy) and the detokenized text.
    ``ignore_eos``: a server with a tokenizer also stops on the tokenizer's EOS (<|im_end|>),
    which the embedded engine does only when asked."""
    item = sglang_generate(text_server, prompt_ids, ignore_eos=True)
    assert item["output_ids"] == greedy.output_ids
    assert np.abs(log_probs_of(item) - greedy.output_log_probs).max() < 1e-5
    assert item["text"] == qwen_tokenizer.decode(greedy.output_ids, skip_special_tokens=False)
    assert item["meta_info"]["prompt_tokens"] == len(prompt_ids)


def test_stop_strings_cut_where_the_text_first_contains_them(
    text_server, greedy, prompt_ids, qwen_tokenizer
):
    """A stop string taken from the middle of the embedded engine's text: SGLang ends the
    response at the token that completes it, as ``cut_at_stop_string`` says, and its text at the
    end of the string."""
    text = qwen_tokenizer.decode(greedy.output_ids, skip_special_tokens=False)
    middle = len(text) // 2
    stop = text[middle : middle + 2]
    assert stop.strip() and "\ufffd" not in stop, text
    length, matched = cut_at_stop_string(qwen_tokenizer, greedy.output_ids, [stop])
    assert length < NEW_TOKENS, (text, stop)
    item = sglang_generate(text_server, prompt_ids, ignore_eos=True, stop=[stop])
    assert item["output_ids"] == greedy.output_ids[:length]
    assert item["meta_info"]["finish_reason"] == {"type": "stop", "matched": matched}
    # The ids keep the whole last token, but the text ends with the stop string (no_stop_trim
    # keeps the string itself, not the rest of its token): text != decode(ids) here.
    kept = qwen_tokenizer.decode(greedy.output_ids[:length], skip_special_tokens=False)
    assert item["text"] == kept[: kept.index(stop) + len(stop)]


def test_min_new_tokens_holds_back_the_stop_tokens(
    text_server, embedded, greedy, prompt_ids, qwen_tokenizer
):
    """The greedy first token made a stop token: without ``min_new_tokens`` both engines stop at
    once; with it both emit the same other tokens. SGLang's log-probs for the first
    ``min_new_tokens`` tokens are those of the masked distribution, ``log p - log(1 - p_stop)``,
    where the embedded engine reports ``log p``."""
    stops = [greedy.output_ids[0], IM_END]
    minimum = 3
    (plain,) = embedded.generate(
        [GenerateRequest(prompt_ids, NEW_TOKENS, temperature=0.0, stop_token_ids=stops)]
    )
    item = sglang_generate(text_server, prompt_ids, stop_token_ids=stops)
    assert plain.output_ids == item["output_ids"] == greedy.output_ids[:1]
    assert item["meta_info"]["finish_reason"]["type"] == "stop"

    (held,) = embedded.generate(
        [
            GenerateRequest(
                prompt_ids,
                NEW_TOKENS,
                temperature=0.0,
                stop_token_ids=stops,
                min_new_tokens=minimum,
            )
        ]
    )
    item = sglang_generate(text_server, prompt_ids, stop_token_ids=stops, min_new_tokens=minimum)
    assert item["output_ids"] == held.output_ids
    assert len(held.output_ids) > minimum - 1 and held.output_ids[0] not in stops
    assert item["text"] == qwen_tokenizer.decode(held.output_ids, skip_special_tokens=False)
    # The stop tokens' probability at each held-back position, from the embedded forward.
    stop_mass = _stop_probabilities(embedded, prompt_ids, held.output_ids[:minimum], stops)
    expected = held.output_log_probs[:minimum] - np.log1p(-stop_mass)
    got = log_probs_of(item)
    assert np.abs(got[:minimum] - expected).max() < 1e-5, (got, held.output_log_probs, stop_mass)
    assert np.abs(got[minimum:] - held.output_log_probs[minimum:]).max() < 1e-5
    assert math.isfinite(float(stop_mass.sum())) and (stop_mass > 1e-6).all()


def _stop_probabilities(embedded, prompt_ids, output_ids, stops) -> np.ndarray:
    """``p(stop tokens)`` at the positions that predicted ``output_ids`` (temperature 1)."""
    import torch

    with torch.no_grad():
        tokens = torch.tensor([list(prompt_ids) + list(output_ids)])
        logits = embedded.hf_model(tokens).logits[0].float()
    probabilities = torch.softmax(logits, dim=-1)
    rows = torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(output_ids))
    return probabilities[rows][:, stops].sum(dim=-1).numpy()
