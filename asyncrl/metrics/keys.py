"""Metric-key conventions shared by the training loop and the metrics package.

The loop calls `MetricsLogger.log(step, metrics)` once per optimizer step with a flat
`{name: number}` dict. These are the names the console view, the plots and the summary read;
any other key is still written to every sink (JSONL, TensorBoard, W&B). A key that never
appears is shown as "-" and gets no plot.

Per-step values (what happened at this step):
  `version`, `rollout/reward_mean`, `eval/accuracy` (a fraction in [0, 1], only on eval steps),
  `replay/depth`, `throughput/tokens_per_s`, `learner/idle_frac` (a fraction in [0, 1]),
  `sync/seconds`, `mismatch/mismatch_kl`, `mismatch/rollout_is_eff_sample_size`,
  `replay/staleness_mean`, `replay/staleness_max`, `is/ess_by_lag/<k>` (normalised ESS of the
  rollout IS weights of the sequences k versions stale), `is/units_by_lag/<k>` (the tokens
  or sequences it is over), `is/kl_by_lag/<k>` (their mean per-token k3 KL between the
  policy that generated them and the learner's) and `is/seq_ess_by_lag/<k>` over
  `is/seq_units_by_lag/<k>` rows (the normalised ESS of their untruncated sequence ratios).

Staleness histogram, two accepted forms (the first wins when both appear in a run):
  `replay/staleness_hist/<k>`: groups trained *at this step* with staleness k (per-step counts;
      the logger sums them over the run). `log(..., staleness_hist={k: n})` is the same thing.
  `replay/lag_taken/<k>`: groups trained *so far* with staleness k (cumulative, as
      `ReplayQueue.metrics()` reports it under the `replay/` prefix); the latest value counts.

Cumulative counters (latest value counts, as `ReplayQueue.metrics()` reports them):
  `replay/taken` (groups trained), `replay/evicted` (groups dropped as too stale),
  `replay/over_bound` (groups trained staler than max_staleness: stale policies wait, correct),
  `replay/generated_length_mean`, `replay/trained_length_mean` and `replay/length_ratio`
  (trained ÷ generated mean response length: 1.0 = no length bias from staleness).

Evaluation (`eval/*`) runs off the training loop; it lands in the row of the step whose
weights it measured, that row being written once it lands (`metrics/deferred.py`).
Held-out episodes (env runs, `rollout/evaluation.py`) are played greedily (temperature 0) and
sampled (the run's sampling settings): `eval/greedy/<name>` and `eval/sampled/<name>`, the
names those of the training episodes' `env/*` rates: `solved_frac` (success rate: episodes
whose env reported `solved`), `return_mean`, `invalid_action_frac` (per model turn),
`turns_mean`, `episodes_failed` (env errors, left out of the others); `eval/accuracy` is then
the greedy success rate, so the console, plots and summary show it as for single-turn runs.
"""

from __future__ import annotations

VERSION = "version"
REWARD = "rollout/reward_mean"
ACCURACY = "eval/accuracy"
DEPTH = "replay/depth"
TOKENS_PER_S = "throughput/tokens_per_s"
IDLE_FRAC = "learner/idle_frac"
SYNC_SECONDS = "sync/seconds"
MISMATCH_KL = "mismatch/mismatch_kl"
ESS = "mismatch/rollout_is_eff_sample_size"
STALENESS_MEAN = "replay/staleness_mean"
STALENESS_MAX = "replay/staleness_max"
STALENESS_HIST = "replay/staleness_hist/"
LAG_TAKEN = "replay/lag_taken/"
TAKEN = "replay/taken"
EVICTED = "replay/evicted"
LENGTH_RATIO = "replay/length_ratio"
OVER_BOUND = "replay/over_bound"
EVAL_GREEDY = "eval/greedy/"
EVAL_SAMPLED = "eval/sampled/"

#: Series the logger keeps in memory for plots and the summary (everything else is only
#: written to the sinks and remembered as its latest value).
SERIES = (REWARD, ACCURACY, TOKENS_PER_S, IDLE_FRAC, SYNC_SECONDS, MISMATCH_KL)

#: Keys the JSONL row reserves for itself; a metric may not use them.
RESERVED = ("step", "time", "timestamp")


def hist_bin(key: str, prefix: str) -> int | None:
    """The staleness k of `<prefix><k>`, or None when `key` is not such a key."""
    if not key.startswith(prefix):
        return None
    tail = key[len(prefix) :]
    return int(tail) if tail.isdigit() else None
