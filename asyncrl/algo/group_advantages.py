"""Where each advantage estimator runs, and the rollout-stage estimators on one group, in numpy.

The rollout workers compute grpo / drgrpo / rloo advantages one group at a time and import only
this module: it needs numpy, not torch (`advantages.py`, the torch estimators, imports it in
turn). A worker process that never imports torch starts about 2 s of CPU sooner and holds
~300 MB less (measured: `import torch` is 1.9 s of a rollout worker's start-up).

Stages (`ESTIMATOR_STAGES`; its keys are exactly `advantages.ADV_ESTIMATORS`', a test holds it):

- ``rollout`` (grpo, drgrpo, rloo): within one group: the rollout worker computes them.
- ``batch`` (reinforce_plus_plus, reinforce_plus_plus_baseline): they whiten over every valid
  token of the trained batch: the learner computes them, once per batch, before mini-batching.
- ``critic`` (gae): the learner, with its critic's values of the trained batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AdvantageParams:
    gamma: float = 1.0
    lam: float = 1.0
    epsilon: float = 1e-6  # GRPO: std + epsilon in the denominator
    norm_adv_by_std_in_grpo: bool = True  # False = Dr.GRPO
    whiten_gae: bool = True  # verl whitens GAE advantages over the batch


#: Where the loop computes each estimator (see the module docstring).
ESTIMATOR_STAGES: dict[str, str] = {
    **dict.fromkeys(("grpo", "drgrpo", "rloo"), "rollout"),
    **dict.fromkeys(("reinforce_plus_plus", "reinforce_plus_plus_baseline"), "batch"),
    "gae": "critic",
}


def estimator_stage(adv_estimator: str) -> str:
    """``rollout``, ``batch`` or ``critic``: where the loop computes `adv_estimator`; the one
    error for an unknown name."""
    try:
        return ESTIMATOR_STAGES[adv_estimator]
    except KeyError:
        valid = ", ".join(sorted(ESTIMATOR_STAGES))
        raise ValueError(f"unknown adv_estimator {adv_estimator!r}; valid: {valid}") from None


def one_group_advantages(
    adv_estimator: str, scores: np.ndarray, params: AdvantageParams | None = None
) -> np.ndarray:
    """A rollout-stage estimator (grpo, drgrpo, rloo) on ONE group's n scores, in numpy:
    each response's advantage, as `advantages.compute_advantages` gives it in float64, rounded
    to float32 (tests/test_advantages.py). The rollout worker computes one group
    at a time; torch's per-op dispatch cost ~0.6 ms for a group of 8 there, on the cores the
    engine and learner share, while these few numpy operations cost microseconds."""
    if estimator_stage(adv_estimator) != "rollout":
        raise ValueError(f"adv_estimator {adv_estimator!r} is not computed within one group")
    p = params or AdvantageParams()
    # float64 throughout (as the learner's batch estimators), float32 out: a few operations on
    # n values, so the wider type costs nothing and the result is the float64 one, rounded.
    r = np.asarray(scores, dtype=np.float64).reshape(-1)
    n = r.size
    # group_stats: a singleton's baseline is 0 and its std 1
    mean = r.mean() if n > 1 else 0.0
    if adv_estimator == "rloo":
        adv = n / (n - 1) * (r - mean) if n > 1 else r
    else:
        adv = r - mean
        if adv_estimator == "grpo" and p.norm_adv_by_std_in_grpo:
            adv = adv / ((r.std(ddof=1) if n > 1 else 1.0) + p.epsilon)
    return adv.astype(np.float32)
