"""Pausing, flushing and weight updates on a real SGLang 0.5.23 server, also while requests are in
flight (what asynchronous training needs), recorded per token.

Two requests stream tokens (the test watches them arrive), the client pauses the server in one of
SGLang's three modes, syncs other weights (``sync_weights_paused``: pause, flush, the
``/begin_weight_update`` ... ``/end_weight_update`` bracket, resume) and the requests go on. Each
token's log-prob is compared with transformers' forward of the whole sequence under the old and
the new weights:

* ``abort``: the requests end at once (``finish_reason`` abort) with their partial tokens, all
  from the old weights;
* ``retract``: the requests go back to the queue; after the flush they are re-prefilled with the
  new weights, so every later token carries the new weights' exact log-prob, and SGLang's
  ``weight_versions`` spans say which token came from which version;
* ``in_place``: the requests keep their KV cache from the old weights: later tokens match neither
  policy, and the first token SGLang attributes to the new version was computed with the old
  weights (the overlap scheduler's forward in flight at the pause).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
import torch
import transformers

from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_protocol import RouteLayout
from megatron_gspo.rollout.types import GenerateRequest, RolloutEngineError, sync_weights_paused
from megatron_gspo.rollout.weight_loader import iter_safetensors_directory
from megatron_gspo.weight_sync import DiskTransport

from .server import export_model

NEW_VERSION = 7


@pytest.fixture(scope="module")
def new_weights(sglang_server, tmp_path_factory):
    """A second checkpoint of the server's model (other random weights) and its transformers
    twin; the first one's twin too."""
    directory = tmp_path_factory.mktemp("new_weights")
    export_model(sglang_server.model, directory, seed=1)
    load = transformers.AutoModelForCausalLM.from_pretrained
    old = load(str(sglang_server.model_dir), dtype=torch.float32).eval()
    new = load(str(directory), dtype=torch.float32).eval()
    return directory, old, new


@pytest.fixture
def client(fresh_server, tmp_path):
    engine = SGLangEngine(
        [fresh_server.url],
        RouteLayout.from_model_config(fresh_server.model),
        weight_transport=DiskTransport(
            str(tmp_path / "weights"), config_source_dir=str(fresh_server.model_dir)
        ),
        api_key=fresh_server.api_key,
        request_timeout_s=120,
        flush_retries=0,
    )
    yield engine
    engine.close()


class Stream(threading.Thread):
    """One streaming ``/generate`` request; ``latest`` is the last cumulative answer."""

    def __init__(self, server, prompt: list[int], max_new_tokens: int = 400):
        super().__init__(daemon=True)
        self.server, self.prompt, self.latest = server, prompt, None
        self.body = {
            "input_ids": prompt,
            "rid": f"stream-{time.time_ns()}-{prompt[0]}",  # unique: SGLang aborts by rid prefix
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0},
            "return_logprob": True,
            "stream": True,
        }

    def run(self) -> None:
        with requests.post(
            self.server.url + "/generate",
            json=self.body,
            headers=self.server.headers,
            stream=True,
            timeout=300,
        ) as response:
            for line in response.iter_lines():
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    self.latest = json.loads(line[5:])

    @property
    def num_tokens(self) -> int:
        return 0 if self.latest is None else len(self.latest["meta_info"]["output_token_logprobs"])

    def per_token(self, old, new) -> dict:
        """Tokens, SGLang's log-probs, transformers' log-probs under old and new weights."""
        meta = self.latest["meta_info"]
        output = [entry[1] for entry in meta["output_token_logprobs"]]
        tokens = torch.tensor([self.prompt + output])
        rows = torch.arange(len(self.prompt) - 1, tokens.shape[1] - 1)
        expected = {}
        for name, model in (("old", old), ("new", new)):
            with torch.no_grad():
                table = torch.log_softmax(model(tokens).logits[0].float(), -1)
            expected[name] = table[rows, torch.tensor(output)]
        return {
            "sglang": torch.tensor([entry[0] for entry in meta["output_token_logprobs"]]),
            **expected,
            "spans": [(s["version"], s["start"], s["end"]) for s in meta["weight_versions"]],
            "finish": meta["finish_reason"]["type"],
            "retractions": meta.get("num_retractions"),
        }


def wait_until(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def sync_during_streams(server, client, directory, mode: str) -> list[Stream]:
    streams = [Stream(server, [1, 2, 3]), Stream(server, [5, 4])]
    for stream in streams:
        stream.start()
    wait_until(lambda: all(s.num_tokens >= 3 for s in streams))
    stats = sync_weights_paused(
        client, iter_safetensors_directory(str(directory)), NEW_VERSION, pause_mode=mode
    )
    assert stats.num_bytes > 0 and client.weight_version == NEW_VERSION
    return streams


def finish(server, streams: list[Stream], more_tokens: int = 3) -> None:
    """Let continuing streams produce a few tokens under the new weights, then abort them."""
    counts = [s.num_tokens for s in streams]
    wait_until(
        lambda: all(
            not s.is_alive() or s.num_tokens >= c + more_tokens for s, c in zip(streams, counts)
        )
    )
    server.post("/abort_request", {"abort_all": True})
    for stream in streams:
        stream.join(60)
        assert not stream.is_alive()


def test_abort_mode_ends_requests_with_old_weights_tokens(fresh_server, client, new_weights):
    directory, old, new = new_weights
    streams = sync_during_streams(fresh_server, client, directory, "abort")
    for stream in streams:
        stream.join(60)
        record = stream.per_token(old, new)
        assert record["finish"] == "abort"
        assert record["spans"] == [("0", 0, stream.num_tokens)]
        assert float((record["sglang"] - record["old"]).abs().max()) < 1e-5
    # New requests sample from the new weights.
    (result,) = client.generate([GenerateRequest([1, 2, 3], max_new_tokens=6)])
    assert result.weight_version == NEW_VERSION
    tokens = torch.tensor([[1, 2, 3, *result.output_ids]])
    with torch.no_grad():
        table = torch.log_softmax(new(tokens).logits[0].float(), -1)
    expected = table[torch.arange(2, 8), torch.tensor(result.output_ids)]
    assert float((torch.from_numpy(result.output_log_probs) - expected).abs().max()) < 1e-5


def test_retract_mode_continues_requests_with_the_new_weights(fresh_server, client, new_weights):
    directory, old, new = new_weights
    streams = sync_during_streams(fresh_server, client, directory, "retract")
    finish(fresh_server, streams)
    for stream in streams:
        record = stream.per_token(old, new)
        (_, _, boundary), (version, start, end) = record["spans"]
        assert version == str(NEW_VERSION) and start == boundary and end == stream.num_tokens
        assert 3 <= boundary < end and record["retractions"] == 1
        gap_old = (record["sglang"][:boundary] - record["old"][:boundary]).abs().max()
        gap_new = (record["sglang"][boundary:] - record["new"][boundary:]).abs().max()
        assert float(gap_old) < 1e-5 and float(gap_new) < 1e-5, (gap_old, gap_new)


def test_in_place_mode_continues_on_the_old_kv_cache(fresh_server, client, new_weights):
    directory, old, new = new_weights
    streams = sync_during_streams(fresh_server, client, directory, "in_place")
    finish(fresh_server, streams)
    for stream in streams:
        record = stream.per_token(old, new)
        (_, _, boundary), (version, start, end) = record["spans"]
        assert version == str(NEW_VERSION) and start == boundary and end == stream.num_tokens
        assert record["retractions"] == 0
        # The first token attributed to the new version still has the old weights' log-prob.
        gap_old = (record["sglang"][: boundary + 1] - record["old"][: boundary + 1]).abs().max()
        assert float(gap_old) < 1e-5, gap_old
        # Later tokens: new weights over the old weights' KV cache, i.e. neither policy.
        later = slice(boundary + 1, None)
        assert float((record["sglang"][later] - record["new"][later]).abs().max()) > 1e-3
        assert float((record["sglang"][later] - record["old"][later]).abs().max()) > 1e-3


def test_flush_is_refused_while_requests_run(fresh_server, client):
    """``/flush_cache`` answers 400 while requests run (the client retries it; slime waits 60 s);
    a retract pause empties the running batch and the flush goes through."""
    streams = [Stream(fresh_server, [1, 2, 3])]
    streams[0].start()
    wait_until(lambda: streams[0].num_tokens >= 2)
    with pytest.raises(RolloutEngineError, match="HTTP 400"):
        client.flush_cache()
    client.pause("retract")
    client.flush_cache()
    client.resume()
    finish(fresh_server, streams, more_tokens=1)


def test_tensor_and_distributed_updates_need_the_bracket(fresh_server):
    """SGLang 0.5.23 refuses ``update_weights_from_tensor`` (and ``..._from_distributed``) outside
    ``/begin_weight_update`` ... ``/end_weight_update``; the client always brackets."""
    body = {"serialized_named_tensors": ["AA=="], "load_format": "flattened_bucket"}
    response = requests.post(
        fresh_server.url + "/update_weights_from_tensor",
        json=body,
        headers=fresh_server.headers,
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert "begin_weight_update" in response.text
