"""The algorithm and actor sections of the configuration schema (verl's `algorithm.*` and its
actor config), re-exported by `asyncrl.config.schema`. Every field carries a docstring (the
string literal after it); `tests/test_config.py` checks both modules. No torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


# ---------------------------------------------------------------------------------------------
# Algorithm (verl's `algorithm.*`) and actor loss (verl's actor config)
# ---------------------------------------------------------------------------------------------
@dataclass
class RejectionCriterion:
    name: str = "token_k1"
    """token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3."""
    lower: float | None = None
    """Reject below this value (null: no lower bound)."""
    upper: float | None = None
    """Reject above this value (null: no upper bound)."""


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """verl's kl_ctrl: fixed keeps kl_coef; adaptive multiplies it after every batch by
    1 + clip(kl / target_kl - 1, -0.2, 0.2) · sequences / horizon (Ziegler et al.)."""
    kl_coef: float = 0.001
    """Initial (fixed: constant) coefficient beta of the KL penalty in the reward (>= 0)."""
    target_kl: float = 0.1
    """Adaptive: the per-token KL the coefficient steers towards (> 0)."""
    horizon: int = 10000
    """Adaptive: sequences over which the coefficient adapts (> 0)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """grpo | drgrpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | gae."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group std; false is Dr.GRPO."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    correction_mode: Literal["decoupled", "bypass"] = "decoupled"
    """decoupled: the learner recomputes proximal logprobs; bypass: rollout logprobs are the
    old policy (no recompute, IS weights exactly 1)."""
    rollout_is_threshold: float | None = 2.0
    """Upper IS-weight bound; null disables rollout IS (weights and metrics) entirely."""
    rollout_is: bool = True
    """Apply the IS weights to the loss; false computes the mismatch metrics only."""
    rollout_is_threshold_lower: float | None = None
    """Lower bound (clip mode); null is 1 / rollout_is_threshold."""
    rollout_is_level: Literal["token", "sequence", "geometric"] = "token"
    """Ratio aggregation: per token, product over the sequence, or geometric mean."""
    rollout_is_mode: Literal["truncate", "clip"] = "truncate"
    """truncate caps at the upper bound; clip zeroes weights outside [lower, upper]."""
    rollout_is_veto_threshold: float | None = 1.0e-4
    """A token ratio below this zeroes its whole sequence; null disables the veto."""
    rollout_is_batch_normalize: bool = False
    """Rescale IS weights to batch mean 1 (newer verl design)."""
    rollout_rs: list[RejectionCriterion] = field(default_factory=list)
    """Rejection-sampling criteria, chained with AND into a new response mask."""
    filter_zero_variance_groups: bool = False
    """DAPO: drop groups whose rewards are all identical (no learning signal)."""
    overlong_buffer_len: int = 0
    """DAPO soft overlong punishment window (tokens before response_length); 0 disables."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong penalty at the maximum length."""
    use_kl_in_reward: bool = False
    """verl's KL-in-reward: every token's reward gets - beta · kl(old policy, reference) before
    the estimator (a batch or critic one: the rollout's group estimators never see it); the
    reference is the `reference` section's model, else the initial actor. fsdp2_train, one
    device."""
    kl_penalty: str = "kl"
    """The per-token KL estimator of use_kl_in_reward: kl (k1) | abs | mse (k2) | low_var_kl
    (k3)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """The coefficient beta of use_kl_in_reward (its state is checkpointed)."""
    cliprange_value: float = 0.5
    """verl's critic.cliprange_value: the value loss clips new values to old values ± this
    (> 0); read when a critic section is set."""
    critic_warmup: int = 0
    """verl's trainer.critic_warmup: the first N learner steps train the critic only (the
    actor's weights stay, its version still advances); needs a critic section."""


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """vanilla | gspo | gpg | clip_cov | kl_cov | geo_mean | cispo | decoupled."""
    clip_cov_ratio: float = 0.0002
    """Fraction of tokens clipped by clip-cov."""
    clip_cov_lb: float = 1.0
    """Lower covariance bound of clip-cov."""
    clip_cov_ub: float = 5.0
    """Upper covariance bound of clip-cov."""
    kl_cov_ratio: float = 0.0002
    """Fraction of tokens given the KL penalty by kl-cov."""
    ppo_kl_coef: float = 0.1
    """KL penalty coefficient of kl-cov."""


@dataclass
class CheckpointConfig:
    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """What a checkpoint holds: model, optimizer, extra (scheduler, RNG, data, queue), hf_model."""
    load_contents: list[str] | None = None
    """What resuming loads; null: save_contents plus the run state (extra). A list without
    `extra` resumes the learner only (step from the checkpoint; data position, queue and RNG
    afresh): the way to resume a checkpoint saved without extra."""
    save_interval: int = 0
    """Save every N steps (and at the end); 0 saves only at the end."""
    resume: str = "never"
    """never | auto (the newest complete checkpoint in output_dir; incomplete ones are skipped
    and named) | a checkpoint directory, which must exist when the config loads: a mistyped path
    fails validation instead of surfacing after the model is built. Resuming rolls the run's
    logs back to the checkpoint's step (what is cut goes to output_dir/.rolled-back-<time>/)."""
    async_save: bool = False
    """verl's key: write each checkpoint in a background thread from a snapshot taken at the
    save (tensors copied to CPU memory: up to the model + optimizer size more host memory), so
    the loop trains on meanwhile. One save at a time; the run waits for the last before it
    exits; a failed write raises at the next save or the end, leaving the previous checkpoint.
    megatron_train writes its model and optimizer shards at the save itself (Megatron's save
    runs collectives on the training groups, which must not interleave with a step's), the
    rest of the checkpoint in the background."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer (learning rate and weight decay: training_args, or verl's keys below)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    eps: float = 1.0e-8
    """Adam epsilon."""
    min_lr_ratio: float = 0.0
    """Floor of the decaying schedules, as a fraction of the peak."""
    lr: float | None = None
    """verl's peak learning rate of the actor: the same value as
    `actor_train.training_args.learning_rate`. The rule for every verl key here and its ROLL
    twin: neither given, ROLL's default; one given, it wins; both given with different values,
    a config error naming both (never a silent pick). null: not given."""
    weight_decay: float | None = None
    """verl's weight decay: `actor_train.training_args.weight_decay` (same rule); null: not
    given."""
    lr_warmup_steps: int | None = None
    """verl's warm-up in optimizer steps: `actor_train.training_args.warmup_steps` (same rule).
    null, 0 or negative: not given (verl then reads lr_warmup_steps_ratio)."""
    lr_warmup_steps_ratio: float | None = None
    """verl's warm-up as a fraction of total_training_steps, in [0, 1], read when
    lr_warmup_steps is not given: warmup_steps = int(ratio × total). null or 0: not given."""
    total_training_steps: int | None = None
    """verl's schedule horizon (the optimizer steps the decay spans; the actor's and the
    critic's schedules). null, 0 or negative: the run's optimizer steps (max_steps × optimizer
    steps per rollout), as verl fills it in at runtime."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] | None = None
    """verl's schedule after warm-up: `actor_train.training_args.lr_scheduler_type` (same
    rule); null: not given."""
    warmup_style: Literal["constant", "linear", "cosine"] | None = None
    """verl's deprecated name of lr_scheduler_type (one warning line; setting both is an
    error)."""
    clip_grad: float | None = None
    """verl's gradient-norm clip: `actor_train.training_args.max_grad_norm` (same rule); null:
    not given."""
    num_cycles: float | None = None
    """verl's cosine cycles: asyncrl's cosine decays over half a cycle (peak to floor), so only
    null or 0.5 is accepted."""


@dataclass
class ProfilerConfig:
    tool: Literal["torch", "nsys", "npu", "torch_memory"] | None = None
    """verl's profiler tool. torch: a torch.profiler trace of each chosen learner step, written
    as a Chrome trace (`step_<n>.json`, opens in Perfetto or TensorBoard). nsys, npu and
    torch_memory are refused (asyncrl does not drive them). null: no profiling."""
    enable: bool = False
    """Profile the actor's learner steps (verl: profile the actor role); needs tool and steps."""
    steps: list[int] = field(default_factory=list)
    """Learner steps to trace (1-based, as the metrics' `step`), e.g. [2]; required when
    enabled (verl keeps this list in global_profiler.steps)."""
    all_ranks: bool = False
    """verl: profile every rank. asyncrl traces the learner in the driver process (one rank):
    learners in Ray actors (more than one actor_train device, megatron_train) are refused."""
    ranks: list[int] = field(default_factory=list)
    """verl: the ranks profiled; [] or [0] (the driver's learner is rank 0)."""
    save_path: str | None = None
    """Directory of the traces; null: output_dir/profile."""
    tool_config: dict[str, Any] = field(default_factory=dict)
    """verl's per-tool settings. Only `torch.step_start`/`step_end` (mini-batches inside a
    step) would change a torch trace: values other than 0/null are refused (asyncrl traces
    whole steps); the other tools' blocks change nothing here."""


@dataclass
class ActorConfig:
    clip_ratio: float = 0.2
    """Symmetric PPO clip; the default of clip_ratio_low/high when they are null."""
    clip_ratio_low: float | None = None
    """Lower clip (1 - low); null uses clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip (1 + high); null uses clip_ratio (DAPO clip-higher sets it larger)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (must be > 1)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Which policy loss and its parameters."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient."""
    use_kl_loss: bool = False
    """Add a KL(current || reference) loss; the reference is the `reference` section's model,
    else the initial actor."""
    kl_loss_coef: float = 0.001
    """KL loss coefficient."""
    kl_loss_type: str = "low_var_kl"
    """kl (k1) | abs | mse (k2) | low_var_kl (k3) | full."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    ppo_mini_batch_size: int | None = None
    """Sequences per optimizer step within an epoch (the last of an epoch takes what is left);
    null: ROLL's global train batch when actor_train.training_args.gradient_accumulation_steps
    is set (it must agree when both are), else the whole rollout batch."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """verl's sequences per micro-batch per device: the same value as
    `actor_train.training_args.per_device_train_batch_size` (one given wins; both given and
    different is an error). null: not given."""
    ppo_micro_batch_size: int | None = None
    """verl's deprecated global micro-batch size: divided by the data-parallel size into
    ppo_micro_batch_size_per_gpu (must divide evenly; one deprecation line; setting both is an
    error). null: not given."""
    use_torch_compile: bool = False
    """verl's torch.compile of the actor's forward (fsdp2_train; falls back to eager with one
    logged reason where torch cannot compile). Off by default, unlike verl: batch widths vary
    every step, and compiling costs more than a short CPU run gains."""
    use_dynamic_bsz: bool = False
    """verl's dynamic batch size: the learner drops padding and packs each rank's sequences
    into micro-batches of at most `ppo_max_token_len_per_gpu` real tokens (balanced across
    data-parallel ranks) instead of fixed micro-batches of padded rows. Same loss and gradients
    as the padded path (the loss normalisation does not depend on the packing)."""
    share_prompt_forward: bool = True
    """Run each group's prompt once per training micro-batch and its n responses against the
    prompt's KV cache (GRPO's n samples share one prompt: n× fewer prompt tokens in the
    forward and backward; the same logprobs and gradients as running every row whole) where a
    cost model says it pays, decided per micro-batch from its shapes (`learner/prompt_rule.py`:
    the tokens each path runs through the projections and MLP plus the query-key pairs through
    attention, padding included; the ranks of an FSDP2 learner sum theirs and agree). It pays
    where prompts are long against responses; at long responses the shared forward's masked
    attention computes every [prompt | response] key pair where a padding-free whole forward
    takes SDPA's causal kernel (half of them), so there every row runs whole, except in the
    lean forward (Qwen2/Llama on one process), which lays the responses out for the causal
    kernel and keeps sharing. Each path's first use is logged (one info line). Applies on the
    fsdp2_train learner's padded micro-batches with activation checkpointing off
    (`model_args.disable_gradient_checkpointing`: HF's checkpointed layers drop the cache);
    with packing (`use_dynamic_bsz`), checkpointing on or another learner every row runs
    whole. false: always run every row whole."""
    router_replay: Literal["off", "r2", "r3"] = "off"
    """Routing replay for mixture-of-experts policies (verl's names). off: the learner's
    forward routes every token itself (its top-k may differ from the engine's: a share of the
    train/inference mismatch). r3 (rollout routing replay): the engines return each position's
    routed experts (SGLang's `return_routed_experts`), they travel with the group, and the
    learner's forwards use them (fsdp2_train's, or megatron_train's through megatron-core's
    router-replay hook, megatron-core 0.16+, without sequence or pipeline parallelism and
    without recompute): each token's experts are the engine's, their
    weights the learner's own router probabilities of those experts (renormalised as the
    model's `norm_topk_prob` says), so the router still learns. Each position replays the
    route of the forward that first took it: prompt tokens their sample's first prefill, an
    episode's observation tokens the next turn's prefill, so a continued or re-prefilled sample
    keeps its routes; the last response token routes itself. Needs a Qwen3-MoE/Qwen2-MoE
    policy (Qwen3-MoE with megatron_train) on one learner device with fsdp2_train, hf_infer
    engines or SGLang's (0.5.10+, launched with `enable_return_routed_experts: true` in
    actor_infer's strategy_config), the padded forward (not
    `use_dynamic_bsz`), eager (no `use_torch_compile`) and without activation checkpointing
    (a recompute in the backward would route itself); every row runs whole.
    `learner/router_replayed_frac` and `learner/router_differ_frac` (the share of replayed
    token-layers whose own top-k differs from the replayed experts) are logged. r2 (verl's):
    the learner's own old-policy pass (the no-grad recompute of the proximal logprobs,
    decoupled correction only; with r2 it always runs, the training forward never stands in
    for it) records each position's routes, and the update's forwards replay them, so the
    policy ratio's numerator routes like its denominator while the update moves the routers;
    the engines return no routes. fsdp2_train only, with r3's conditions on the learner (one
    device, padded forward, eager, no activation checkpointing, a Qwen3-MoE/Qwen2-MoE
    policy)."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one packed micro-batch per device with `use_dynamic_bsz` (> 0); a
    sequence longer than the budget gets a micro-batch of its own. A micro-batch is one packed
    row whose sequences attend only within themselves: with sdpa (the default) through the
    learner's varlen attention (torch's flash varlen kernel on CUDA in bf16/fp16, causal SDPA
    per sequence elsewhere; `asyncrl bench train`: 7.5x faster than sdpa's dense block mask at
    an 8k-token row on the CPU), with flash-attention through its own; with eager or flex
    attention (a dense block-diagonal mask) its sequences are laid into rows as long as its
    longest sequence (`asyncrl bench train`, log-normal lengths: 3.1x the padded path's real
    tokens/s at a 512-token budget, 3.2x at 4096)."""
    shuffle: bool = False
    """Shuffle sequences across mini-batches each epoch."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint contents and cadence."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer kind and its hyper-parameters."""
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    """verl's actor profiler: a torch profiler trace of chosen learner steps."""
