"""Chunked vocab-parallel log-probs against a float64 ``log_softmax(h @ W.T / T)`` reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

from megatron_gspo.engine import logprobs
from megatron_gspo.engine.logprobs import default_chunk_size, vocab_parallel_log_probs

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("logprobs_tp_worker.py")
DDP_WORKER = Path(__file__).with_name("logprobs_ddp_worker.py")


def reference_log_probs(hidden, weight, labels, temperature, vocab_size=None):
    """Naive float64 log-probs and entropy; ignored labels (< 0) give 0."""
    logits = hidden.double() @ weight.double().T / temperature
    logits = logits[:, :vocab_size]
    log_softmax = torch.log_softmax(logits, dim=-1)
    ignored = labels < 0
    log_probs = log_softmax.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs.masked_fill(ignored, 0.0), entropy.masked_fill(ignored, 0.0)


def make_inputs(tokens=40, hidden_size=16, vocab=50, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    # Logits of order a few units: softmax neither uniform nor one-hot.
    weight = 2.0 * torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[[2, 17]] = -100
    upstream = torch.randn(2, tokens, generator=generator)
    return hidden.to(dtype), weight.to(dtype), labels, upstream[0], upstream[1]


def gradients(log_probs, entropy, grad_log_probs, grad_entropy, inputs):
    loss = (log_probs * grad_log_probs).sum()
    if entropy is not None:
        loss = loss + (entropy * grad_entropy).sum()
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [8, 7, 64], ids=["divides", "remainder", "one-chunk"])
@pytest.mark.parametrize("block_rows", [None, 3], ids=["whole-chunk", "3-row-blocks"])
def test_matches_float64_reference(with_entropy, temperature, chunk_size, block_rows, monkeypatch):
    if block_rows is not None:
        # Elementwise passes in blocks of 3 rows (vocab 50), with a ragged last block.
        monkeypatch.setattr(logprobs, "ELEMENTWISE_BLOCK_ELEMENTS", 3 * 50)
    hidden, weight, labels, grad_lp, grad_ent = make_inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs(
        hidden,
        weight,
        labels,
        tp_group=None,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )
    assert log_probs.dtype == torch.float32
    assert (entropy is not None) == with_entropy

    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    ref_log_probs, ref_entropy = reference_log_probs(hidden64, weight64, labels, temperature)
    torch.testing.assert_close(log_probs.double(), ref_log_probs, rtol=1e-5, atol=1e-5)
    if with_entropy:
        torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)

    grads = gradients(log_probs, entropy, grad_lp, grad_ent, (hidden, weight))
    ref_grads = gradients(
        ref_log_probs,
        ref_entropy if with_entropy else None,
        grad_lp.double(),
        grad_ent.double(),
        (hidden64, weight64),
    )
    for grad, ref_grad in zip(grads, ref_grads):
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("local_vocab", "hidden_size", "dtype", "expected"),
    [
        (151_936, 64, torch.float32, 64),  # Qwen3's vocab, tiny model: the weight-shard budget
        (151_936 // 8, 64, torch.float32, 256),  # the same vocab over tp = 8
        (151_936, 256, torch.float32, 256),  # benchmarks/logprob_memory.py's shape
        (151_936, 4096, torch.bfloat16, 256),  # a real model: never above the measured 256
        (32_000, 64, torch.float32, 256),  # 32 MiB floor
        (64, 64, torch.float32, 256),
        (1_000_000, 4, torch.float32, 8),  # 32 MiB floor / 4 MB per token
        (1_000_000, 20, torch.float32, 16),  # the 80 MB weight shard / 4 MB per token
        (10_000_000, 1, torch.float32, 1),  # one token is the whole weight shard
    ],
)
def test_default_chunk_size_keeps_the_logits_buffer_within_budget(
    local_vocab, hidden_size, dtype, expected
):
    chunk = default_chunk_size(local_vocab, hidden_size, dtype)
    assert chunk == expected
    element_bytes = torch.empty((), dtype=dtype).element_size()
    row_bytes = local_vocab * (4 + (element_bytes if dtype != torch.float32 else 0))
    budget = max(logprobs.LOGITS_BUDGET_FLOOR_BYTES, local_vocab * hidden_size * element_bytes)
    assert chunk == 1 or chunk * row_bytes <= budget
    assert 1 <= chunk <= logprobs.DEFAULT_CHUNK_SIZE


def test_default_chunks_by_memory_match_float64_reference(monkeypatch):
    # A 1.6 kB floor makes the weight shard (50 x 16 fp32 = 3.2 kB) the budget: 16 tokens per
    # chunk, so the 40 tokens take three chunks, the last one partial.
    monkeypatch.setattr(logprobs, "LOGITS_BUDGET_FLOOR_BYTES", 1600)
    assert default_chunk_size(50, 16, torch.float32) == 16
    hidden, weight, labels, grad_lp, grad_ent = make_inputs(seed=6)
    hidden.requires_grad_()
    weight.requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs(
        hidden, weight, labels, tp_group=None, temperature=0.9, with_entropy=True
    )
    grads = gradients(log_probs, entropy, grad_lp, grad_ent, (hidden, weight))
    explicit = vocab_parallel_log_probs(
        hidden, weight, labels, tp_group=None, temperature=0.9, chunk_size=16, with_entropy=True
    )
    assert torch.equal(log_probs, explicit[0]) and torch.equal(entropy, explicit[1])

    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    ref_log_probs, ref_entropy = reference_log_probs(hidden64, weight64, labels, 0.9)
    torch.testing.assert_close(log_probs.double(), ref_log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    ref_grads = gradients(
        ref_log_probs, ref_entropy, grad_lp.double(), grad_ent.double(), (hidden64, weight64)
    )
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-5)


def test_weight_gradient_goes_into_megatron_main_grad():
    """Under Megatron DDP (TrainEngine, several micro-batches and chunks) the weight gradient is
    added to ``main_grad`` directly and equals DDP's own accumulation of the autograd gradient,
    for untied (entropy backward) and tied embeddings (log-prob backward, ``zero_out_wgrad``)."""
    from worker_launch import run_worker, worker_command

    report = json.loads(run_worker(worker_command(DDP_WORKER, 1), timeout=300).splitlines()[-1])
    assert sorted(report) == ["dense", "moe"]
    for case, result in report.items():
        assert result["fused_calls"] and all(result["fused_calls"]), case
        assert not any(result["plain_calls"]), case
        assert len(result["fused_calls"]) == len(result["plain_calls"]), case
        # The same sums in another fp32 order.
        assert result["max_relative_error"] < 1e-6, (case, result)
        assert result["grads_left_on_params"] == [], case


def test_entropy_alone_carries_gradient():
    # Only the entropy enters the loss: backward receives no log-prob gradient at all.
    hidden, weight, labels, _, grad_ent = make_inputs(seed=1)
    hidden.requires_grad_()
    weight.requires_grad_()
    _, entropy = vocab_parallel_log_probs(
        hidden, weight, labels, tp_group=None, temperature=0.9, chunk_size=6, with_entropy=True
    )
    grads = torch.autograd.grad((entropy * grad_ent).sum(), (hidden, weight))

    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    _, ref_entropy = reference_log_probs(hidden64, weight64, labels, 0.9)
    ref_grads = torch.autograd.grad((ref_entropy * grad_ent.double()).sum(), (hidden64, weight64))
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-5)


def test_ignored_positions_give_zero_and_no_gradient():
    hidden, weight, labels, grad_lp, grad_ent = make_inputs(seed=2)
    hidden.requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs(
        hidden, weight, labels, tp_group=None, chunk_size=5, with_entropy=True
    )
    ignored = labels < 0
    assert ignored.sum() == 2
    assert torch.all(log_probs[ignored] == 0) and torch.all(entropy[ignored] == 0)
    assert torch.all(log_probs[~ignored] < 0) and torch.all(entropy[~ignored] > 0)
    (grad_hidden,) = gradients(log_probs, entropy, grad_lp, grad_ent, (hidden,))
    assert torch.all(grad_hidden[ignored] == 0)
    assert torch.all(grad_hidden[~ignored].abs().sum(-1) > 0)


def test_padded_vocab_rows_are_left_out():
    hidden, weight, labels, grad_lp, grad_ent = make_inputs(seed=3)
    # Megatron pads the vocab rows; the padded rows must get no mass and no gradient.
    padded = torch.cat([weight, 5.0 * torch.randn(6, weight.shape[1])]).requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs(
        hidden, padded, labels, tp_group=None, chunk_size=7, with_entropy=True, vocab_size=50
    )
    ref_log_probs, ref_entropy = reference_log_probs(hidden, weight, labels, 1.0)
    torch.testing.assert_close(log_probs.double(), ref_log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    (grad_weight,) = gradients(log_probs, entropy, grad_lp, grad_ent, (padded,))
    assert torch.all(grad_weight[50:] == 0)


def test_bf16_inputs_close_to_float64_reference(monkeypatch):
    monkeypatch.setattr(logprobs, "ELEMENTWISE_BLOCK_ELEMENTS", 4 * 50)
    hidden, weight, labels, grad_lp, grad_ent = make_inputs(dtype=torch.bfloat16, seed=4)
    hidden.requires_grad_()
    weight.requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs(
        hidden, weight, labels, tp_group=None, temperature=0.8, chunk_size=9, with_entropy=True
    )
    assert log_probs.dtype == torch.float32 and entropy.dtype == torch.float32
    grads = gradients(log_probs, entropy, grad_lp, grad_ent, (hidden, weight))
    assert [grad.dtype for grad in grads] == [torch.bfloat16, torch.bfloat16]

    # Reference on the same bf16 values: what is left is the bf16 rounding of the logits (one
    # ulp 2^-8 relative on logits of a few units) and of the gradients.
    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    ref_log_probs, ref_entropy = reference_log_probs(hidden64, weight64, labels, 0.8)
    torch.testing.assert_close(log_probs.double(), ref_log_probs, rtol=0, atol=5e-2)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=5e-2)
    ref_grads = gradients(
        ref_log_probs, ref_entropy, grad_lp.double(), grad_ent.double(), (hidden64, weight64)
    )
    for grad, ref_grad in zip(grads, ref_grads):
        relative = (grad.double() - ref_grad).norm() / ref_grad.norm()
        assert relative < 2e-2, relative


def test_leading_dimensions_and_no_grad():
    hidden, weight, labels, _, _ = make_inputs(tokens=24, seed=5)
    flat, flat_entropy = vocab_parallel_log_probs(
        hidden, weight, labels, tp_group=None, chunk_size=5, with_entropy=True
    )
    with torch.no_grad():
        shaped, shaped_entropy = vocab_parallel_log_probs(
            hidden.view(6, 4, -1),
            weight.requires_grad_(),
            labels.view(6, 4),
            tp_group=None,
            chunk_size=5,
            with_entropy=True,
        )
    assert shaped.shape == (6, 4) and not shaped.requires_grad
    torch.testing.assert_close(shaped.reshape(-1), flat, rtol=0, atol=0)
    torch.testing.assert_close(shaped_entropy.reshape(-1), flat_entropy, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(labels=torch.full((40,), 50)), "is >= the vocab size"),
        (dict(labels=torch.zeros(39, dtype=torch.long)), "labels must have shape"),
        (dict(labels=torch.zeros(40)), "labels must be int64"),
        (dict(weight=torch.zeros(50, 15)), "do not match"),
        (dict(weight=torch.zeros(50, 16, dtype=torch.float64)), "must share one floating dtype"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(chunk_size=0), "chunk_size must be >= 1"),
        (dict(vocab_size=51), "exceeds the tp-padded vocab"),
    ],
)
def test_bad_inputs_raise_actionable_errors(change, message):
    hidden, weight, labels, _, _ = make_inputs()
    arguments = dict(hidden=hidden, weight=weight, labels=labels, tp_group=None) | change
    with pytest.raises(ValueError, match=message):
        vocab_parallel_log_probs(**arguments)


@pytest.mark.distributed
def test_tp2_matches_one_process(tmp_path):
    port = free_port()
    processes = []
    for rank in range(2):
        environment = os.environ | dict(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE="2",
            PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), "--out", str(tmp_path)],
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for rank, process in enumerate(processes):
        try:
            output, _ = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            pytest.fail(f"tp worker rank {rank} timed out")
        assert process.returncode == 0, f"rank {rank} failed:\n{output[-4000:]}"

    close = dict(rtol=1e-5, atol=1e-6)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        cases = sorted({key.split("/")[0] for key in result})
        assert cases == ["empty_shard", "padded_vocab", "plain"]
        for case in cases:
            get = lambda key, case=case, result=result: result[f"{case}/{key}"]  # noqa: E731
            torch.testing.assert_close(get("tp_log_probs"), get("tp1_log_probs"), **close)
            torch.testing.assert_close(get("tp_entropy"), get("tp1_entropy"), **close)
            torch.testing.assert_close(get("tp_grad_weight"), get("tp1_grad_weight"), **close)
            # Through copy_to_tensor_model_parallel_region: the full hidden gradient.
            torch.testing.assert_close(get("tp_grad_hidden"), get("tp1_grad_hidden"), **close)
            # Raw call: a partial gradient whose tp sum is the full one.
            torch.testing.assert_close(
                get("tp_summed_grad_hidden"), get("tp1_grad_hidden"), **close
            )
            if case == "empty_shard":
                # Rank 1 holds only padded rows: it adds nothing, so rank 0's partial is complete.
                if rank == 1:
                    assert torch.all(get("tp_partial_grad_hidden") == 0)
                    assert torch.all(get("tp_grad_weight") == 0)
            else:
                assert not torch.allclose(
                    get("tp_partial_grad_hidden"), get("tp1_grad_hidden"), **close
                )
