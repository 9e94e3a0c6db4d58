"""Generation on a real SGLang 0.5.23 server (CPU, float32) through the project's client.

Every number is checked against transformers' float32 forward of the same weights (the exported
checkpoint the server loaded): log-probs per token at the sampling temperature, before top-k/top-p
truncation; greedy tokens; the support of top-k / top-p samples; the distribution of temperature
samples; routed experts (R3) against the routers' own top-k.
"""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
import torch
import transformers

from megatron_gspo.rollout.hf_model import forward_with_routes
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_protocol import RouteLayout
from megatron_gspo.rollout.types import GenerateRequest, RolloutEngineError

PROMPTS = [[1, 2, 3], [7, 7, 1, 0, 5], [4], [9, 8, 7, 6, 5, 4, 3]]


@pytest.fixture(scope="module")
def reference(sglang_server):
    """transformers' float32 model loaded from the directory the server loaded."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(sglang_server.model_dir), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture
def client(fresh_server):
    engine = SGLangEngine(
        [fresh_server.url],
        RouteLayout.from_model_config(fresh_server.model),
        api_key=fresh_server.api_key,
        request_timeout_s=120,
    )
    yield engine
    engine.close()


def log_softmax(reference, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``[len(tokens), V]`` next-token log-probs of ``tokens`` at ``temperature`` (float32)."""
    with torch.no_grad():
        logits = reference(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def response_log_probs(reference, prompt, output, temperature):
    table = log_softmax(reference, list(prompt) + list(output), temperature)
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(output))
    return table[rows, torch.tensor(output)], table[rows]


def test_log_probs_equal_transformers_fp32(client, reference):
    """Per-token log-probs at the sampling temperature, for a batch of prompts (one call)."""
    for temperature in (1.0, 0.7):
        requests_ = [
            GenerateRequest(prompt, max_new_tokens=12, temperature=temperature, seed=11 + i)
            for i, prompt in enumerate(PROMPTS)
        ]
        results = client.generate(requests_)
        assert [r.prompt_length for r in results] == [len(p) for p in PROMPTS]
        worst = 0.0
        for request, result in zip(requests_, results):
            assert result.finish_reason == "length" and result.response_length == 12
            expected, _ = response_log_probs(
                reference, request.input_ids, result.output_ids, temperature
            )
            got = torch.from_numpy(result.output_log_probs)
            worst = max(worst, float((got - expected).abs().max()))
        assert worst < 1e-5, (temperature, worst)


def test_sampling_seeds_are_ignored_without_deterministic_inference(client, fresh_server):
    """SGLang 0.5.23 honours ``sampling_seed`` only under ``--enable-deterministic-inference``,
    which its CPU backend cannot run (torch_native attention is not among the deterministic
    backends): the same seeds sample other tokens, and the client reports the server as
    non-deterministic (a resumed run will not redraw the same samples)."""
    assert fresh_server.get("/server_info")["enable_deterministic_inference"] is False
    requests_ = [GenerateRequest(p, max_new_tokens=12, seed=11) for p in PROMPTS]
    first, second = client.generate(requests_), client.generate(requests_)
    assert [r.output_ids for r in first] != [r.output_ids for r in second]


def test_greedy_and_truncated_sampling_are_honoured(client, reference):
    prompt = PROMPTS[1]
    # temperature 0: argmax at every step; log-probs at temperature 1.
    (greedy,) = client.generate([GenerateRequest(prompt, max_new_tokens=10, temperature=0.0)])
    expected_lp, table = response_log_probs(reference, prompt, greedy.output_ids, 1.0)
    assert greedy.output_ids == table.argmax(-1).tolist()
    assert float((torch.from_numpy(greedy.output_log_probs) - expected_lp).abs().max()) < 1e-5

    # top-k = 3 and top-p = 0.6 at temperature 1.3: every sampled token lies in the truncated
    # support, while the reported log-probs are those of the untruncated distribution.
    temperature = 1.3
    for top_k, top_p in ((3, 1.0), (-1, 0.6)):
        results = client.generate(
            [
                GenerateRequest(
                    prompt, max_new_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p
                )
            ],
            n=16,
        )
        assert len({tuple(r.output_ids) for r in results}) > 1
        for result in results:
            expected_lp, table = response_log_probs(
                reference, prompt, result.output_ids, temperature
            )
            assert (
                float((torch.from_numpy(result.output_log_probs) - expected_lp).abs().max()) < 1e-5
            )
            probabilities = table.exp()
            for position, token in enumerate(result.output_ids):
                row = probabilities[position]
                if top_k > 0:
                    assert int((row > row[token]).sum()) < top_k, (position, token)
                else:  # the mass of strictly more probable tokens is below top_p
                    assert float(row[row > row[token]].sum()) < top_p + 1e-5, (position, token)


def test_temperature_samples_follow_the_distribution(client, reference):
    """1024 first tokens at temperature 1.5 against transformers' probabilities: total variation
    below 0.1 (sampling noise is about 0.05); the temperature-1 distribution is further away."""
    prompt = PROMPTS[0]
    results = client.generate(
        [GenerateRequest(prompt, max_new_tokens=1, temperature=1.5, return_logprob=False)], n=1024
    )
    counts = np.bincount([r.output_ids[0] for r in results], minlength=16) / len(results)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0, -1].float()
    at_sampling = torch.softmax(logits / 1.5, -1).numpy()
    at_one = torch.softmax(logits, -1).numpy()
    distance = 0.5 * np.abs(counts - at_sampling).sum()
    assert distance < 0.1, distance
    assert 0.5 * np.abs(at_sampling - at_one).sum() > 2 * distance


def test_stop_tokens_and_length(client, reference):
    prompt = PROMPTS[2]
    (free,) = client.generate([GenerateRequest(prompt, max_new_tokens=6, temperature=0.0)])
    assert free.finish_reason == "length" and free.response_length == 6
    stop = free.output_ids[2]
    first = free.output_ids.index(stop)
    (stopped,) = client.generate(
        [GenerateRequest(prompt, max_new_tokens=6, temperature=0.0, stop_token_ids=[stop])]
    )
    # The stop token is kept (no_stop_trim) and ends the response.
    assert stopped.output_ids == free.output_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.matched_stop_token == stop


def test_several_samples_per_prompt(client):
    """``n`` samples per prompt (SGLang's own ``n``) come back prompt-major, and differ."""
    requests_ = [GenerateRequest(p, max_new_tokens=8, temperature=1.0) for p in PROMPTS[:2]]
    results = client.generate(requests_, n=4)
    assert [r.prompt_length for r in results] == [3] * 4 + [5] * 4
    for group in (results[:4], results[4:]):
        assert len({tuple(r.output_ids) for r in group}) > 1
    assert [r.request_id for r in results[:4]] == [
        f"{requests_[0].request_id}/{i}" for i in range(4)
    ]


def test_routed_experts_are_the_routers_top_k(client, reference, fresh_server):
    """R3: ``[prompt + response - 1, MoE layers, top-k]`` logical expert ids, row ``j`` being the
    experts that token ``j`` was routed to in each layer, equal to the routers' top-k of
    transformers' forward over the same tokens (as sets: SGLang's order within a row may
    differ)."""
    layout = RouteLayout.from_model_config(fresh_server.model)
    results = client.generate(
        [
            GenerateRequest(
                p, max_new_tokens=9, temperature=1.0, seed=3, return_routed_experts=True
            )
            for p in PROMPTS
        ]
    )
    differing = total = 0
    for prompt, result in zip(PROMPTS, results):
        tokens = list(prompt) + result.output_ids
        routes = result.routed_experts
        assert routes.shape == (len(tokens) - 1, len(layout.moe_layer_indices), layout.top_k)
        assert all(
            len(set(row)) == layout.top_k for row in routes.reshape(-1, layout.top_k).tolist()
        )
        _, expected = forward_with_routes(reference, tokens[:-1])
        got = torch.from_numpy(routes.astype(np.int64))
        differing += int((got.sort(-1).values != expected.sort(-1).values).any(-1).sum())
        total += got.shape[0] * got.shape[1]
    # fp32 ties between the 2nd and 3rd expert could flip a row; none did in practice.
    assert differing <= total // 100, (differing, total)


def test_api_key_is_required(fresh_server):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    assert requests.post(fresh_server.url + "/generate", json=body, timeout=60).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert (
        requests.post(
            fresh_server.url + "/generate", json=body, headers=wrong, timeout=60
        ).status_code
        == 401
    )
    assert len(fresh_server.post("/generate", body)["output_ids"]) == 1


def test_the_key_is_on_no_command_line(fresh_server):
    """Every local user reads every process's ``/proc/<pid>/cmdline``: the launcher hands SGLang
    the key in its ``--config`` file (owner-only, removed once the server answers), so neither
    the server nor the scheduler and detokenizer it starts carry it on their command lines."""
    root = psutil.Process(fresh_server.process.process.pid)
    processes = [root, *root.children(recursive=True)]
    assert len(processes) >= 3, [p.cmdline() for p in processes]  # scheduler, detokenizer
    key = fresh_server.api_key.encode()
    for process in processes:
        command_line = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert key not in command_line, command_line.replace(key, b"<KEY>")
    config = root.cmdline()[root.cmdline().index("--config") + 1]
    assert not Path(config).exists()  # read at start; nothing left on disk
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    assert requests.post(fresh_server.url + "/generate", json=body, timeout=60).status_code == 401
    assert len(fresh_server.post("/generate", body)["output_ids"]) == 1


def test_min_new_tokens_is_refused_without_a_tokenizer(client):
    """Why ``rollout.min_new_tokens`` is a configuration error with ``rollout.engine=sglang``:
    the trainer's servers run ``--skip-tokenizer-init`` and SGLang 0.5.23 then refuses it."""
    with pytest.raises(RolloutEngineError, match="min_new_tokens=3 is unavailable"):
        client.generate([GenerateRequest([1, 2], max_new_tokens=6, min_new_tokens=3)])


def test_routes_decode_from_base64_int32(fresh_server):
    """The raw answer: base64 of int32 ``[L - 1, num_hidden_layers, K]`` (what
    ``sglang_protocol.decode_routed_experts`` reads)."""
    answer = fresh_server.post(
        "/generate",
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
            "return_routed_experts": True,
        },
    )
    raw = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), dtype=np.int32)
    layers, top_k = fresh_server.model.num_layers, fresh_server.model.moe_router_topk
    assert raw.size == (3 + 4 - 1) * layers * top_k
    assert raw.min() >= 0 and raw.max() < fresh_server.model.num_experts
