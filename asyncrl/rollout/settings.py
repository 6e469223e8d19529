"""What every rollout worker shares: its settings, its per-prompt result, how it asks for samples.

`RolloutSettings` carries the run config's own sections whole (generation, rollout, algorithm,
env) plus where this worker reads (engine URLs, tokenizer) and writes (the transport address);
nothing is copied field by field. `sampling_params` is the one place a request's SGLang
`sampling_params` are built (training samples, episode turns and greedy evaluation alike).
`PermanentRolloutError` marks a failure that re-issuing the prompt cannot fix; `Wakeup` and
`given_up` are the two worker pools' (Ray actors, driver threads) shared bookkeeping.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config.schema import AlgorithmConfig, EnvConfig, GeneratingArgs, RolloutConfig


@dataclass
class RolloutSettings:
    """A rollout worker's own sub-config, cut from the run config by the orchestrator."""

    engine_urls: list[str]
    """Engines (or a router) this worker generates through; it starts on the first."""
    transport_host: str
    """Where the learner's ZMQ receiver listens."""
    transport_port: int
    """The receiver's port."""
    tokenizer_path: str
    """HF model directory whose tokenizer decodes responses for the reward."""
    tokenizer_class: str = ""
    """The transformers class AutoTokenizer picks for `tokenizer_path`, resolved once by the
    driver (`data.tokenizer.tokenizer_class_name`): the worker loads it directly and so never
    imports torch. '': resolve with AutoTokenizer."""
    tokenizer_json: str = field(default="", repr=False)
    """That tokenizer's `tokenizers` backend as the driver loaded it, serialized, where it
    decodes as the tokenizer does (`data.tokenizer.plain_decoder_json`): a worker that only
    decodes (single-turn groups) decodes with the `tokenizers` library from it and never
    imports transformers. '': the transformers tokenizer."""
    generating: GeneratingArgs = field(default_factory=GeneratingArgs)
    """`actor_infer.generating_args`: sampling parameters."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """`rollout`: reward function and request timeout."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """`algorithm`: group advantage estimator and overlong shaping."""
    env: EnvConfig | None = None
    """Set: multi-turn environment episodes (EpisodeBuilder) instead of single prompts."""
    n: int = 8
    """`num_return_sequences_in_group`: responses (or episodes) per prompt."""
    response_length: int = 32
    """`response_length`: default tokens per response; the cap on an episode's response."""
    seed: int = 0
    """Run seed; every request's sampling seed derives from it (`request_seed`)."""
    transport_secret: bytes | None = field(default=None, repr=False)
    """The run's secret for the ZMQ stream: this worker's connection proves it in its
    handshake, PLAIN or CURVE as `rollout.transport_host` says (`transport/auth.py`). None: no
    credentials (the receiver must have no secret either)."""
    engine_api_key: str | None = field(default=None, repr=False)
    """The run's API key for the engines' HTTP endpoints (None: engines without one)."""
    engine_router: bool = False
    """`engine_urls` is an sglang-router, whose /generate takes no batch: a group's samples go
    as one request each (`EngineClient(router=True)`). Set by the fleet (`EngineFleet.routed`)."""
    engine_lora: bool = False
    """`weight_sync.lora_sync: native`: every request names the engines' current LoRA adapter
    (`EngineClient(lora=True)`)."""
    routed_experts: bool = False
    """`actor.router_replay: r3`: every request asks its engine for the routed experts of
    each position (`return_routed_experts`); they travel in the group (`routes`)."""
    retry_attempts: int = 4
    """Tries of a prompt in the worker on a retriable error (engine busy or unreachable,
    timeouts) before it is reported failed and re-issued by the dispatcher."""
    retry_backoff_s: float = 0.5
    """Wait before the 2nd try; it doubles for each later one (with jitter), up to
    `retry_backoff_max_s`."""
    retry_backoff_max_s: float = 8.0
    """Longest wait between two tries of a prompt."""

    @property
    def max_new_tokens(self) -> int:
        return self.generating.max_new_tokens or self.response_length

    def engine_clients(self) -> list:
        """One `EngineClient` per engine URL, as these settings say to talk to it (timeout,
        API key, native LoRA, router). Imported here: the rollout workers' modules load it
        only where a worker is built."""
        from asyncrl.engine.client import EngineClient

        return [
            EngineClient(
                u,
                timeout=self.rollout.request_timeout_s,
                api_key=self.engine_api_key,
                lora=self.engine_lora,
                router=self.engine_router,
            )  # fmt: skip
            for u in self.engine_urls
        ]


@dataclass
class PromptResult:
    """A worker's answer for one prompt: delivered (ok), or failed with the reason in full:
    re-issued, unless `permanent` (then the run fails with `error`)."""

    key: str
    ok: bool
    error: str = ""
    tokens: int = 0
    reward_mean: float = 0.0
    permanent: bool = False
    """The failure cannot be fixed by re-issuing (a bad reward function, a missing data
    column, an engine's 4xx answer, a worker that could not start)."""


class PermanentRolloutError(RuntimeError):
    """A rollout failure that no retry can fix; the run stops with this message in full."""


def request_seed(seed: int, key: str, index: int) -> int:
    """A per-request sampling seed: the same prompt gets the same samples whatever the batching."""
    digest = hashlib.blake2b(f"{seed}/{key}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def sampling_params(
    gen: GeneratingArgs, max_new_tokens: int, seed: int | None = None, greedy: bool = False
) -> dict[str, Any]:
    """SGLang `sampling_params` of one request. `greedy`: temperature 0 (evaluation), which
    makes top-p/top-k moot; `seed`: the request's sampling seed (None: the engine's own)."""
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if greedy:
        params["temperature"] = 0.0
    else:
        params.update(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k)
    params["stop_token_ids"] = list(gen.stop_token_ids)
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def plain_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """Metadata that msgpack can carry (scalars, strings, lists of them)."""
    ok = (str, int, float, bool, type(None))
    return {
        str(k): v
        for k, v in metadata.items()
        if isinstance(v, ok) or (isinstance(v, list) and all(isinstance(x, ok) for x in v))
    }


#: Where a group's metadata keeps the prompt row's own fields (dataset columns, env seed).
DATA_KEY = "data"


def group_metadata(key: str, row: dict[str, Any], **own: Any) -> dict[str, Any]:
    """A group's metadata: asyncrl's keys (`prompt_key`, and `own`, e.g. env counts) at the top
    level, the prompt row's fields under `DATA_KEY`. The row can name a column anything
    (`prompt_key` included) without touching asyncrl's keys."""
    return {"prompt_key": key, **own, DATA_KEY: plain_metadata(row)}


#: Failures of one worker in a row (no answer between) that end the run instead of a re-issue.
MAX_CONSECUTIVE_DEATHS = 3


class Wakeup:
    """What lets a pool's `poll` wait (never spin: returning at once made the dispatcher take a
    core and the GIL whenever admission was closed) until a submission ends or `wake` runs."""

    def __init__(self) -> None:
        self._woken: cf.Future = cf.Future()

    def wake(self) -> None:
        try:
            self._woken.set_result(None)
        except cf.InvalidStateError:  # woken already; `wait` has not taken it yet
            pass

    def wait(self, futures: Iterable[cf.Future], timeout: float) -> None:
        woken = self._woken
        cf.wait([*futures, woken], timeout, return_when=cf.FIRST_COMPLETED)
        if woken.done():  # a wake racing this swap may hit the old one: harmless, as the
            self._woken = cf.Future()  # dispatcher reads admission right after this poll


def given_up(actor: int, deaths: int, error: Exception, how: str = "failed") -> Exception:
    """`error` as `poll` hands it over: itself (the dispatcher re-issues the prompts), or, after
    `MAX_CONSECUTIVE_DEATHS` failures in a row of one worker, the run's end."""
    if deaths < MAX_CONSECUTIVE_DEATHS:
        return error
    return PermanentRolloutError(
        f"rollout worker {actor} {how} {deaths} times in a row; last: {type(error).__name__}: {error}"
    )


def start_failure(errors: list[str]) -> PermanentRolloutError | None:
    """The run-ending error of the first worker that failed to start (`errors`: each worker's
    start error in worker order, "" for one that started), None when all started."""
    for index, error in enumerate(errors):
        if error:
            return PermanentRolloutError(f"rollout worker {index} failed to start: {error}")
    return None
