"""Engine side of the weight update: join update groups, receive broadcasts, load by HF name.

Blocking methods; the HTTP server runs them in a worker thread while the endpoint awaits.
A receive always takes part in the broadcast the sender started (when the metadata can be
laid out at all, within the model's own size), even if a name, shape or dtype is wrong:
skipping it would stall the sender until its timeout.

Nothing reaches the model unchecked: every bucket lands in memory of its own first (a
flattened bucket in reused staging memory; per-tensor buckets in one shadow tensor per
parameter); names, shapes and dtypes must match the model exactly (no silent casts) and
floating values must be finite, or the whole bucket is refused naming the first bad tensor and
the model is untouched. Only then is it loaded, under the engine's `step_lock`, so a load never
interleaves with a step: a flattened bucket is copied in; a per-tensor one is swapped in (the
parameter takes the shadow's storage and its old storage becomes the shadow), so the per-tensor
path (gloo's default for large tensors) costs no copy, at the price of a second copy of the
weights in memory once it is used. A failed sync may leave the buckets before it loaded
(weights/sync.py): the weight version is not bumped, and only a full sync serves a new one.

LoRA (adapter-only syncs, `asyncrl.learner.lora`): a tensor named `M.lora_A.weight` [r, in] or
`M.lora_B.weight` [out, r] (B carrying the LoRA scaling) belongs to the linear layer whose
weight is `M.weight`. A layer's first adapter keeps a pristine copy of its weight W0; whenever
both halves of this sync have arrived (any bucket order), the layer becomes W0 + B·A, computed
in fp32 from the pristine copy, so repeated syncs never accumulate rounding. A full update of
`M.weight` replaces W0 (the next adapter lands on the new base).

Mixture of experts: transformers holds a layer's experts fused (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]), its checkpoints (and SGLang) name them one by
one (`mlp.experts.<e>.gate_proj.weight` [I, H], `up_proj`, `down_proj`). Both are taken: a
per-expert tensor is copied into its slice of the fused parameter (`expert_slice`), never
swapped in.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter

import torch

from asyncrl.engine.hf.batch import show
from asyncrl.engine.hf.engine import HFEngine
from asyncrl.weights.buckets import (
    LORA_A,
    LORA_B,
    BucketLayoutError,
    StagingBuffer,
    dtype_name,
    flat_layout,
    lora_half,
    parse_dtype,
    parse_shape,
    unflatten_bucket,
)
from asyncrl.weights.group import GroupError, broadcast, create_group, destroy_group

log = logging.getLogger(__name__)
_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def expert_slice(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The slice of a fused experts parameter that checkpoint name `name` (one expert's gate,
    up or down projection) is, as a view; None for any other name."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    fused = params.get(f"{prefix}.{'down_proj' if kind == 'down' else 'gate_up_proj'}")
    if fused is None or fused.dim() != 3 or e >= fused.shape[0]:
        return None
    if kind == "down":
        return fused[e]
    half = fused.shape[1] // 2  # transformers' [gate; up] rows of each expert
    return fused[e, :half] if kind == "gate" else fused[e, half:]


class WeightReceiver:
    def __init__(self, engine: HFEngine, *, tp_rank: int = 0) -> None:
        self.engine = engine
        self.tp_rank = tp_rank
        # remove_duplicate=False: tied weights answer to every HF name (e.g. lm_head.weight).
        self.params = dict(engine.model.named_parameters(remove_duplicate=False))
        self.groups: dict[str, tuple[torch.distributed.ProcessGroup, str]] = {}
        # Host memory for flattened buckets, kept between syncs (see StagingBuffer).
        self.staging = StagingBuffer()
        # Per-tensor buckets: one receive buffer per parameter name, swapped with the parameter.
        self.shadows: dict[str, torch.Tensor] = {}
        # The largest bucket a real sender can send: every parameter once (tied ones under each
        # name), plus alignment. Anything bigger is refused before allocating a byte for it.
        # An adapter (A + B of every layer at the largest meaningful rank) is at most twice that.
        self.max_bucket_bytes = 2 * sum(
            p.numel() * p.element_size() + 8 for p in self.params.values()
        )
        self.pristine: dict[str, torch.Tensor] = {}  # LoRA: layer weight name -> its W0
        self.pending: dict[str, torch.Tensor] = {}  # LoRA halves waiting for their partner
        # An update into a running (unpaused) engine: every bucket received and checked, none
        # loaded until the one carrying the version (see `update`).
        self.deferred: list[tuple[list, list[torch.Tensor], bool]] = []
        # A receive the sender gave up on cannot be interrupted (gloo waits out the group
        # timeout), so `abandon` disowns it: `epoch` moves on and the receive, whenever it
        # returns, changes nothing. `state` orders abandons against the receive's commit.
        self.epoch = 0
        self.state = threading.Lock()
        # buckets received by their load_format (flattened_bucket, or tensors: one broadcast
        # per tensor), as the sender asked for them (/server_info reports them)
        self.bucket_formats: Counter[str] = Counter()

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
        self.pending.clear()  # a new group starts a new sender: no half waits across it
        self.deferred.clear()
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        entry = self.groups.pop(group_name, None)
        if entry is None:
            return False, "The group to be destroyed does not exist."
        destroy_group(entry[0])
        return True, "Succeeded to destroy custom process group."

    def update(
        self,
        names: list,
        dtypes: list,
        shapes: list,
        group_name: str,
        load_format: str | None,
        version: str | None = None,
    ) -> tuple[bool, str]:
        """Receive one bucket from rank 0 and load it; (success, one-line message). `version`
        (the last bucket's): the engine reports it from the step the bucket loads in.

        A paused engine loads each bucket as it arrives. A running one (the sender did not
        pause it: `async.pause_mode: none`) must never step on half-updated weights, so every
        bucket is received and checked but held, and the one carrying the version loads them
        all, and sets the version, under one `step_lock`: between two steps, the tokens before
        it carry the old version and the tokens after it the new one."""
        epoch, entry = self.epoch, self.groups.get(group_name)  # an abandon moves the epoch on
        if entry is None:
            return False, f"group {group_name!r} not initialised; call init_weights_update_group"
        layout = self._layout(names, dtypes, shapes, load_format)
        if isinstance(layout, str):
            return False, layout
        (tdtypes, tshapes, total), (pg, backend) = layout, entry
        device = torch.device("cpu") if backend == "gloo" else self.engine.device
        # Swap-in needs known names and the receive device to be the parameters' own.
        per_tensor = load_format is None and self._check(names, tdtypes, tshapes) is None
        per_tensor = per_tensor and not any(lora_half(n) for n in names)  # adapters are staged
        per_tensor = per_tensor and all(self._param(n).device == device for n in names)
        hold = not self.engine.paused and version is None  # a running engine, more to come
        flattened = load_format == "flattened_bucket"
        with self.state:  # an abandon after this leaves these buffers to this receive
            if epoch != self.epoch:  # abandoned before it began
                return False, abandoned(group_name)
            tensors, payload = self._buffers(
                names, tdtypes, tshapes, total, per_tensor, flattened, device, hold
            )
        try:
            broadcast(payload, pg, src=0)
        except GroupError as e:
            with self.state:
                if epoch != self.epoch:
                    return False, abandoned(group_name)
                # A failed collective leaves the group unusable: drop it so a re-init can succeed.
                self.groups.pop(group_name, None)
                self.deferred.clear()
            destroy_group(pg)
            return False, f"receive on group {group_name!r} failed (group dropped): {e}"
        with self.state:
            if epoch != self.epoch:
                return False, abandoned(group_name)
            flat = payload[0] if flattened else None
            self.bucket_formats["flattened_bucket" if flattened else "tensors"] += 1
            return self._commit(names, tdtypes, tshapes, tensors, per_tensor, hold, version, flat)

    def _layout(self, names, dtypes, shapes, load_format) -> tuple[list, list, int] | str:
        """The bucket's torch dtypes, shapes and byte size, or why it cannot be received (its
        buffers could not be sized, so it could not join the broadcast)."""
        if load_format not in (None, "flattened_bucket"):
            return f"unsupported load_format {load_format!r}"
        if not (isinstance(names, list) and len(names) == len(dtypes) == len(shapes) > 0):
            return "names, dtypes and shapes must be non-empty lists of equal length"
        try:
            tdtypes = [parse_dtype(d) for d in dtypes]
            tshapes = [parse_shape(s) for s in shapes]
        except BucketLayoutError as e:
            return f"bad bucket metadata: {e}"
        total = flat_layout(tdtypes, tshapes)[1]
        if total > self.max_bucket_bytes:  # no real bucket is bigger than the model itself
            return f"bucket of {total} bytes exceeds the model's {self.max_bucket_bytes}"
        return tdtypes, tshapes, total

    def _buffers(self, names, dtypes, shapes, total, per_tensor, flattened, device, hold) -> tuple:
        """(the bucket's tensors, what the broadcast fills). Per tensor: the parameters'
        shadows; else views into the staging buffer (one of their own when `hold`: the next
        bucket reuses the staging one), filled by one broadcast (flattened_bucket) or one per
        tensor, in order (the sender's two layouts)."""
        if per_tensor:
            tensors = [self._shadow(n, device) for n in names]
            return tensors, tensors
        if hold:
            buf = torch.empty(total, dtype=torch.uint8, device=device)
        else:
            buf = self.staging.get(total, device)
        tensors = unflatten_bucket(buf, dtypes, shapes)
        return tensors, [buf] if flattened else tensors

    def _commit(self, names, dtypes, shapes, tensors, per_tensor, hold, version, flat) -> tuple:
        """A received bucket: checked, then held or loaded (with every bucket held before it).
        `flat`: the flattened bucket's buffer (None: received per tensor)."""
        problem = self._check(names, dtypes, shapes) or _non_finite(names, tensors, flat)
        if problem is None:
            self.deferred.append((names, tensors, per_tensor))
            if not hold:
                self._load(version)
        self.staging.finish()
        if problem:
            self.pending.clear()  # a half held from an earlier bucket must not pair across syncs
            self.deferred.clear()  # nor a held bucket load with a later sync's
            return False, f"bucket rejected, model unchanged: {problem}"
        return True, f"Succeeded to update {len(names)} parameters online."

    def abandon(self, group_name: str) -> tuple[bool, str]:
        """Drop `group_name` while a receive on it is still in flight (in another thread): the
        sender destroyed the group, so no bytes will come, but gloo cannot interrupt the wait
        short of the group's timeout. The receive keeps the buffers it writes into (fresh
        staging and shadows from here on), and whatever it returns changes nothing."""
        with self.state:
            self.epoch += 1
            self.staging, self.shadows = StagingBuffer(), {}
            self.pending.clear()  # this sync's halves and held buckets: it will never finish
            self.deferred.clear()
            entry = self.groups.pop(group_name, None)
        if entry is not None:
            destroy_group(entry[0])
        return True, "Succeeded to destroy custom process group (its receive in flight abandoned)."

    def _load(self, version: str | None) -> None:
        """Load every held bucket (and set `version`, if given) between two engine steps."""
        deferred, self.deferred = self.deferred, []
        with self.engine.step_lock, torch.no_grad():
            self.engine.keep_pinned()  # requests pinned to the outgoing weights keep a copy
            for names, tensors, per_tensor in deferred:
                for name, t in zip(names, tensors):
                    if lora_half(name):
                        self._lora(name, t)
                        continue
                    self.pristine.pop(name, None)  # a full update is the new base
                    if name not in self.params:  # one expert's slice of a fused parameter
                        expert_slice(self.params, name).copy_(t)
                    elif per_tensor:  # swap storages: the old weights become the next buffer
                        param = self.params[name]
                        self.shadows[name], param.data = param.data, t
                    else:
                        self.params[name].copy_(t)
            if version is not None:
                self.engine.weight_version = version

    def _shadow(self, name: str, device: torch.device) -> torch.Tensor:
        """The receive buffer of parameter `name` (its shape, dtype and device)."""
        param = self._param(name)
        buf = self.shadows.get(name)
        if buf is None or buf.device != device:
            buf = self.shadows[name] = torch.empty_like(param, device=device)
        return buf

    def _lora(self, name: str, tensor: torch.Tensor) -> None:
        """Hold one adapter half; with its partner here, load W0 + B·A into the layer."""
        half, target = lora_half(name)
        partner = target.removesuffix("weight") + (LORA_B if half == LORA_A else LORA_A)
        other = self.pending.pop(partner, None)
        if other is None:  # the staging buffer is reused by the next bucket: keep a copy
            self.pending[name] = tensor.clone()
            return
        a, b = (tensor, other) if half == LORA_A else (other, tensor)
        param = self.params[target]
        if target not in self.pristine:
            self.pristine[target] = param.detach().clone()
        base = self.pristine[target]
        if param.dtype == torch.float32:  # W0 + B·A straight into the weight, no temporaries
            torch.addmm(base, b, a, out=param.data)
        else:  # bf16/fp16 weights: summed in fp32, rounded once
            param.copy_(torch.addmm(base.float(), b.float(), a.float()).to(param.dtype))

    def _check_lora(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], ranks: dict[str, int]
    ) -> str | None:
        """An adapter half must fit its layer: A [r, in], B [out, r], the layer's dtype,
        1 <= r <= min(out, in), and its partner's r (`ranks`: the halves seen so far)."""
        half, target = lora_half(name)
        param = self.params.get(target)
        if param is None or param.dim() != 2:
            return f"adapter tensor {show(name)} names no linear layer weight {show(target)}"
        out, inp = param.shape
        rank = shape[0] if half == LORA_A else shape[-1]
        want = (rank, inp) if half == LORA_A else (out, rank)
        partner = target.removesuffix("weight") + (LORA_B if half == LORA_A else LORA_A)
        held = ranks.get(partner)
        if len(shape) != 2 or shape != want or not 1 <= rank <= min(out, inp):
            return f"shape mismatch for {name!r}: sent {list(shape)}, layer is [{out}, {inp}]"
        if held is not None and held != rank:
            return f"rank mismatch for {name!r}: its partner {partner!r} has rank {held}"
        ranks[name] = rank
        if param.dtype != dtype:
            return f"dtype mismatch for {name!r}: sent {dtype_name(dtype)}, layer has " + (
                dtype_name(param.dtype)
            )
        return None

    def _param(self, name: str) -> torch.Tensor:
        """Parameter `name`, or the expert slice a checkpoint name stands for."""
        param = self.params.get(name)
        return param if param is not None else expert_slice(self.params, name)

    def _check(self, names: list, dtypes: list, shapes: list[tuple[int, ...]]) -> str | None:
        known = [isinstance(n, str) and (n in self.params or lora_half(n)
                                         or expert_slice(self.params, n) is not None)
                 for n in names]  # fmt: skip
        unknown = [n for n, k in zip(names, known) if not k]
        if unknown:
            return f"{len(unknown)} unknown parameter name(s), first {show(unknown[0])}"
        # the halves held from earlier buckets (waiting for a partner, or in a bucket held
        # for a running engine), then this bucket's, in order
        held = [*self.pending.items()] + [
            (n, t) for names_, tensors, _ in self.deferred
            for n, t in zip(names_, tensors) if lora_half(n)
        ]  # fmt: skip
        ranks = {n: int(t.shape[0] if n.endswith(LORA_A) else t.shape[1]) for n, t in held}
        for name, dtype, shape in zip(names, dtypes, shapes):
            if lora_half(name):
                if problem := self._check_lora(name, dtype, shape, ranks):
                    return problem
                continue
            param = self._param(name)
            if tuple(param.shape) != shape:
                return (
                    f"shape mismatch for {name!r}: sent {list(shape)}, "
                    f"model has {list(param.shape)}"
                )
            if param.dtype != dtype:
                return f"dtype mismatch for {name!r}: sent {dtype_name(dtype)}, model has " + (
                    dtype_name(param.dtype)
                )
        return None


def abandoned(group_name: str) -> str:
    """The reply to a receive that `WeightReceiver.abandon` disowned."""
    return f"receive on group {group_name!r} abandoned: the sender destroyed the group"


def _non_finite(
    names: list, tensors: list[torch.Tensor], flat: torch.Tensor | None = None
) -> str | None:
    """The first tensor holding NaN or inf: loading it would poison every later sample.

    One reduction per tensor, no mask allocated: a NaN or inf anywhere makes the fp32 sum
    non-finite. (Finite weights large enough to overflow that sum, |w| ~ 1e30, are refused
    too: they would overflow the forward pass anyway.) A flattened bucket (`flat`, its uint8
    buffer) of one floating dtype is summed whole first: one reduction instead of one per
    tensor (on a small model's ~26 tensors, a third of a millisecond of every sync); a NaN
    or inf anywhere makes that sum non-finite too, and only then is each tensor looked at,
    to name the first bad one."""
    if flat is not None and len({t.dtype for t in tensors}) == 1 and tensors[0].is_floating_point():
        if bool(torch.isfinite(flat.view(tensors[0].dtype).sum(dtype=torch.float32))):
            return None
    for name, t in zip(names, tensors):
        if t.is_floating_point() and not bool(torch.isfinite(t.sum(dtype=torch.float32))):
            return f"non-finite values (NaN or inf) in {name!r}"
    return None
