"""Where the run lives and what it reports: the `logging`, `cluster` and `threads` sections of
the configuration schema, re-exported by `asyncrl.config.schema`. Every field carries a
docstring; `tests/test_config.py` checks every schema module. No torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


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
    eval_engine: Literal["shared", "dedicated"] = "shared"
    """Where evaluation generates. shared: on every engine, beside rollout (at
    `eval_priority`). dedicated: on the last engine alone, which rollout workers are never
    routed to (needs >= 2 engines in actor_infer and eval_interval > 0). It meets the learner
    in a weight group of its own and is synced only at evaluation steps, so evaluation stays
    pinned to the step's version while the rollout engines' syncs never wait for it (with
    `weight_sync.master_port` set, that group meets on the next port)."""
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
    learner_bundle: dict[str, float] = field(default_factory=dict)
    """Multi-node, a learner on several devices (fsdp2_train's gloo ranks): extra Ray resources
    of each of ranks 1..W-1's bundles (CPU 1 each, placed PACK; rank 0 is the driver), e.g.
    {"node_b": 1}. The ranks meet rank 0 at the driver node's address."""


@dataclass
class ThreadsConfig:
    """torch CPU threads of the run's CPU-bound processes: the learner (each rank) and each
    hf engine server on this host (`asyncrl/threads.py:plan_threads`). Rollout workers and
    Ray's own processes are I/O-bound: neither budgeted nor pinned. The chosen budget is
    printed once at start (`asyncrl: threads: ...`)."""

    learner: int | Literal["auto"] = "auto"
    """torch intra-op threads of each learner process (per rank with several). auto: its share
    of the usable cores (os.sched_getaffinity) split evenly with the local engine servers, e.g.
    1 of 2 cores beside one engine; a learner on a GPU/NPU keeps torch's default. An integer
    (>= 1, at most the usable cores) is used as given."""
    engine: int | Literal["auto"] = "auto"
    """torch intra-op threads of each hf_infer engine server on this host (`--num-threads`).
    auto: its share of the usable cores, as for the learner. SGLang engines and engines on
    other nodes are not budgeted."""
    pin: bool = True
    """Pin each budgeted process to cores of its own (os.sched_setaffinity; the learner's
    driver process with every thread it runs) when all shares fit in the usable cores; when
    they do not (more processes than cores), none is pinned and the start-up line says so."""
