"""Sampling semantics against float64 references and SGLang's truncation rule."""

from __future__ import annotations

import numpy as np
import torch

from megatron_gspo.rollout.sampling import sample_tokens, temperature_log_probs, truncation_mask


def test_temperature_log_probs_match_float64():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    temperatures = torch.tensor([0.6, 1.0, 0.0])
    log_probs = temperature_log_probs(logits, temperatures)
    reference = logits.double()
    for row, temperature in enumerate([0.6, 1.0, 1.0]):  # greedy rows report T = 1
        expected = torch.log_softmax(reference[row] / temperature, dim=-1)
        torch.testing.assert_close(log_probs[row].double(), expected, atol=1e-6, rtol=1e-6)


def _reference_keep(probs: list[float], top_p: float, top_k: int) -> set[int]:
    """SGLang's rule written out: ranks < top_k, then drop tokens whose preceding mass > top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    k = top_k if top_k > 0 else len(probs)
    kept, mass = set(), 0.0
    for rank, index in enumerate(order):
        if rank >= k:
            break
        if rank == 0 or mass <= top_p:
            kept.add(index)
        mass += probs[index]
    return kept


def test_truncation_mask_follows_sglang_rule():
    generator = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(6, 20, generator=generator, dtype=torch.float64) * 2, dim=-1)
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.01, 0.7, 1.0], dtype=torch.float64)
    top_k = torch.tensor([-1, -1, 3, 5, 1, 20])
    mask = truncation_mask(probs, top_p, top_k)
    for row in range(6):
        expected = _reference_keep(probs[row].tolist(), float(top_p[row]), int(top_k[row]))
        assert set(mask[row].nonzero().flatten().tolist()) == expected, row


def test_samples_follow_the_truncated_distribution():
    draws = 5000
    log_probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(draws, 4)
    generators = [torch.Generator().manual_seed(seed) for seed in range(draws)]
    tokens = sample_tokens(
        log_probs,
        torch.ones(draws),
        torch.full((draws,), 0.7),
        torch.full((draws,), -1),
        generators,
    )
    counts = np.bincount(tokens.numpy(), minlength=4)
    # top_p = 0.7 keeps {0, 1} (mass before token 2 is 0.8 > 0.7); renormalised 0.625 / 0.375.
    assert counts[2] == counts[3] == 0
    # 4.4 standard deviations of a proportion over 5000 draws.
    np.testing.assert_allclose(counts[:2] / draws, [0.625, 0.375], atol=0.03)


def test_rows_use_only_their_own_generator():
    log_probs = torch.log_softmax(
        torch.randn(3, 30, generator=torch.Generator().manual_seed(3)), -1
    )
    temperatures, top_p, top_k = torch.ones(3), torch.ones(3), torch.full((3,), -1)
    generators = [torch.Generator().manual_seed(seed) for seed in (5, 6, 7)]
    together = [sample_tokens(log_probs, temperatures, top_p, top_k, generators) for _ in range(5)]
    alone = []
    generator = torch.Generator().manual_seed(6)
    for _ in range(5):
        alone.append(
            sample_tokens(log_probs[1:2], temperatures[:1], top_p[:1], top_k[:1], [generator])
        )
    assert [int(t[1]) for t in together] == [int(t[0]) for t in alone]


def test_greedy_rows_take_argmax_without_drawing_noise():
    log_probs = torch.log_softmax(
        torch.randn(2, 10, generator=torch.Generator().manual_seed(4)), -1
    )
    generator = torch.Generator().manual_seed(9)
    state = generator.get_state()
    tokens = sample_tokens(
        log_probs, torch.zeros(2), torch.ones(2), torch.full((2,), -1), [generator, generator]
    )
    assert tokens.tolist() == log_probs.argmax(-1).tolist()
    assert torch.equal(generator.get_state(), state)
