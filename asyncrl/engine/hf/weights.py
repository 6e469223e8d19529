"""Engine side of the weight update: join update groups, receive broadcasts, load by HF name.

Blocking methods; the HTTP server runs them in a worker thread while the endpoint awaits.
A receive always takes part in the broadcast the sender started (when the metadata can be
laid out at all), even if a name or shape is wrong: skipping it would stall the sender until
its timeout. Validation happens before anything is received, so a rejected bucket leaves the
model untouched; loading takes the engine's `step_lock` so it never interleaves with a step.

Per-tensor buckets whose names, shapes, dtypes and device all match are received straight into
the parameters (no staging copy); anything else lands in staging memory and is copied in. A
collective that fails half way may leave such a bucket half written, as a failed sync may
leave the buckets before it (weights/sync.py): the group is dropped, the weight version is not
bumped, and only a full sync on a new group serves a new version.
"""

from __future__ import annotations

import logging

import torch

from asyncrl.engine.hf.engine import HFEngine
from asyncrl.weights.buckets import (
    BucketLayoutError,
    StagingBuffer,
    flat_layout,
    parse_dtype,
    parse_shape,
    unflatten_bucket,
)
from asyncrl.weights.group import GroupError, broadcast, create_group, destroy_group

log = logging.getLogger(__name__)


class WeightReceiver:
    def __init__(self, engine: HFEngine, *, tp_rank: int = 0) -> None:
        self.engine = engine
        self.tp_rank = tp_rank
        # remove_duplicate=False: tied weights answer to every HF name (e.g. lm_head.weight).
        self.params = dict(engine.model.named_parameters(remove_duplicate=False))
        self.groups: dict[str, tuple[torch.distributed.ProcessGroup, str]] = {}
        # Host memory for flattened buckets, kept between syncs (see StagingBuffer).
        self.staging = StagingBuffer()

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> tuple[bool, str]:
        if not group_name:
            return False, "group_name must not be empty"
        if group_name in self.groups:
            return False, f"group {group_name!r} already exists; destroy it first"
        rank = rank_offset + self.tp_rank
        try:
            pg = create_group(
                backend, master_address, master_port, rank, world_size, group_name, timeout_s
            )
        except GroupError as e:
            return False, f"Failed to initialize custom process group: {e}"
        self.groups[group_name] = (pg, backend)
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        entry = self.groups.pop(group_name, None)
        if entry is None:
            return False, "The group to be destroyed does not exist."
        destroy_group(entry[0])
        return True, "Succeeded to destroy custom process group."

    def update(
        self, names: list, dtypes: list, shapes: list, group_name: str, load_format: str | None
    ) -> tuple[bool, str]:
        """Receive one bucket from rank 0 and load it; (success, one-line message)."""
        if group_name not in self.groups:
            return False, f"group {group_name!r} not initialised; call init_weights_update_group"
        if load_format not in (None, "flattened_bucket"):
            return False, f"unsupported load_format {load_format!r}"
        if not (isinstance(names, list) and len(names) == len(dtypes) == len(shapes) > 0):
            return False, "names, dtypes and shapes must be non-empty lists of equal length"
        try:
            tdtypes = [parse_dtype(d) for d in dtypes]
            tshapes = [parse_shape(s) for s in shapes]
        except BucketLayoutError as e:  # cannot size the buffers: cannot join the broadcast
            return False, f"bad bucket metadata: {e}"
        pg, backend = self.groups[group_name]
        problem = self._check(names, tshapes)
        device = torch.device("cpu") if backend == "gloo" else self.engine.device
        direct = None if problem or load_format else self._direct(names, tdtypes, device)
        try:
            if direct is not None:  # straight into the parameters: no step may read them now
                with self.engine.step_lock:
                    broadcast(direct, pg, src=0)
                return True, f"Succeeded to update {len(names)} parameters online."
            tensors = self._receive(pg, tdtypes, tshapes, load_format, device)
        except GroupError as e:
            # A failed collective leaves the group unusable: drop it so a re-init can succeed.
            self.groups.pop(group_name, None)
            destroy_group(pg)
            return False, f"receive on group {group_name!r} failed (group dropped): {e}"
        if problem:
            return False, f"bucket rejected, model unchanged: {problem}"
        with self.engine.step_lock, torch.no_grad():
            for name, t in zip(names, tensors):
                self.params[name].copy_(t)
        self.staging.finish()
        return True, f"Succeeded to update {len(names)} parameters online."

    def _direct(self, names: list, dtypes: list, device: torch.device) -> list | None:
        """The parameters themselves as receive buffers, when every one matches exactly."""
        params = [self.params[n] for n in names]
        if all(
            p.dtype == d and p.device == device and p.is_contiguous()
            for p, d in zip(params, dtypes)
        ):
            return [p.detach() for p in params]
        return None

    def _receive(self, pg, dtypes, shapes, load_format, device) -> list[torch.Tensor]:
        if load_format == "flattened_bucket":
            _, total = flat_layout(dtypes, shapes)
            buf = self.staging.get(total, device)
            broadcast([buf], pg, src=0)
            return unflatten_bucket(buf, dtypes, shapes)
        tensors = [torch.empty(s, dtype=d, device=device) for d, s in zip(dtypes, shapes)]
        broadcast(tensors, pg, src=0)
        return tensors

    def _check(self, names: list, shapes: list[tuple[int, ...]]) -> str | None:
        unknown = [n for n in names if not isinstance(n, str) or n not in self.params]
        if unknown:
            return f"{len(unknown)} unknown parameter name(s), first {unknown[0]!r}"
        for name, shape in zip(names, shapes):
            have = tuple(self.params[name].shape)
            if have != shape:
                return f"shape mismatch for {name!r}: sent {list(shape)}, model has {list(have)}"
        return None
