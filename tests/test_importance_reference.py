"""The vectorised rollout IS metrics and rejection sampling against naive references.

`asyncrl.algo.mismatch_metrics` compacts the valid tokens once, weights per-sequence values by
their token counts and shares intermediates between metrics. Here every `mismatch/` metric and
every `rejection/` result is recomputed from its definition, one sequence at a time in python
floats (`math.fsum`), on random padded batches with garbage under the mask, empty rows and
non-contiguous inputs. Only the per-token float32 quantities the library defines in float32
(the log ratio, the per-sequence log-weight, the bounded weight) come from torch, so that a
token lying within float32 rounding of a bound cannot flip a fraction.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo.importance import RolloutIS, compute_rollout_importance_weights
from asyncrl.algo.mismatch_metrics import Sample, quantiles, sample_quantiles
from asyncrl.algo.rejection import rejection_mask

LEVELS = ("token", "sequence", "geometric")
PERCENTILES = {"p25": 0.25, "p50": 0.5, "p75": 0.75, "p95": 0.95, "p99": 0.99}


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (old, rollout, mask): ragged rows, some empty, nan/inf under the mask."""
    g = torch.Generator().manual_seed(seed)
    batch, seq = (
        int(torch.randint(2, 9, (1,), generator=g)),
        int(torch.randint(1, 17, (1,), generator=g)),
    )
    scale = (0.05, 0.2, 1.0, 30.0)[seed % 4]  # 30: log-weights beyond the ±20 safety clamp
    rollout = -torch.empty(batch, seq).exponential_(1.0, generator=g)
    old = rollout + scale * torch.randn(batch, seq, generator=g)
    old[torch.rand(batch, seq, generator=g) < 0.03] -= 12.0  # catastrophic tokens
    mask = torch.rand(batch, seq, generator=g) < 0.7
    mask[torch.rand(batch, generator=g) < 0.2] = False  # empty rows
    mask[-1, :-1] = False  # a row of at most one token
    if seed == 0:
        mask[:] = False  # nothing valid at all: neutral values
    old = torch.where(mask, old, torch.tensor(float("nan")))
    rollout = torch.where(mask, rollout, torch.tensor(float("inf")))
    if seed % 3 == 1:  # non-contiguous inputs (the transpose of a [seq, batch] layout)
        old, rollout, mask = (t.t().contiguous().t() for t in (old, rollout, mask))
    return old, rollout, mask.float() if seed % 2 else mask


def _mean(xs: list[float], empty: float = 0.0) -> float:
    return math.fsum(xs) / len(xs) if xs else empty


def _std(xs: list[float], ddof: int = 0) -> float:
    """Population std (ddof 0) or, with ddof 1, the unbiased one (verl's seq std); 0 when
    there are no more values than ddof."""
    if len(xs) <= ddof:
        return 0.0
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - ddof))


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 1.0
    s, pos = sorted(xs), q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _rows(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, level: str
) -> list[tuple[list[float], ...]]:
    """Per non-empty row: (log-weights, weights, float32 lr, old, rollout) as python floats."""
    valid = mask.bool()
    lr = torch.where(valid, old.float() - rollout.float(), 0.0)  # float32, as the library
    if level == "token":
        log_w = lr
    else:
        log_w = lr.sum(-1, keepdim=True)
        if level == "geometric":
            log_w = log_w / valid.sum(-1, keepdim=True).clamp(min=1)
        log_w = log_w.expand_as(lr)
    raw = torch.exp(log_w.clamp(-20.0, 20.0))
    rows = []
    for i in range(valid.shape[0]):
        v = valid[i]
        if v.any():
            pick = [t[i][v].tolist() for t in (log_w, raw, lr, old.double(), rollout.double())]
            rows.append(tuple(pick))
    return rows


def _weight_metrics(rows: list, upper: float, lower: float) -> dict[str, float]:
    w = [x for r in rows for x in r[1]]
    lw = [x for r in rows for x in r[0]]
    wc = [min(max(x, lower), upper) for x in w]
    mc = _mean(wc, 1.0)
    out = {
        "rollout_is_mean": _mean(w, 1.0),
        "rollout_is_std": _std(w),
        "rollout_is_max": max(w, default=1.0),
        "rollout_is_min": min(w, default=1.0),
        "rollout_is_eff_sample_size": 1.0 / _mean([(x / mc) ** 2 for x in wc], 1.0),
        "rollout_is_ratio_fraction_high": _mean([float(x > math.log(upper)) for x in lw]),
        "rollout_is_ratio_fraction_low": _mean([float(x < math.log(lower)) for x in lw]),
    }
    for name, q in PERCENTILES.items():
        out[f"rollout_is_{name}"] = _quantile(w, q)
    seq_w = [_mean(r[1]) for r in rows]
    out.update(
        rollout_is_seq_mean=_mean(seq_w, 1.0),
        rollout_is_seq_std=_std(seq_w, ddof=1),
        rollout_is_seq_max=max(seq_w, default=1.0),
        rollout_is_seq_min=min(seq_w, default=1.0),
        rollout_is_seq_max_deviation=max((abs(x - 1.0) for x in seq_w), default=0.0),
        rollout_is_seq_fraction_high=_mean([float(x > upper) for x in seq_w]),
        rollout_is_seq_fraction_low=_mean([float(x < lower) for x in seq_w]),
    )
    return out


def _mode_and_veto_metrics(
    rows: list, mode: str, upper: float, lower: float, veto: float | None
) -> dict[str, float]:
    w = [x for r in rows for x in r[1]]
    changed = [x > upper if mode == "truncate" else not lower <= x <= upper for x in w]
    fraction = _mean([float(c) for c in changed])
    log_veto = -math.inf if veto is None else math.log(veto)
    caught = [[x < log_veto for x in r[2]] for r in rows]
    return {
        "rollout_is_truncated_fraction": fraction if mode == "truncate" else 0.0,
        "rollout_is_clipped_fraction": fraction if mode == "clip" else 0.0,
        "rollout_is_veto_fraction": _mean([float(any(c)) for c in caught]),
        "rollout_is_catastrophic_token_fraction": _mean([float(x) for c in caught for x in c]),
    }


def _mismatch_metrics(rows: list) -> dict[str, float]:
    def bexp(x: float) -> float:
        return math.exp(min(x, 50.0))

    lr = [o - r for row in rows for o, r in zip(row[3], row[4])]
    lr_hi = [min(x, 50.0) for x in lr]
    nlp_old = [-_mean(r[3]) for r in rows]
    nlp_roll = [-_mean(r[4]) for r in rows]
    diff = [a - b for a, b in zip(nlp_old, nlp_roll)]
    return {
        "mismatch_kl": _mean([-x for x in lr]),
        "mismatch_k3_kl": _mean([math.exp(x) - x - 1.0 for x in lr_hi]),
        "mismatch_training_ppl": _mean([bexp(x) for x in nlp_old], 1.0),
        "mismatch_training_log_ppl": _mean(nlp_old),
        "mismatch_rollout_ppl": _mean([bexp(x) for x in nlp_roll], 1.0),
        "mismatch_rollout_log_ppl": _mean(nlp_roll),
        "mismatch_ppl_ratio": _mean([bexp(x) for x in diff], 1.0),
        "mismatch_log_ppl_diff": _mean(diff),
        "mismatch_log_ppl_abs_diff": _mean([abs(x) for x in diff]),
        "mismatch_log_ppl_diff_max": max(diff, default=0.0),
        "mismatch_log_ppl_diff_min": min(diff, default=0.0),
    }


@pytest.mark.parametrize("veto", [None, 1e-2])
@pytest.mark.parametrize(("upper", "lower"), [(2.0, None), (4.0, 0.125)])
@pytest.mark.parametrize("mode", ["truncate", "clip"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("seed", range(10))
def test_metrics_match_naive_reference(seed, level, mode, upper, lower, veto):
    old, rollout, mask = _batch(seed)
    settings = RolloutIS(
        level=level, mode=mode, threshold=upper, threshold_lower=lower, veto_threshold=veto
    )
    _, got = compute_rollout_importance_weights(old, rollout, mask, settings)
    lower = 1.0 / upper if lower is None else lower
    rows = _rows(old, rollout, mask, level)
    expected = {
        **_weight_metrics(rows, upper, lower),
        **_mode_and_veto_metrics(rows, mode, upper, lower, veto),
        **_mismatch_metrics(rows),
    }
    assert set(got) == {f"mismatch/{k}" for k in expected}
    for name, value in expected.items():
        # percentiles interpolate in the weights' float32, everything else sums in float64
        rel = 1e-6 if name.removeprefix("rollout_is_") in PERCENTILES else 1e-9
        assert got[f"mismatch/{name}"] == pytest.approx(value, rel=rel, abs=1e-12), name


def _divergence(lr: float, kind: str) -> float:
    return {"k1": -lr, "k2": 0.5 * lr * lr, "k3": math.expm1(lr) - lr}[kind]


def _naive_rejection(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, criteria: list
) -> tuple[list[list[bool]], dict[str, float]]:
    """Keep flags per token and the per-criterion fractions, one row at a time."""
    valid = mask.bool()
    lr = torch.where(valid, old.float() - rollout.float(), 0.0).clamp(-20.0, 20.0)
    keep = valid.tolist()
    fractions = {}
    for name, lower, upper in criteria:
        scope, kind = name.rsplit("_", 1)

        def out(x: float, lower=lower, upper=upper) -> bool:
            return (lower is not None and x < lower) or (upper is not None and x > upper)

        hits, total = 0, 0
        for i in range(valid.shape[0]):
            ks = [_divergence(x, kind) for x in lr[i][valid[i]].tolist()]
            if not ks:
                continue
            if scope == "token":
                flags = [out(k) for k in ks]
            else:
                agg = {"seq_sum": math.fsum, "seq_max": max}.get(scope, _mean)
                flags = [out(agg(ks))] * len(ks)
            hits, total = (
                hits + (sum(flags) if scope == "token" else flags[0]),
                total + (len(ks) if scope == "token" else 1),
            )
            cols = [j for j, v in enumerate(valid[i].tolist()) if v]
            for j, f in zip(cols, flags):
                keep[i][j] = keep[i][j] and not f
        fractions[f"{name}_fraction"] = hits / total if total else 0.0
    return keep, fractions


RS_CRITERIA = [
    ("token_k1", -0.3, 0.3),
    ("token_k2", 0.001, 0.5),
    ("token_k3", None, 0.5),
    ("seq_sum_k1", -1.0, 1.0),
    ("seq_sum_k2", None, 1.0),
    ("seq_sum_k3", 0.01, 2.0),
    ("seq_mean_k1", -0.1, 0.1),
    ("seq_mean_k2", None, 0.1),
    ("seq_mean_k3", 0.001, 0.2),
    ("seq_max_k2", None, 0.5),
    ("seq_max_k3", 0.001, 1.0),
]


@pytest.mark.parametrize("which", [*range(len(RS_CRITERIA)), "all"])
@pytest.mark.parametrize("seed", range(10))
def test_rejection_matches_naive_reference(seed, which):
    old, rollout, mask = _batch(seed)
    crits = RS_CRITERIA if which == "all" else [RS_CRITERIA[which]]
    new_mask, got = rejection_mask(old, rollout, mask, crits)
    keep, fractions = _naive_rejection(old, rollout, mask, crits)
    assert new_mask.dtype == mask.dtype
    assert new_mask.bool().tolist() == keep
    for name, value in fractions.items():
        assert got[f"rejection/{name}"] == pytest.approx(value, abs=1e-12), name
    valid = mask.bool()
    n_valid, n_rows = int(valid.sum()), int(valid.any(-1).sum())
    kept_rows = sum(any(r) for r in keep)
    removed = n_valid - sum(map(sum, keep))
    assert got["rejection/masked_token_fraction"] == pytest.approx(removed / max(n_valid, 1))
    assert got["rejection/masked_seq_fraction"] == pytest.approx(
        (n_rows - kept_rows) / max(n_rows, 1)
    )


def test_positive_fast_sort_and_counted_quantiles_are_exact():
    g = torch.Generator().manual_seed(3)
    values = torch.exp(torch.randn(1001, generator=g)).round(decimals=1)  # float32, with ties
    qs = list(PERCENTILES.values())
    assert torch.equal(quantiles(values, qs, 1.0, positive=True), quantiles(values, qs, 1.0))
    # a NaN of either sign sorts last, as the float sort puts it
    nan = torch.tensor([float("nan"), -float("nan")])
    with_nan = torch.cat([values[:97], nan]).flip(0)
    torch.testing.assert_close(
        quantiles(with_nan, qs, 1.0, positive=True), quantiles(with_nan, qs, 1.0), equal_nan=True
    )
    torch.testing.assert_close(
        quantiles(values, qs, 1.0, positive=True), torch.quantile(values, torch.tensor(qs))
    )
    # one value per row standing for `counts` tokens == the quantiles of the expanded tokens
    counts = torch.randint(0, 5, (values.numel(),), generator=g)
    expanded = values.repeat_interleave(counts)
    counted = Sample(values, counts.to(torch.float64), expanded.numel())
    assert torch.equal(sample_quantiles(counted, qs, 1.0), quantiles(expanded, qs, 1.0))
