"""Sampling semantics against float64 references and SGLang's truncation rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_gspo.rollout.sampling import (
    UniformStreams,
    inverse_cdf_sample,
    sample_tokens,
    temperature_log_probs,
    truncation_mask,
)


def _uniforms(count: int, seed: int) -> torch.Tensor:
    return torch.rand(count, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _no_truncation(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperatures, top_p and top_k of ``rows`` plain T = 1 rows."""
    return torch.ones(rows), torch.ones(rows), torch.full((rows,), -1)


def test_temperature_log_probs_match_float64():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    temperatures = torch.tensor([0.6, 1.0, 0.0])
    log_probs = temperature_log_probs(logits, temperatures)
    reference = logits.double()
    for row, temperature in enumerate([0.6, 1.0, 1.0]):  # greedy rows report T = 1
        expected = torch.log_softmax(reference[row] / temperature, dim=-1)
        torch.testing.assert_close(log_probs[row].double(), expected, atol=1e-6, rtol=1e-6)


def test_unit_temperatures_skip_the_division_bit_for_bit():
    logits = torch.randn(4, 70, generator=torch.Generator().manual_seed(2)) * 3
    temperatures = torch.tensor([1.0, 0.0, 1.0, 0.0])
    divided = torch.log_softmax(logits / torch.ones(4, 1), dim=-1)
    assert torch.equal(temperature_log_probs(logits, temperatures), divided)


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


def _check_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor, tokens: torch.Tensor):
    """Each token ``t`` brackets ``u * C(V)`` between the float64 cumulative sums ``C(t - 1)``
    and ``C(t)``, up to the float32 rounding of block masses (1e-7 of the total), and has a
    positive weight."""
    cdf = np.cumsum(weights.double().numpy(), axis=-1)
    for row, token in enumerate(tokens.tolist()):
        assert weights[row, token] > 0, (row, token)
        target = float(uniforms[row]) * cdf[row, -1]
        slack = 1e-7 * cdf[row, -1]
        below = cdf[row, token - 1] if token > 0 else 0.0
        assert below - slack <= target < cdf[row, token] + slack, (row, token)


@pytest.mark.parametrize(
    "vocab, block_size",
    [(50, 1024), (50, 7), (56, 7), (1000, 64)],
    ids=["one level", "two levels with a tail", "two levels without tail", "many blocks"],
)
def test_inverse_cdf_matches_the_float64_reference(vocab, block_size):
    generator = torch.Generator().manual_seed(vocab + block_size)
    weights = torch.softmax(torch.randn(400, vocab, generator=generator) * 3, dim=-1)
    weights[:, ::5] = 0.0  # zero-weight tokens, including the first
    uniforms = _uniforms(400, seed=vocab)
    uniforms[:2] = torch.tensor([0.0, 1.0 - 2.0**-53])  # the ends of [0, 1)
    tokens = inverse_cdf_sample(weights, uniforms, block_size=block_size)
    _check_inverse_cdf(weights, uniforms, tokens)


def test_inverse_cdf_at_qwen3_vocabulary():
    """150k entries of ~7e-6 each, 149 blocks: each token brackets its target to within 1.5% of
    one token's probability."""
    generator = torch.Generator().manual_seed(7)
    weights = torch.softmax(torch.randn(16, 151_936, generator=generator), dim=-1)
    uniforms = _uniforms(16, seed=8)
    _check_inverse_cdf(weights, uniforms, inverse_cdf_sample(weights, uniforms))


def test_samples_follow_the_truncated_distribution():
    draws = 5000
    log_probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(draws, 4)
    tokens = sample_tokens(
        log_probs,
        torch.ones(draws),
        torch.full((draws,), 0.7),
        torch.full((draws,), -1),
        _uniforms(draws, seed=0),
    )
    counts = np.bincount(tokens.numpy(), minlength=4)
    # top_p = 0.7 keeps {0, 1} (mass before token 2 is 0.8 > 0.7); renormalised 0.625 / 0.375.
    assert counts[2] == counts[3] == 0
    # 4.4 standard deviations of a proportion over 5000 draws.
    np.testing.assert_allclose(counts[:2] / draws, [0.625, 0.375], atol=0.03)


def test_rows_depend_only_on_their_own_log_probs_and_uniform():
    log_probs = torch.log_softmax(
        torch.randn(5, 30, generator=torch.Generator().manual_seed(3)), -1
    )
    temperatures = torch.tensor([1.0, 0.0, 1.0, 0.7, 1.0])
    top_p, top_k = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0]), torch.tensor([-1, -1, -1, 5, -1])
    uniforms = _uniforms(5, seed=4)
    excluded = (torch.tensor([0, 1, 3]), torch.tensor([2, 2, 7]))
    together = sample_tokens(log_probs, temperatures, top_p, top_k, uniforms, excluded)
    for row in range(5):
        mine = excluded[0] == row
        alone = sample_tokens(
            log_probs[row : row + 1],
            temperatures[row : row + 1],
            top_p[row : row + 1],
            top_k[row : row + 1],
            uniforms[row : row + 1],
            (torch.zeros(int(mine.sum()), dtype=torch.long), excluded[1][mine]),
        )
        assert int(alone) == int(together[row]), row


def test_greedy_rows_take_argmax_of_the_allowed_tokens():
    log_probs = torch.log_softmax(
        torch.randn(2, 10, generator=torch.Generator().manual_seed(4)), -1
    )
    greedy = torch.zeros(2)
    top_p, top_k = torch.ones(2), torch.full((2,), -1)
    tokens = sample_tokens(log_probs, greedy, top_p, top_k, _uniforms(2, seed=1))
    assert tokens.tolist() == log_probs.argmax(-1).tolist()
    best = log_probs.argmax(-1)
    held = sample_tokens(
        log_probs, greedy, top_p, top_k, _uniforms(2, seed=2), (torch.tensor([1]), best[1:])
    )
    second = log_probs[1].clone()
    second[best[1]] = float("-inf")
    assert held.tolist() == [int(best[0]), int(second.argmax())]


def test_excluded_tokens_are_removed_before_top_p():
    draws = 6000
    # Excluding token 0 leaves 0.4 / 0.3 / 0.2 / 0.1 of the rest -> 0.4, 0.3, 0.2, 0.1.
    log_probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]).log().expand(draws, 5)
    rows = torch.arange(draws)
    excluded = (rows, torch.zeros(draws, dtype=torch.long))
    uniforms = _uniforms(draws, seed=5)
    temperatures, top_p, top_k = _no_truncation(draws)
    free = sample_tokens(log_probs, temperatures, top_p, top_k, uniforms, excluded)
    counts = np.bincount(free.numpy(), minlength=5) / draws
    assert counts[0] == 0
    np.testing.assert_allclose(counts[1:], [0.4, 0.3, 0.2, 0.1], atol=0.03)
    # Top-p ranks the renormalised rest: mass before token 3 is 0.7 <= 0.75 keeps it, token 4
    # (mass before 0.9) goes: 0.4, 0.3, 0.2 renormalised by 0.9. Ranked without renormalising
    # (mass before token 4: 0.45), token 4 would stay.
    truncated = sample_tokens(
        log_probs, temperatures, torch.full((draws,), 0.75), top_k, uniforms, excluded
    )
    counts = np.bincount(truncated.numpy(), minlength=5) / draws
    assert counts[0] == counts[4] == 0
    np.testing.assert_allclose(counts[1:4], np.array([0.4, 0.3, 0.2]) / 0.9, atol=0.03)


def test_excluding_a_dominant_token_samples_the_underflowed_rest():
    """The stop token holds all the float32 mass (the others underflow exp to 0): excluded,
    the row samples softmax of the remaining logits, not token 0 of an all-zero row."""
    draws = 3000
    logits = torch.tensor([[0.0, 1.0, 2.0, 200.0]]).expand(draws, 4)
    log_probs = torch.log_softmax(logits, dim=-1)
    assert log_probs[0, :3].exp().max() == 0
    excluded = (torch.arange(draws), torch.full((draws,), 3))
    tokens = sample_tokens(log_probs, *_no_truncation(draws), _uniforms(draws, seed=6), excluded)
    counts = np.bincount(tokens.numpy(), minlength=4) / draws
    expected = torch.softmax(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64), -1).numpy()
    assert counts[3] == 0
    np.testing.assert_allclose(counts[:3], expected, atol=0.03)


def test_excluding_every_token_is_an_error():
    log_probs = torch.log_softmax(torch.randn(2, 3, generator=torch.Generator().manual_seed(0)), -1)
    everything = (torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="min_new_tokens"):
        sample_tokens(log_probs, *_no_truncation(2), _uniforms(2, seed=0), everything)
    with pytest.raises(ValueError, match="min_new_tokens"):
        sample_tokens(
            log_probs,
            torch.zeros(2),
            torch.ones(2),
            torch.full((2,), -1),
            _uniforms(2, 0),
            everything,
        )


def test_uniform_streams_follow_each_seed_whatever_the_chunk_and_batch():
    seeds = [11, None, 13, 14]
    expected = {
        seed: torch.rand(10, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        for seed in seeds
        if seed is not None
    }
    for chunk in (1, 3, 64):
        streams = UniformStreams(seeds, chunk=chunk)
        draws = [streams.next() for _ in range(4)]
        streams.keep([3, 0])  # rows 1 and 2 leave; the survivors go on with their own streams
        draws += [streams.next() for _ in range(6)]
        for step, draw in enumerate(draws):
            if step < 4:
                assert float(draw[1]) == 0.0  # greedy rows draw nothing
                assert float(draw[2]) == float(expected[13][step])
                row_of = {11: 0, 14: 3}
            else:
                row_of = {11: 1, 14: 0}
            for seed, row in row_of.items():
                assert float(draw[row]) == float(expected[seed][step]), (chunk, step, seed)


def test_no_two_turns_of_a_group_share_a_seed():
    """Turn ``k`` of sample ``j`` samples with ``derive_turn_seed(derive_seed(s, j), k)``: its
    first turn keeps the sample's seed (one completion's), and the later turns draw from seeds of
    their own (``derive_seed`` for the turns too would give turn ``k`` of sample 0 the seed of
    turn 0 of sample ``k``)."""
    from megatron_gspo.rollout import derive_seed, derive_turn_seed

    seeds = [derive_turn_seed(derive_seed(1234, j), k) for j in range(16) for k in range(8)]
    assert len(set(seeds)) == len(seeds)
    assert all(derive_turn_seed(derive_seed(1234, j), 0) == derive_seed(1234, j) for j in range(16))
    assert all(0 <= seed < 2**63 for seed in seeds)
