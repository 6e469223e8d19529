"""The worker sections of the configuration schema (actor_train, actor_infer, reference,
critic): which model in which dtype, its training and data arguments, sampling, backend and
devices; re-exported by `asyncrl.config.schema`. Every field carries a docstring;
`tests/test_config.py` checks every schema module. No torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Dtype = Literal["fp32", "bf16", "fp16"]


@dataclass
class ModelArgs:
    model_name_or_path: str = ""
    """Hugging Face model directory. Empty: the embedded tiny model, built and cached locally."""
    dtype: Dtype | None = None
    """Weights/compute dtype: fp32, bf16 or fp16; null keeps the config's torch_dtype."""
    disable_gradient_checkpointing: bool | None = None
    """Turn activation checkpointing off (training workers only). null (auto): checkpointing is
    on (ROLL's default), except for actor_train on the embedded tiny model, whose activations
    are kilobytes: there it would only recompute, and with it off each group's prompt is run
    once (`actor.share_prompt_forward`)."""
    attn_implementation: str | None = None
    """transformers attention kernel (eager, sdpa, flash_attention_2) of the fsdp2_train
    learner; null picks the default. Refused for other workers and backends (not read there)."""
    lora_rank: int = 0
    """LoRA rank r of the fsdp2_train actor (peft); 0 trains every weight. With r > 0 only the
    adapter trains, the frozen base stays in `dtype`, the KL reference is the base (adapter off)
    and syncs send only the adapter (see `weight_sync.lora_sync`). With several devices in
    `device_mapping` the peft model is FSDP2-sharded whole (base and adapter); the adapter is
    gathered factor by factor for sync and export. actor_train only."""
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
    warm_start_mix: list[Literal["frozenlake"]] = field(default_factory=list)
    """Environment idioms added to the embedded model's arithmetic warm-start corpus, as a
    pretraining mix would hold them (`asyncrl/models/mix.py` says what each holds): `frozenlake`
    adds random-policy FrozenLake play (valid moves, never a solution). Empty: the default
    embedded model. A non-empty mix is another model, built once and cached under its own key.
    actor_train only, and only with an empty `model_name_or_path`."""
    embedded_arch: Literal["dense", "moe"] = "dense"
    """The embedded model's architecture (empty `model_name_or_path` only): dense, a tiny
    Qwen2; moe, a tiny Qwen3-MoE (8 routed experts in each of its 2 layers, top-2, no shared
    expert), warm-started on the same task and cached under its own key (`models/tiny.py`).
    actor_train only: every other role follows actor_train's model."""

    def actor_checkpointing(self) -> bool:
        """Whether actor_train checkpoints activations (`disable_gradient_checkpointing`)."""
        if self.disable_gradient_checkpointing is None:  # auto: off on the embedded model
            return bool(self.model_name_or_path)
        return not self.disable_gradient_checkpointing


@dataclass
class TrainingArgs:
    learning_rate: float = 5.0e-5
    """Peak learning rate (> 0). The default suits the embedded tiny model; billion-parameter models
    want about 1e-6 (every shipped recipe sets its own). verl's `actor.optim.lr` sets the same
    value (actor_train): the one given wins; both given and different is a config error."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay (verl: `actor.optim.weight_decay`, same rule as
    learning_rate)."""
    per_device_train_batch_size: int = 64
    """Sequences per device per micro-batch (large models on GPUs: 1-4; the default suits the
    embedded CPU model: its whole 8 x 8 batch in one micro-batch, as each extra micro-batch
    costs a forward+backward's fixed overhead). verl's
    `actor.ppo_micro_batch_size_per_gpu` sets the same value (actor_train; same rule as
    learning_rate)."""
    gradient_accumulation_steps: int | None = None
    """ROLL's micro-batches per optimizer step: each step trains on the global train batch of
    per_device_train_batch_size × gradient_accumulation_steps × data-parallel ranks sequences
    (Megatron: world / tp·pp·cp ranks), so a rollout takes ppo_epochs × ⌈rollout sequences /
    global batch⌉ steps (`asyncrl config show` prints the plan). It sizes the same step as
    actor.ppo_mini_batch_size: both given and different is an error, as are a count with
    actor.use_dynamic_bsz (token-packed micro-batches) and a global batch larger than the
    rollout. null: ppo_mini_batch_size sizes the step, else one step per rollout."""
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
    computed inside the learner's process by the learner's backend, so fsdp2_train (the
    learner's own) | hf_infer (a transformers model: the fsdp2_train learner) |
    megatron_infer (Megatron chunks: the megatron_train learner); another is refused."""
    strategy_config: dict[str, Any] = field(default_factory=dict)
    """The backend's own keys; `asyncrl/config/strategy_keys.py` declares what each reads, and
    any other key is a config error naming it (with a did-you-mean). hf_infer (actor_infer):
    `max_batch_size`, the sequences one engine decodes together (default 256). fsdp2_train
    (actor_train): `offload_params` / `offload_optimizer`, FSDP2's CPU offload (verl's
    `param_offload`, `optimizer_offload`, `offload_policy` are read as these; its other
    fsdp_config keys are refused with the reason). megatron_train: Megatron's parallel sizes,
    recompute, DDP, `moe_*` and asyncrl's own keys (asyncrl/learner/megatron/args.py). sglang:
    SGLang's server args and asyncrl's launch keys (asyncrl/engine/sglang.py), passed through:
    SGLang's parser judges them when the servers start. The reference and the critic read
    none (they run inside the learner, on actor_train's backend)."""


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
    """Rows per logprob/inference pass (actor_train, reference, critic; actor_infer's engines
    batch by their own scheduler, so another value there is refused); the actor's proximal
    recompute packs rows into forwards of at most infer_batch_size × the batch's padded width
    tokens (short rows share a forward)."""
    num_gpus_per_worker: int = 1
    """Devices per engine (actor_infer): the engine's tensor-parallel size. Not read for the
    other roles (one device per learner rank): a value other than 1 there is refused."""
