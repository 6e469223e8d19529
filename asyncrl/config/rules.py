"""The names and ranges a config is checked against, and the one-line range checks.

Kept apart from `validate.py` so the check modules share them without importing each other;
`validate.py` re-exports the name tables (tests compare them with the algorithm registries).
"""

from __future__ import annotations

from asyncrl.config.schema import ConfigError

# Names accepted by the algorithm registries (asyncrl.algo); a test keeps these lists equal to
# the registries so the config can be validated without importing torch.
LOSS_MODES = ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "decoupled")
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
ADV_ESTIMATORS = (
    "grpo",
    "drgrpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "gae",
)
RS_CRITERIA = tuple(
    [f"token_k{k}" for k in (1, 2, 3)]
    + [f"seq_sum_k{k}" for k in (1, 2, 3)]
    + [f"seq_mean_k{k}" for k in (1, 2, 3)]
    + ["seq_max_k2", "seq_max_k3"]
)
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
# Estimators an env run computes in the rollout worker (asyncrl.algo.episode keeps them equal);
# the batch-level ones (the learner's) work on episode returns in trajectory mode.
EPISODE_ESTIMATORS = ("grpo", "drgrpo", "rloo")
EPISODE_BATCH_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")

PORT_MAX = 65535
# Most devices one worker section may list, and the bound of a device id: far above any real
# cluster, low enough that a typo like list(range(0, 10**9)) fails before it allocates.
MAX_DEVICES = 65536
INT64 = 2**63
# SGLang's rule (SamplingParams: `_SAMPLING_EPS = 1e-6`): a temperature in [0, 1e-6) samples
# greedily. A positive temperature below it is refused rather than silently made greedy: the
# learner divides its logits by the configured value, and by 1e-40 they overflow to inf.
MIN_TEMPERATURE = 1e-6
RESUME_MODES = ("never", "auto")

# Strategy names per role; removed backends map to the error that names their replacement.
STRATEGIES = {
    "actor_train": ("fsdp2_train", "megatron_train"),
    "critic": ("fsdp2_train", "megatron_train"),
    "actor_infer": ("sglang", "hf_infer"),
    "reference": ("fsdp2_train", "megatron_infer", "hf_infer"),
}
REPLACED_STRATEGIES = {
    "deepspeed_train": "fsdp2_train (the plain-PyTorch learner takes DeepSpeed's place)",
    "deepspeed_infer": "fsdp2_train or megatron_infer",
    "vllm": "sglang (or hf_infer on a CPU box)",
}
# actor_train strategies whose learner calls `asyncrl.learner.compile.maybe_compile` on its
# model: `actor.use_torch_compile: true` is refused for any other (never accepted unread).
TORCH_COMPILE_STRATEGIES: tuple[str, ...] = ("fsdp2_train",)


def positive(path: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def within(path: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{path} must be in [{low:g}, {high:g}], got {value}")


def port(path: str, value: int) -> None:
    if not 0 <= value <= PORT_MAX:
        raise ConfigError(
            f"{path} must be a TCP port 0..{PORT_MAX} (0 picks a free one), got {value}"
        )


def one_of(path: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(allowed)}")


def check_threads(learner: int | str, engine: int | str) -> None:
    """`threads.learner` / `threads.engine`: auto, or 1 .. the usable cores of this machine
    (more threads than cores in one process only slows it down)."""
    from asyncrl.threads import ThreadBudgetError, plan_threads, usable_cores

    try:
        plan_threads(usable_cores(), 1, 1, learner, engine)
    except ThreadBudgetError as e:
        raise ConfigError(str(e)) from None
