"""Wire records: what a trajectory is while it travels from a rollout worker to the learner.

Every record here is plain data (numpy arrays, str, int, float) so the codec can move it without
pickle. A `TrajectoryGroup` stores its n responses *flat*: the responses' tokens are concatenated
in one array per field and `response_lengths` tells where each response ends. Flat storage keeps
the wire format to a handful of side buffers however large n is.

The learner pads groups into its tensors (`learner/collate.py`). This module imports neither
torch nor Ray.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Version stamped on tokens the policy did not generate (environment / tool observations).
NOT_GENERATED = -1


class RecordError(ValueError):
    """A wire record is inconsistent (lengths, dtypes, mask values)."""


# (field name, dtype); these fields are 1-D and share the flat token axis.
TOKEN_FIELDS: tuple[tuple[str, type], ...] = (
    ("response_ids", np.int32),
    ("rollout_logprobs", np.float32),
    ("loss_mask", np.uint8),
    ("versions", np.int32),
)

#: Route value of a position with no recorded experts (`asyncrl.moe.UNROUTED`: the learner
#: routes it itself); the optional `routes` field's dtype is uint8.
UNROUTED = 255

# Every array field of a TrajectoryGroup with its dtype (advantages is optional).
ARRAY_FIELDS: tuple[tuple[str, type], ...] = (
    ("prompt_ids", np.int32),
    ("response_lengths", np.int32),
    *TOKEN_FIELDS,
    ("rewards", np.float32),
    ("advantages", np.float32),
)


@dataclass(eq=False)
class TrajectoryGroup:
    """The n responses of one prompt, as the rollout worker produced them.

    Invariants (checked on construction): every token field has length sum(response_lengths);
    token ids are >= 0; `loss_mask` is 0/1 and is 0 on environment and tool tokens; `versions`
    holds the weight version (>= 0) that generated each token and `NOT_GENERATED` on tokens the
    policy did not generate, which must have `loss_mask` 0 (a generated token may still be masked
    out); `rewards`, `finish_reasons` have one entry per response; `advantages` is either None or
    per token; logprobs, rewards and advantages are finite. Integer fields are cast only when the
    cast is exact (1.5 or 2**40 as a token id is an error, not a silent truncation).

    `routes` (mixture-of-experts policies, `actor.router_replay: r3`): None, or a 2-D uint8
    array [n * len(prompt_ids) + sum(response_lengths), layers * top_k]: response i's block is
    its P + R_i positions (prompt, then response), each row the expert ids the engine routed
    that position to in every MoE layer (layer-major), `UNROUTED` where no engine forwarded it
    (the last response token; tokens no engine generated).
    """

    group_id: str
    prompt_ids: np.ndarray
    response_lengths: np.ndarray
    response_ids: np.ndarray
    rollout_logprobs: np.ndarray
    loss_mask: np.ndarray
    versions: np.ndarray
    rewards: np.ndarray
    finish_reasons: list[str]
    advantages: np.ndarray | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    routes: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.routes is not None:
            self.routes = _as_routes(self.routes)
        for name, dtype in ARRAY_FIELDS:
            value = getattr(self, name)
            if value is not None or name != "advantages":
                setattr(self, name, _as_1d(value, dtype, name))
        if isinstance(self.finish_reasons, str | bytes) or not isinstance(
            self.finish_reasons, Sequence
        ):
            raise RecordError("finish_reasons must be a list with one entry per response")
        self.finish_reasons = [str(r) for r in self.finish_reasons]
        if not isinstance(self.metadata, Mapping) or not all(
            isinstance(k, str) for k in self.metadata
        ):
            raise RecordError("metadata must be a mapping with str keys")
        self.metadata = dict(self.metadata)
        self._check()

    @classmethod
    def _from_wire(
        cls,
        group_id: str,
        finish_reasons: list[str],
        metadata: dict[str, Any],
        arrays: dict[str, np.ndarray],
    ) -> TrajectoryGroup:
        """The decoder's constructor (private): `__post_init__`'s normalisation is skipped
        because the codec already guarantees what it would establish (each array 1-D,
        C-contiguous, of its field's exact dtype; `finish_reasons` a fresh list of str;
        `metadata` a fresh str-keyed dict of plain values); every value check still runs."""
        group = cls.__new__(cls)
        group.__dict__.update(
            arrays,
            group_id=group_id,
            finish_reasons=finish_reasons,
            metadata=metadata,
            advantages=arrays.get("advantages"),
            routes=arrays.get("routes"),
        )
        group._check()
        return group

    def _check(self) -> None:
        gid = self.group_id
        if not isinstance(gid, str) or not gid:
            raise RecordError("group_id must be a non-empty string")
        shortest, total = _min_and_sum(self.response_lengths)
        if shortest < 0:
            raise RecordError(f"group {gid}: negative response length")
        n = len(self.response_lengths)
        for name, _ in TOKEN_FIELDS:
            if len(getattr(self, name)) != total:
                raise RecordError(
                    f"group {gid}: {name} has {len(getattr(self, name))} tokens, "
                    f"response_lengths sum to {total}"
                )
        if self.advantages is not None and len(self.advantages) != total:
            raise RecordError(f"group {gid}: advantages must be per token ({total})")
        if len(self.rewards) != n or len(self.finish_reasons) != n:
            raise RecordError(
                f"group {gid}: {n} responses but {len(self.rewards)} rewards and "
                f"{len(self.finish_reasons)} finish_reasons"
            )
        if self.routes is not None:
            rows = n * len(self.prompt_ids) + total
            r = self.routes
            if r.ndim != 2 or r.dtype != np.uint8 or r.shape[0] != rows or r.shape[1] < 1:
                raise RecordError(
                    f"group {gid}: routes must be uint8 [{rows}, layers * top_k] (n x prompt + "
                    f"response tokens), got {r.dtype} {tuple(r.shape)}"
                )
        self._check_values()

    def _check_values(self) -> None:
        # Hot decode path: on a 1k-token group each numpy call is mostly fixed overhead
        # (~1-2 us), so reductions are called as ufuncs directly and fused where exact.
        gid, mask, versions = self.group_id, self.loss_mask, self.versions
        if _lowest(self.prompt_ids) < 0 or _lowest(self.response_ids) < 0:
            raise RecordError(f"group {gid}: negative token id")
        if mask.size and _MAX(mask) > 1:
            raise RecordError(f"group {gid}: loss_mask must hold only 0 and 1")
        oldest = _lowest(versions)
        if oldest < NOT_GENERATED:
            raise RecordError(f"group {gid}: version below NOT_GENERATED ({NOT_GENERATED})")
        # With versions >= NOT_GENERATED == -1 and mask in {0, 1} (both checked above),
        # `version - mask` is < -1 exactly where a masked-in token has no version: one
        # subtraction and one reduction instead of two comparisons and `any`. int32 arithmetic
        # (2x faster than an int64 cast here) cannot wrap: the result is >= -2. Only a group
        # with an unversioned token (env and tool tokens) can fail it: a single-turn group,
        # every token generated, skips the pass (a third of the checks' time on a 16k group).
        if oldest < 0 and mask.size and _MIN(np.subtract(versions, mask)) < NOT_GENERATED:
            raise RecordError(f"group {gid}: a token with loss_mask 1 has no generating version")
        finite = _all_finite(self.rollout_logprobs) and _all_finite(self.rewards)
        if not finite or (self.advantages is not None and not _all_finite(self.advantages)):
            raise RecordError(f"group {gid}: non-finite logprob, reward or advantage")

    def __eq__(self, other: object) -> bool:
        """Exact equality of every field (arrays element-wise, dtypes included)."""
        if not isinstance(other, TrajectoryGroup):
            return NotImplemented
        if (self.group_id, self.finish_reasons, self.metadata) != (
            other.group_id,
            other.finish_reasons,
            other.metadata,
        ):
            return False
        for name, _ in ARRAY_FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if (a is None) != (b is None):
                return False
            if a is not None and (a.dtype != b.dtype or not np.array_equal(a, b)):
                return False
        a, b = self.routes, other.routes
        if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
            return False
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable record with array fields

    # -- views -------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.response_lengths)

    @property
    def num_tokens(self) -> int:
        """Response tokens in the group (prompt tokens not counted)."""
        return int(_SUM(self.response_lengths))

    @property
    def nbytes(self) -> int:
        """Bytes held by the array fields (what the codec sends as side buffers)."""
        routes = 0 if self.routes is None else self.routes.nbytes
        return routes + sum(
            getattr(self, k).nbytes for k, _ in ARRAY_FIELDS if getattr(self, k) is not None
        )

    def offsets(self) -> np.ndarray:
        """Start of each response in the flat arrays, plus the end: length n + 1."""
        return np.concatenate([[0], np.cumsum(self.response_lengths, dtype=np.int64)])

    def response(self, i: int, name: str = "response_ids") -> np.ndarray:
        """One response's slice of a flat token field (a view, not a copy)."""
        off = self.offsets()
        return getattr(self, name)[off[i] : off[i + 1]]

    def route_block(self, i: int) -> np.ndarray:
        """Response i's routes [P + R_i, layers * top_k] (a view; `routes` must be set)."""
        if self.routes is None:
            raise RecordError(f"group {self.group_id} carries no routes")
        start = i * len(self.prompt_ids) + int(self.offsets()[i])
        return self.routes[start : start + len(self.prompt_ids) + int(self.response_lengths[i])]

    def min_version(self) -> int:
        """The oldest policy version that generated any token here (staleness is measured
        from it); `NOT_GENERATED` if the group holds no generated token."""
        generated = self.versions[self.versions != NOT_GENERATED]
        return int(generated.min()) if generated.size else NOT_GENERATED

    def max_version(self) -> int:
        generated = self.versions[self.versions != NOT_GENERATED]
        return int(generated.max()) if generated.size else NOT_GENERATED

    @classmethod
    def from_responses(
        cls,
        group_id: str,
        prompt_ids: Sequence[int] | np.ndarray,
        responses: Sequence[Mapping[str, Any]],
        metadata: dict[str, Any] | None = None,
    ) -> TrajectoryGroup:
        """Build from per-response dicts with keys `response_ids`, `rollout_logprobs`,
        `versions`, `reward`, `finish_reason` and optionally `loss_mask`, `advantages`
        (advantages are kept only if every response has them), and `routes` ([rows, layers *
        top_k], the rows the engine recorded from position 0: kept, padded with `UNROUTED` to
        the response's P + R positions, only if every response has them)."""
        cat = _concat_field
        has_adv = bool(responses) and all("advantages" in r for r in responses)
        ones = [{"loss_mask": np.ones(len(r["response_ids"]), np.uint8), **r} for r in responses]
        return cls(
            group_id=group_id,
            prompt_ids=np.asarray(prompt_ids),
            response_lengths=np.array([len(r["response_ids"]) for r in responses], np.int64),
            response_ids=cat(responses, "response_ids", np.int32),
            rollout_logprobs=cat(responses, "rollout_logprobs", np.float32),
            loss_mask=cat(ones, "loss_mask", np.uint8),
            versions=cat(responses, "versions", np.int32),
            rewards=np.array([r["reward"] for r in responses], np.float64),
            finish_reasons=[r["finish_reason"] for r in responses],
            advantages=cat(responses, "advantages", np.float32) if has_adv else None,
            metadata=dict(metadata or {}),
            routes=_route_blocks(len(prompt_ids), responses),
        )

    def iter_responses(self) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            yield {name: self.response(i, name) for name, _ in TOKEN_FIELDS}


# Reductions called as ufuncs: `a.min()` goes through numpy's Python-level wrapper first.
_MIN, _MAX, _SUM = np.minimum.reduce, np.maximum.reduce, np.add.reduce
_ALL, _ISFINITE = np.logical_and.reduce, np.isfinite
# Up to this many elements, `tolist()` and Python builtins beat numpy's per-call overhead
# (rewards and response_lengths have one entry per response: ~8).
_SMALL = 32


def _lowest(a: np.ndarray) -> int:
    return int(_MIN(a)) if a.size else 0


def _min_and_sum(a: np.ndarray) -> tuple[int, int]:
    """(min, sum) of an integer array as Python ints; (0, 0) if empty. Python ints are exact,
    and numpy sums int32 in int64, which n int32 lengths cannot overflow."""
    if len(a) <= _SMALL:
        values = a.tolist()
        return min(values, default=0), sum(values)
    return int(_MIN(a)), int(_SUM(a))


def _all_finite(a: np.ndarray) -> bool:
    # Not `isfinite(a.sum(dtype=float64))`: measured slower (the casting reduction is
    # buffered), and inf + -inf would emit a RuntimeWarning from a validation check.
    if len(a) <= _SMALL:
        return all(map(math.isfinite, a.tolist()))
    return bool(_ALL(_ISFINITE(a)))


def _concat_field(responses: Sequence[Mapping[str, Any]], key: str, dtype: type) -> np.ndarray:
    # Concatenate in the source dtype; the exact cast to `dtype` happens in `_as_1d`.
    parts = [np.asarray(r[key]) for r in responses]
    if any(p.ndim != 1 for p in parts):
        raise RecordError(f"{key} of every response must be 1-D")
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _route_blocks(prompt_len: int, responses: Sequence[Mapping[str, Any]]) -> np.ndarray | None:
    """The responses' recorded routes, each padded with `UNROUTED` to its P + R rows."""
    if not responses or not all(r.get("routes") is not None for r in responses):
        return None
    recorded = [np.asarray(r["routes"]) for r in responses]
    if any(a.ndim != 2 for a in recorded):
        raise RecordError("routes of every response must be 2-D [positions, layers * top_k]")
    widths = {a.shape[1] for a in recorded if len(a)}  # an empty one (no position) has none
    if len(widths) > 1:
        raise RecordError(f"routes of one group must have one width, got {sorted(widths)}")
    if not widths:
        return None
    width = widths.pop()
    blocks = []
    for r, a in zip(responses, recorded, strict=True):
        rows = prompt_len + len(r["response_ids"])
        if len(a) > rows:
            raise RecordError(f"{len(a)} routed positions for a response of {rows} tokens")
        block = np.full((rows, width), UNROUTED, np.uint8)
        if len(a):
            block[: len(a)] = _as_routes(a)
        blocks.append(block)
    return np.concatenate(blocks)


def _as_routes(value: Any) -> np.ndarray:
    """`value` as the C-contiguous uint8 2-D array `routes` holds (cast only when exact)."""
    arr = np.asarray(value)
    if arr.ndim != 2:
        raise RecordError(f"routes must be 2-D [positions, layers * top_k], got {arr.shape}")
    if arr.dtype != np.uint8:
        if arr.size and arr.dtype.kind not in "iu":
            raise RecordError(f"routes must hold integers, got dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > UNROUTED):
            raise RecordError(f"routes must hold expert ids in [0, {UNROUTED}]")
    return np.ascontiguousarray(arr, dtype=np.uint8)


_DTYPES: dict[type, np.dtype] = {t: np.dtype(t) for _, t in ARRAY_FIELDS}


def _as_1d(value: Any, dtype: type, name: str) -> np.ndarray:
    want = _DTYPES[dtype]
    if (  # fast path (decoded wire arrays): already what we keep, kept as is, no copy
        type(value) is np.ndarray
        and value.dtype == want
        and value.ndim == 1
        and value.flags.c_contiguous
    ):
        return value
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise RecordError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype == want:
        return np.ascontiguousarray(arr)
    if arr.size and arr.dtype.kind not in "biuf":
        raise RecordError(f"{name} must be numeric, got dtype {arr.dtype}")
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.ascontiguousarray(arr, dtype=dtype)
    # Integer targets: the cast must be exact (no truncated floats, no wrapped overflow).
    if out.dtype.kind in "iu" and arr.size and not np.array_equal(out, arr):
        raise RecordError(f"{name}: values do not fit {np.dtype(dtype).name} exactly")
    return out
