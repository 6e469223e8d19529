"""The configuration schema: nested dataclasses whose keys follow ROLL and verl.

Every field carries a docstring (the string literal after it); `tests/test_config.py` checks that
none is missing. Nothing here imports torch or Ray, so `asyncrl config` starts fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Dtype = Literal["fp32", "bf16", "fp16"]
PauseMode = Literal["abort", "retract", "in_place"]


class ConfigError(ValueError):
    """A configuration problem, one line, naming the offending key path."""


# ---------------------------------------------------------------------------------------------
# Worker sections (actor_train, actor_infer, reference, critic)
# ---------------------------------------------------------------------------------------------
@dataclass
class ModelArgs:
    model_name_or_path: str = ""
    """Hugging Face model directory. Empty: the embedded tiny model, built and cached locally."""
    dtype: Dtype | None = None
    """Weights/compute dtype: fp32, bf16 or fp16; null keeps the config's torch_dtype."""
    disable_gradient_checkpointing: bool = False
    """Turn activation checkpointing off (training workers only)."""
    attn_implementation: str | None = None
    """transformers attention kernel (eager, sdpa, flash_attention_2) of the fsdp2_train
    learner; null picks the default. Refused for other workers and backends (not read there)."""
    lora_rank: int = 0
    """LoRA rank r of the fsdp2_train actor (peft); 0 trains every weight. With r > 0 only the
    adapter trains, the frozen base stays in `dtype`, the KL reference is the base (adapter off)
    and syncs send only the adapter (see `weight_sync.lora_sync`). actor_train only."""
    lora_alpha: float = 16.0
    """LoRA alpha (> 0): the adapter's update is scaled by alpha / r (alpha / sqrt(r) with
    `use_rslora`)."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input in training, in [0, 1) (never applied when scoring)."""
    target_modules: str | list[str] = "all-linear"
    """Linear layers that get an adapter: `all-linear` (every linear layer but the output head)
    or a list of module-name suffixes, e.g. [q_proj, k_proj, v_proj, o_proj]."""
    lora_target_exclude: list[str] = field(default_factory=list)
    """Module-name suffixes kept without an adapter even when `target_modules` matches them."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(r) instead of alpha / r."""


@dataclass
class TrainingArgs:
    learning_rate: float = 5.0e-5
    """Peak learning rate (> 0). The default suits the embedded tiny model; billion-parameter models
    want about 1e-6 (every shipped recipe sets its own). verl's `actor.optim.lr` sets the same
    value (actor_train): the one given wins; both given and different is a config error."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay (verl: `actor.optim.weight_decay`, same rule as
    learning_rate)."""
    per_device_train_batch_size: int = 16
    """Sequences per device per micro-batch (large models on GPUs: 1-4). verl's
    `actor.ppo_micro_batch_size_per_gpu` sets the same value (actor_train; same rule as
    learning_rate)."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches per optimizer step; null derives the value giving one step per rollout."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps. verl's `actor.optim.lr_warmup_steps`
    (or `lr_warmup_steps_ratio` × total steps) sets the same value (actor_train; same rule as
    learning_rate)."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up (verl: `actor.optim.lr_scheduler_type`, same rule)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (verl: `actor.optim.clip_grad`, same
    rule)."""


@dataclass
class DataArgs:
    template: Literal["native", "none"] = "none"
    """Prompt construction: `native` applies the tokenizer's chat template; `none` tokenizes the
    prompt text as is (the embedded task's format)."""
    file_name: list[str] = field(default_factory=list)
    """Training prompt files (JSON, JSONL, CSV, Parquet). Empty: the embedded synthetic task."""
    eval_file_name: list[str] = field(default_factory=list)
    """Held-out prompt files; empty uses the embedded task's held-out split when it is in use."""
    prompt: str | None = None
    """Column holding the prompt text (conflicts with `messages`)."""
    messages: str | None = None
    """Column holding a chat message list (conflicts with `prompt`)."""
    shuffle: bool = True
    """Shuffle prompts every epoch (deterministically from the run seed)."""


@dataclass
class GeneratingArgs:
    max_new_tokens: int | None = None
    """Generated tokens per response; null uses the top-level `response_length`."""
    temperature: float = 1.0
    """Sampling temperature: 0 is greedy, otherwise at least 1e-6 (SGLang samples greedily below
    that, while the learner would divide its logits by the tiny value); the learner divides its
    logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1] (not reflected in engine logprobs, as in SGLang)."""
    top_k: int = -1
    """Top-k sampling: -1 disables it, otherwise at least 1."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response besides the tokenizer's EOS."""


@dataclass
class StrategyArgs:
    strategy_name: str = "fsdp2_train"
    """Backend: fsdp2_train | megatron_train (train), sglang | hf_infer (infer); reference:
    fsdp2_train | hf_infer | megatron_infer (all computed inside the learner's process)."""
    strategy_config: dict[str, Any] = field(default_factory=dict)
    """Passed through to the backend (Megatron parallel sizes, SGLang server args, ...)."""


@dataclass
class WorkerConfig:
    model_args: ModelArgs = field(default_factory=ModelArgs)
    """Which model, in which dtype."""
    training_args: TrainingArgs = field(default_factory=TrainingArgs)
    """Optimizer-side sizes and schedule (training workers)."""
    data_args: DataArgs = field(default_factory=DataArgs)
    """Prompt data (read from actor_train)."""
    generating_args: GeneratingArgs = field(default_factory=GeneratingArgs)
    """Sampling parameters (read from actor_infer)."""
    strategy_args: StrategyArgs = field(default_factory=StrategyArgs)
    """Backend name and its pass-through config."""
    device_mapping: list[int] = field(default_factory=list)
    """Device ids of this worker; `list(range(0,8))` is parsed, never evaluated (at most 65536
    ids, each in 0..65535). Empty: CPU."""
    infer_batch_size: int = 4
    """Rows per logprob/inference pass; the actor's proximal recompute packs rows into forwards
    of at most infer_batch_size × the batch's padded width tokens (short rows share a forward)."""
    num_gpus_per_worker: int = 1
    """Devices per engine (actor_infer): the engine's tensor-parallel size."""


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
    exits; a failed write raises at the next save or the end, leaving the previous checkpoint."""


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
    """Sequences per optimizer step within an epoch; null: the whole rollout batch."""
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
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one packed micro-batch per device with `use_dynamic_bsz` (> 0); a
    sequence longer than the budget gets a micro-batch of its own. The default suits
    flash-attention's varlen kernel on a GPU; on the CPU (sdpa/eager) the packed sequences'
    block-diagonal mask is dense, attention costs budget² per micro-batch: a few hundred to a
    few thousand tokens (`asyncrl bench train`: 512 gives 2.5x the padded path, 2048 1.3x)."""
    shuffle: bool = False
    """Shuffle sequences across mini-batches each epoch."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint contents and cadence."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer kind and its hyper-parameters."""
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    """verl's actor profiler: a torch profiler trace of chosen learner steps."""


# ---------------------------------------------------------------------------------------------
# Loop-level sections
# ---------------------------------------------------------------------------------------------
@dataclass
class AsyncConfig:
    max_staleness: int = 1
    """Most versions a trained-on group may lag the learner; 0 is the synchronous loop."""
    sync_interval: int = 1
    """Broadcast weights to the engines every N optimizer steps."""
    pause_mode: PauseMode = "in_place"
    """How engines hold in-flight requests during a weight update: abort | retract | in_place."""
    stale_policy: Literal["evict", "wait", "correct"] = "evict"
    """A group staler than max_staleness: evict (dropped, its prompt replaced); wait (no new
    prompts and no learner step while in-flight work would exceed the bound: nothing is
    discarded, the learner may idle); correct (trained with rollout IS up to
    max_staleness_hard, evicted beyond it)."""
    max_staleness_hard: int = 4
    """stale_policy correct: groups staler than this are still evicted (>= max_staleness)."""


@dataclass
class WeightSyncConfig:
    backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"
    """torch.distributed backend of the update group; auto follows the device."""
    bucket_size_mb: float = 256.0
    """Bytes per broadcast bucket, in MiB."""
    load_format: Literal["auto", "flattened_bucket", "tensors"] = "auto"
    """flattened_bucket: one uint8 buffer per bucket (fewer NCCL/HCCL launches); tensors: one
    broadcast per tensor, received straight into the engine's parameters (no copies: fastest on
    gloo for large tensors). auto: on gloo, per bucket, tensors when they average >= 1 MiB and
    flattened otherwise (small tensors pay a collective's latency each); flattened on NCCL/HCCL."""
    timeout_s: float = 120.0
    """Every wait of a sync ends after this long with an error naming the stalled engine."""
    master_address: str = "127.0.0.1"
    """Address the update group rendezvouses on (the learner's host)."""
    master_port: int = 0
    """Rendezvous port, 0..65535; 0 picks a free one."""
    lora_sync: Literal["auto", "adapter", "merge"] = "auto"
    """With `actor_train.model_args.lora_rank` > 0: `adapter` sends only the LoRA tensors each
    sync (the hf engine keeps its base weights pristine and loads W0 + scale·B·A); `merge` sends
    full weights with the adapter merged in (any engine). auto: adapter on hf_infer, merge on
    sglang (asyncrl does not drive SGLang's native LoRA endpoints yet, so adapter is refused
    there). Ignored without LoRA."""


@dataclass
class RolloutConfig:
    num_actors: int = 2
    """Rollout workers (each a Ray actor), each driving its share of engines."""
    reward_fn: str = "arithmetic_exact"
    """Reward by registry name or `package.module:function`; the path is imported when the config
    loads, so a typo fails validation."""
    max_inflight_prompts: int = 8
    """Prompts one actor keeps in flight at once (bounded also by admission capacity)."""
    request_timeout_s: float = 300.0
    """Engine request timeout; a timed-out prompt is re-issued."""
    transport_host: str = "127.0.0.1"
    """Where the learner's ZMQ PULL socket binds (set an address for multi-node)."""
    transport_port: int = 0
    """ZMQ port, 0..65535; 0 picks a free one."""


@dataclass
class EnvConfig:
    name: str = ""
    """Environment by registry name (frozenlake, sokoban, guess_number, math_tool, gym) or a
    `package.module:Class` path; see asyncrl/envs/."""
    config: dict[str, Any] = field(default_factory=dict)
    """The environment's own sub-config, passed as keyword arguments to its constructor."""
    max_turns: int = 8
    """Most model turns per episode; an episode still running then ends with `max_turns`. The
    whole episode response (generated + observation tokens) is capped by `response_length`."""
    max_tokens_per_turn: int | None = None
    """Generated tokens per turn; null: actor_infer.generating_args.max_new_tokens or
    response_length (always also bounded by what is left of response_length)."""
    step_timeout_s: float = 30.0
    """A reset or step taking longer fails its episode (the thread is abandoned, never reused)."""
    template: Literal["native", "none"] = "native"
    """native: observations go through the tokenizer's chat template; none: raw text turns (each
    observation's contents joined by newlines after the model's EOS)."""
    return_mode: Literal["sum", "final"] = "sum"
    """Episode return: the sum of the per-turn rewards, or the last turn's reward."""
    advantage_mode: Literal["trajectory", "per_step"] = "trajectory"
    """trajectory: algorithm.adv_estimator over episode returns, one value per episode; per_step:
    each turn's tokens get its discounted return-to-go, normalised over the group's turns."""
    gamma: float = 1.0
    """Turn-level discount of the per_step advantages."""
    num_seeds: int = 100000
    """Training seeds (seed_offset .. seed_offset + num_seeds - 1), one prompt each, reshuffled
    every epoch like a dataset."""
    seed_offset: int = 0
    """First training seed."""


@dataclass
class LoggingConfig:
    console: bool = True
    """Live rich console view."""
    tensorboard: bool = True
    """Write TensorBoard events under output_dir."""
    wandb_project: str | None = None
    """W&B project; null disables W&B."""
    eval_interval: int = 5
    """Held-out evaluation every N steps (and at start and end); 0 disables it. Env runs:
    held-out episodes, greedy and sampled (`eval/greedy/*`, `eval/sampled/*`)."""
    eval_size: int = 500
    """Held-out prompts per evaluation (500: a 2-point standard error around 50 %). Env runs:
    held-out env seeds (disjoint from the training seeds, the same at every evaluation), each
    played twice (greedy and sampled): 2 * eval_size episodes per evaluation."""
    eval_priority: int = -1
    """SGLang `priority` of the evaluation's /generate requests (a signed 64-bit int; rollout
    requests run at 0; a larger value is admitted first). -1: evaluation yields to rollout, so
    it fills the engines' idle slots instead of delaying training batches. With sglang, a value
    other than 0 adds `--enable-priority-scheduling --default-priority-value 0` to the server
    command (`engine/sglang.py`); 0 sends no priority at all."""
    plots: bool = True
    """Write PNG plots and a summary at the end."""


@dataclass
class ClusterConfig:
    """Where the run's parts live: one host (the default) or a Ray cluster of several."""

    address: str = ""
    """Ray cluster to run on: "" starts Ray on this host (loopback) unless `RAY_ADDRESS` names
    one; "auto" joins the cluster `ray start` made on this host; "IP:PORT" joins that head.
    Set, the run is multi-node: engines are Ray actors in a placement group (one bundle per
    engine), rollout workers are placed with them, and every address the run advertises is
    its node's (from Ray); `bind_host` and `rollout.transport_host` must then be routable."""
    bind_host: str = "127.0.0.1"
    """Address the engine servers (and the sglang-router) bind on their nodes; each engine is
    reached at its node's address. Multi-node: "0.0.0.0" (or ::). Off loopback every engine
    call but /health* needs the run's API key, which asyncrl always sets for engines it
    launches."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "SPREAD"
    """Ray placement-group strategy of the engines' bundles (SPREAD: over as many nodes as fit;
    STRICT_SPREAD: one engine per node at most)."""
    engine_bundle: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources of each engine's bundle (e.g. {"node_b": 1} to pin engines to nodes
    started with that custom resource); besides GPU = tp size on GPU clusters, else CPU 1."""


@dataclass
class Config:
    rollout_batch_size: int = 8
    """Prompts per training step."""
    prompt_length: int = 64
    """Longest prompt in tokens; longer prompts are skipped and counted."""
    response_length: int = 32
    """Longest response in tokens."""
    num_return_sequences_in_group: int = 8
    """Responses per prompt (the group of GRPO-style estimators)."""
    max_steps: int = 60
    """Optimizer steps of the run."""
    seed: int = 0
    """Seed of every random stream (data order, sampling, init)."""
    output_dir: str = "runs/asyncrl"
    """Metrics, checkpoints, plots and the resolved config go here."""
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    """Asynchrony: staleness bound, weight-sync cadence, in-flight update mode (key `async`)."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How weights travel from learner to engines."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout workers, reward and transport."""
    actor_train: WorkerConfig = field(default_factory=WorkerConfig)
    """The learner (policy being trained)."""
    actor_infer: WorkerConfig = field(
        default_factory=lambda: WorkerConfig(strategy_args=StrategyArgs("hf_infer"))
    )
    """The rollout engines."""
    reference: WorkerConfig | None = None
    """Reference policy of the KL loss (needs actor.use_kl_loss), loaded inside the learner,
    frozen: model_args.model_name_or_path (empty: the actor's own model), model_args.dtype (null:
    the actor's), infer_batch_size (rows per logprob pass). Must share the actor's tokenizer
    (equal vocab_size); with megatron_train also its architecture and dtype; device_mapping empty
    or actor_train's. null: a frozen copy of the initial actor."""
    critic: WorkerConfig | None = None
    """Value model for gae (needs adv_estimator: gae): the actor's architecture with a scalar
    value head, trained inside the fsdp2_train learner on actor_train's one device;
    model_args.model_name_or_path (empty: the actor's model), model_args.dtype (null: fp32),
    training_args (its optimizer), infer_batch_size (rows per value pass); cliprange_value and
    critic_warmup live in algorithm. null: none."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, rollout importance sampling, rejection sampling, DAPO filters."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy loss (verl's actor keys), epochs, checkpointing, optimizer."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """What the user sees and where metrics go."""
    env: EnvConfig | None = None
    """Agentic multi-turn rollouts in an environment; null: single-turn prompts and a reward."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """One host or a multi-node Ray cluster: Ray address, engine bind address, placement."""


#: Dataclass field names that differ from their YAML key (Python keywords).
FIELD_ALIASES: dict[str, str] = {"async_": "async"}
