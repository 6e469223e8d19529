"""The configuration schema: nested dataclasses whose keys follow ROLL and verl.

Every field carries a docstring (the string literal after it); `tests/test_config.py` checks that
none is missing. Nothing here imports torch or Ray, so `asyncrl config` starts fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from asyncrl.config.schema_actor import (  # noqa: F401 - the schema's names, re-exported
    ActorConfig,
    AlgorithmConfig,
    CheckpointConfig,
    KLControlConfig,
    OptimConfig,
    PolicyLossConfig,
    ProfilerConfig,
    RejectionCriterion,
)
from asyncrl.config.schema_run import (  # noqa: F401 - the schema's names, re-exported
    ClusterConfig,
    LoggingConfig,
    ThreadsConfig,
)
from asyncrl.config.schema_worker import (  # noqa: F401 - the schema's names, re-exported
    DataArgs,
    Dtype,
    GeneratingArgs,
    ModelArgs,
    StrategyArgs,
    TrainingArgs,
    WorkerConfig,
)

PauseMode = Literal["auto", "abort", "retract", "in_place", "none"]


class ConfigError(ValueError):
    """A configuration problem, one line, naming the offending key path."""


# ---------------------------------------------------------------------------------------------
# Loop-level sections
# ---------------------------------------------------------------------------------------------
@dataclass
class AsyncConfig:
    max_staleness: int | Literal["auto"] = 1
    """Most versions a trained-on group may lag the learner; 0 is the synchronous loop. auto:
    the bound moves between 0 and max_staleness_hard by what the learner measures on trained
    groups: it starts at 1, drops at once below the lowest lag whose effective sample size
    (staleness_signal) stayed under target_ess (or, with target_kl, whose KL stayed above
    it) for 2 steps, and rises by one
    after 4 steps with every admitted lag on target (a rise that fails doubles the next wait,
    up to 32 steps). Each change is one `asyncrl: step N: staleness bound ...` line with its
    reason and the `replay/staleness_bound` metric; the controller is checkpointed. Needs the
    IS weights (algorithm.rollout_is_threshold set, correction_mode decoupled)."""
    sync_interval: int = 1
    """Broadcast weights to the engines every N optimizer steps."""
    pause_mode: PauseMode = "auto"
    """How engines hold in-flight requests during a weight update: abort | retract | in_place
    (paused while the buckets arrive) | none (hf_infer: the engines keep generating while
    every bucket arrives and is checked, then load them all, with the version, between two
    steps; SGLang loads bucket by bucket, so it is refused there). in_place and none both
    finish a running request under the new weights with its KV kept; none skips the pause and
    resume round trips and never idles the engine (CPU default: sync 5 ms against 9, measured),
    but holds a second copy of the weights while a sync spans several buckets. auto: none on
    hf_infer, in_place on SGLang."""
    stale_policy: Literal["evict", "wait", "correct"] = "evict"
    """A group staler than max_staleness: evict (dropped, its prompt replaced); wait (no new
    prompts and no learner step while in-flight work would exceed the bound: nothing is
    discarded, the learner may idle); correct (trained with rollout IS up to
    max_staleness_hard, evicted beyond it)."""
    max_staleness_hard: int = 4
    """stale_policy correct: groups staler than this are still evicted (>= max_staleness);
    max_staleness auto: the highest bound the controller may set (>= 1)."""
    target_ess: float = 0.7
    """max_staleness auto: the normalised effective sample size, in (0, 1], every admitted
    lag must keep (of staleness_signal; a lag counts once it holds 8 units in a step). With
    the sequence signal, 0.7: a lag's groups are worth at least 70 % of on-policy ones."""
    staleness_signal: Literal["sequence", "weights"] = "sequence"
    """max_staleness auto: which ESS by lag the controller reads. sequence: of the lag's
    untruncated sequence-level ratios π_learner(y|x) / π_behaviour(y|x)
    (`is/seq_ess_by_lag/<k>`, rows), the shift itself whatever the loss does about it; it
    gets stricter with the response length. Both signals are read over the mean lag-0 ESS
    measured so far (the engine/learner numerical mismatch, which no bound changes).
    weights: of the IS weights the loss applies (`is/ess_by_lag/<k>`, tokens or sequences per
    algorithm.rollout_is_level); truncated, clipped or geometric-mean weights hide the shift
    (their ESS stays near 1), so use it with a higher target_ess or with target_kl."""
    target_kl: float | None = None
    """max_staleness auto: also tighten when an admitted lag's mean per-token k3 KL between
    the policy that generated its tokens and the learner's (`is/kl_by_lag/<k>`, logged) is
    above this (> 0): how far the policy moved since, which the ESS of truncated or
    geometric-mean weights hides (it stays near 1). Relaxing needs both targets met. null:
    the ESS alone."""
    max_inflight_tokens: int | None = None
    """Most tokens held outside the learner at once: prompts admitted and not yet delivered
    (being generated or in transit), each counted at its worst case n × (prompt + most new
    tokens: max_new_tokens, or response_length for env episodes; an env prompt as
    prompt_length), plus delivered groups not yet trained, at their real n × prompt + response
    tokens; a group's tokens are released when it is trained, evicted or filtered. A prompt
    starts only while one worst-case prompt still fits, beside the group budget of
    max_staleness (with every stale_policy). Must cover one rollout batch at its worst case,
    or the learner could wait for a batch that cannot fit. Metrics `replay/tokens_held` (and
    `_peak`), `replay/tokens_in_flight`, `replay/tokens_buffered` (and `_peak`). null or 0:
    off."""


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
    lora_sync: Literal["auto", "adapter", "merge", "native"] = "auto"
    """With `actor_train.model_args.lora_rank` > 0: `adapter` sends only the LoRA tensors each
    sync (hf_infer: the engine keeps its base weights pristine and loads W0 + scale·B·A);
    `native` (sglang only) uses SGLang's own LoRA path: engines start with `--enable-lora`, each
    sync writes the adapter in PEFT format under `lora_dir`, every engine loads it as
    `asyncrl-v{version}` and every /generate names its adapter (`lora_path`); `merge` sends full
    weights with the adapter merged in (any engine). auto: adapter on hf_infer, merge on sglang.
    Ignored without LoRA."""
    lora_dir: str = ""
    """`lora_sync: native`: the directory each sync writes the adapter to (one subdirectory per
    version, the previous removed once unloaded); the engines read it, so with
    `cluster.address` (multi-node) it must be a path every engine's node shares (required
    then). Empty: `output_dir/lora_adapters`."""
    overlap: Literal["auto", "always", "never"] = "auto"
    """always: a sync runs while the learner trains the next step, from a copy of the weights
    the learner takes first (a second copy in rank 0's memory: FSDP/Megatron gather them
    whole); admission opens for the new version once every engine holds it, so the staleness
    bound is unchanged. Steps that evaluate, and the last, wait for their sync. never: every
    sync waits. auto: always for a one-process learner on the CPU (the copy is host memory)
    at `async.max_staleness` >= 2 (with max_staleness auto: max_staleness_hard; at 1 a
    version's prompts start only once its sync lands: overlapping leaves the engines less
    time, measured slower), else never. Refused with
    `async.stale_policy: wait` (its gate reads the version admission opened)."""


@dataclass
class RolloutConfig:
    num_actors: int = 2
    """Rollout workers, each driving its share of engines (Ray actors or threads of the
    driver: `worker_pool`)."""
    worker_pool: Literal["ray", "driver", "process"] = "ray"
    """Where the rollout workers run. `ray`: as Ray actors, one process each (Ray starts
    locally unless the run joins a cluster). `driver`: as threads of the driver process, no
    Ray at all: a shorter start (Ray's daemons and a process per worker are most of the CPU
    default's; the whole command's CPU 31 s -> 17-18 s), a slower loop (the workers' Python
    shares the driver's interpreter lock and core with the learner: 0.6-0.85x the completions/s
    of Ray's workers on the CPU default, the loaded 2-core box, 2026-11-28). `process`: each a
    plain child process of the driver (`rollout/process_pool.py`: msgpack over pipes, no Ray
    on one host, ended with the driver even on `kill -9`; a dead one is replaced and its
    prompts re-issued): no Ray daemons to start and no interpreter lock shared with the
    learner, but each worker imports the rollout stack itself (0.9-1.0 s of CPU to the first
    batch since single-turn workers decode with the `tokenizers` library, not transformers:
    3.2-3.6 s before; docs/ARCHITECTURE.md, start-up, 2026-11-29).
    Measured on the CPU default (`asyncrl run configs/default.yaml logging.eval_interval=0`,
    interleaved rounds, the loaded 2-core box at load 5-10, 2026-11-28), medians ray / driver /
    process: its 60 steps (6 rounds) whole command 52 / 31 / 33 s, first trained batch 29 / 12 /
    15 s; 200 steps (9 rounds) loop completions/s 1.0 / 0.80 / 0.86x Ray's (process/Ray's
    median per round 0.96x, from 0.4x to 1.8x: the load swamps the difference); again
    later on 2026-11-28 (3 rounds, load 8-14, commit 6773ce7) process/Ray 0.60x (per round 0.46-0.81x),
    so `ray` stays the default. Refused with `cluster.address` unless `ray`: there the workers
    run beside their engines on the nodes."""
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
    threads: ThreadsConfig = field(default_factory=ThreadsConfig)
    """CPU thread budget of the learner and the local engine servers (auto: split the cores)."""


#: Dataclass field names that differ from their YAML key (Python keywords).
FIELD_ALIASES: dict[str, str] = {"async_": "async"}
