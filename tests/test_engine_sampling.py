"""The hf engine's batch sampler (`engine/hf/batch.py:sample`): per-row parameters in batch ops.

Checked against the definitions: the support after top-k / top-p / min-p (closed form on
hand-made logits), the sampled frequencies against the filtered softmax (chi-square), greedy is
argmax, a row's draw does not depend on its batch mates, logprobs are the unfiltered
temperature-scaled log-softmax, a broken row fails alone.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncrl.engine.hf.batch import SamplingParams, Seq, sample


def seq(seed: int | None = 0, **params: float) -> Seq:
    gen = random.Random(seed) if seed is not None else None
    p = SamplingParams.from_json({"max_new_tokens": 4, **params})
    return Seq(rid="r", prompt=[1], params=p, on_done=lambda s: None, generator=gen)


LOGITS = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))


def support(params: dict, draws: int = 400) -> set[int]:
    seqs = [seq(seed=i, **params) for i in range(draws)]
    tokens, _, _ = sample(LOGITS.expand(draws, -1).clone(), seqs)
    return set(tokens)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, {0, 1, 2, 3, 4}),
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.65}, {0, 1}),  # 0.4 < 0.65: the token crossing 0.65 (0.3) stays
        ({"top_p": 0.7}, {0, 1}),  # cumulative 0.7 before token 2: it goes
        ({"top_p": 1e-9}, {0}),
        ({"min_p": 0.3}, {0, 1, 2}),  # >= 0.3 x 0.4 = 0.12
        ({"top_k": 3, "top_p": 0.6}, {0, 1}),  # renormalised: 0.4/0.85 < 0.6 -> token 1 stays
        ({"min_p": 1.0}, {0}),
    ],
)
def test_the_support_after_the_filters_is_the_closed_form_one(params, expected):
    assert support(params) == expected


def test_frequencies_follow_the_filtered_softmax():
    draws = 6000
    seqs = [seq(seed=i, temperature=0.7, top_k=4) for i in range(draws)]
    tokens, _, _ = sample(LOGITS.expand(draws, -1).clone(), seqs)
    p = torch.softmax(LOGITS[:4] / 0.7, -1)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double()
    assert counts[4] == 0
    expected = p.double() * draws
    chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(3))
    seqs = [seq(temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(6)]
    tokens, _, _ = sample(logits, seqs)
    for i in range(1, 6, 2):
        assert tokens[i] == int(logits[i].argmax())


def test_a_rows_draw_does_not_depend_on_its_batch_mates():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 50, generator=gen)
    alone = [sample(logits[i : i + 1], [seq(seed=100 + i, top_p=0.9)])[0][0] for i in range(8)]
    together = sample(logits, [seq(seed=100 + i, top_p=0.9) for i in range(8)])[0]
    assert together == alone


def test_logprobs_are_the_unfiltered_scaled_log_softmax():
    seqs = [seq(seed=i, temperature=0.5, top_k=2) for i in range(4)]
    tokens, lps, _ = sample(LOGITS.expand(4, -1).clone(), seqs)
    ref = torch.log_softmax(LOGITS / 0.5, -1)
    for t, lp in zip(tokens, lps, strict=True):
        assert math.isclose(lp, float(ref[t]), rel_tol=1e-6)


def test_a_broken_row_fails_alone():
    logits = torch.randn(3, 7)
    logits[1, 2] = float("nan")
    tokens, lps, errors = sample(logits, [seq(seed=i) for i in range(3)])
    assert errors[0] is None and errors[2] is None
    assert "non-finite" in errors[1]
    assert all(math.isfinite(x) for i, x in enumerate(lps) if i != 1)


def test_a_draw_never_lands_on_a_token_the_filters_removed():
    # u close to 1 (the top of the CDF) must still land on a surviving token
    logits = torch.tensor([[5.0, 4.0, -50.0, -60.0]]).expand(2000, -1).clone()
    tokens, _, _ = sample(logits, [seq(seed=i, top_k=2) for i in range(2000)])
    assert set(tokens) <= {0, 1}
