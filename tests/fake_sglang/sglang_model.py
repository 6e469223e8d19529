"""SGLang's own Qwen2 model and weight loaders, run on the CPU on what asyncrl sends.

The test side (`run_loader`, on a release unpacked by `tests/fake_sglang/wheels.py`, which
fetches the wheel: a failure fails the test unless `ASYNCRL_SKIP_UPSTREAM=1`) runs this file as a script in
a subprocess (SGLang's process-wide runtime context and the stubs below stay out of the test
process). The script side builds `sglang.srt.models.qwen2.Qwen2ForCausalLM` with SGLang's real
layers (QKV/MergedColumn/RowParallelLinear, VocabParallelEmbedding, their `weight_loader`s) for
each engine rank asked for, receives every bucket as SGLang 0.5.23's
`WeightUpdater.receive_weights_from_distributed` does (a `flattened_bucket` through its own
`FlattenedTensorBucket.empty(...).reconstruct_tensors()` over the exact bytes asyncrl
broadcasts; per tensor into `torch.empty(shape, dtype=getattr(torch, dtype))`), and hands each
bucket to `model.load_weights` (what `load_weights_from_distributed` calls), with the legacy
loader or the v2 one (`SGLANG_ENABLE_WEIGHT_LOADER_V2`).

Faked, and only at the edges: third-party modules that cannot be imported here (GPU kernels:
triton, tvm_ffi, sgl_kernel; packages not installed: torchvision, sentencepiece, gguf,
compressed_tensors; pybase64 and dill answered by the standard library's base64 and pickle),
the package's `__init__` (the frontend language API, not the runtime) and the process groups: a
rank's TP placement is SGLang's own `publish(ServerArgs(tp_size=...), ranks=SpawnRanks(...))`
with group handles that carry only rank and width (as SGLang's own `sglang.test.parallel_groups`
does), since nothing here communicates.

    python sglang_model.py SRC_DIR REQUEST_DIR   # writes REQUEST_DIR/result.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

#: Importable only on an accelerator host or with packages this environment lacks.
STUBBED = ("triton", "tvm_ffi", "sgl_kernel", "torchvision", "sentencepiece", "gguf",
           "compressed_tensors", "pybase64", "dill", "openai", "einops", "partial_json_parser")  # fmt: skip


# ---- test side -------------------------------------------------------------------------------
def run_loader(src: Path, request: Path, timeout_s: float = 600) -> dict:
    """Run this file on `request` (see `main`) against the sources in `src`; its result."""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, __file__, str(src), str(request)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads((request / "result.json").read_text())


# ---- script side: stubs ----------------------------------------------------------------------
class Inert:
    """Any attribute, call or decorator of a stubbed module: does nothing, is falsy."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @decorator
        return Inert(self._name + "()")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Inert(f"{self._name}.{name}")

    def __bool__(self) -> bool:
        return False


def any_schema(cls, source, handler):
    """Pydantic models of the wheel that name a stubbed class as a field type take anything."""
    from pydantic_core import core_schema

    return core_schema.any_schema()


class InertClass(type):
    """A stubbed module's class: subclassable, any class attribute an `Inert`."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Inert(f"{cls.__name__}.{name}")


class StubModule(types.ModuleType):
    """A stubbed module: classes for capitalised names, `Inert` for the rest."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():  # a class: subclassable, any class attribute
            return InertClass(name, (), {
                "__module__": self.__name__,
                "__init_subclass__": classmethod(lambda cls, **kw: None),  # total=False
                "__get_pydantic_core_schema__": classmethod(any_schema),  # a field type
            })  # fmt: skip
        return Inert(f"{self.__name__}.{name}")


def install_stubs(src: Path) -> None:
    """Make `import sglang.srt...` work from `src` on this CPU-only host (see module doc)."""
    import base64
    import importlib.machinery
    import pickle

    # Loaded before the stubs exist, so their availability checks see the truth.
    import torch._inductor.compile_fx  # noqa: F401 - SGLang calls torch.compile at import
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor  # noqa: F401

    del transformers

    class Finder:
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] in STUBBED:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            if spec.name == "pybase64":
                return base64
            if spec.name == "dill":
                return pickle
            module = StubModule(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module) -> None:
            pass

    sys.meta_path.insert(0, Finder())
    package = types.ModuleType("sglang")  # the runtime only, not the frontend `__init__`
    package.__path__ = [str(src / "sglang")]
    sys.modules["sglang"] = package


# ---- script side: an engine rank, its receive and load -------------------------------------
def publish_rank(tp: int, rank: int) -> None:
    """SGLang's runtime context of TP rank `rank` of `tp` (see the module docstring)."""
    from types import SimpleNamespace

    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=tp, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=rank))  # fmt: skip
    parallel = get_parallel()

    def group(r: int, n: int) -> SimpleNamespace:
        return SimpleNamespace(rank_in_group=r, world_size=n, is_first_rank=r == 0,
                               is_last_rank=r == n - 1, cpu_group=None, device_group=None)  # fmt: skip

    kinds = ("tp", "pp", "moe_ep", "moe_dp", "moe_tp", "attn_tp", "attn_cp")
    groups = {f"{k}_group": group(getattr(parallel, f"{k}_rank"), getattr(parallel, f"{k}_size"))
              for k in kinds}  # fmt: skip
    groups.update(world_group=group(rank, tp), shared_experts_tp_group=groups["tp_group"])
    parallel.override_permanently(**groups)


def build_model(config: dict, dtype):
    """SGLang's Qwen2ForCausalLM for the published rank, every parameter NaN (unwritten)."""
    import torch
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM
    from transformers import Qwen2Config

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as SGLang's loader builds it (`set_default_torch_dtype`)
    try:
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return model


def receive(bucket: dict, payload: list):
    """One bucket as SGLang 0.5.23's `receive_weights_from_distributed` receives it, the
    broadcast being a copy of what asyncrl broadcasts (`payload`: one flat uint8 buffer, or
    one tensor per name), which must fit exactly."""
    import torch
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    names, dtypes, shapes = bucket["names"], bucket["dtypes"], bucket["shapes"]
    if bucket["load_format"] == "flattened_bucket":
        received = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        flat, (wire,) = received.get_flattened_tensor(), payload
        if flat.shape != wire.shape or flat.dtype != wire.dtype:
            raise ValueError(f"bucket of {flat.numel()} bytes, asyncrl sent {wire.numel()}")
        flat.copy_(wire)
        return received.reconstruct_tensors()
    out = []
    for name, dtype, shape, tensor in zip(names, dtypes, shapes, payload, strict=True):
        buf = torch.empty(shape, dtype=getattr(torch, dtype))
        if buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            raise ValueError(f"{name}: announced {dtype}{shape}, sent {tensor.dtype}{tensor.shape}")
        buf.copy_(tensor)
        out.append((name, buf))
    return out


def expected_region(name: str, full, params: dict, cfg: dict, tp: int, rank: int):
    """(parameter, its rows/columns that `full` lands in on this rank, those values) by the
    Megatron-style TP layout SGLang serves; None when no parameter takes `name`."""
    import torch

    heads, kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    hd = cfg.get("head_dim") or hidden // heads
    prefix, _, leaf = name.rpartition(".")
    module = prefix.rpartition(".")[2]
    if module in ("q_proj", "k_proj", "v_proj"):
        target = prefix.rpartition(".")[0] + ".qkv_proj." + leaf
        q_rows, kv_rows = heads * hd // tp, max(1, kv // tp) * hd
        if module == "q_proj":
            return target, (0, q_rows), full.chunk(tp)[rank]
        head = rank * kv // tp  # KV heads replicate when there are fewer than ranks
        shard = full.chunk(tp)[rank] if kv >= tp else full[head * hd : (head + 1) * hd]
        start = q_rows + (0 if module == "k_proj" else kv_rows)
        return target, (start, start + kv_rows), shard
    if module in ("gate_proj", "up_proj"):
        target = prefix.rpartition(".")[0] + ".gate_up_proj." + leaf
        rows = cfg["intermediate_size"] // tp
        start = 0 if module == "gate_proj" else rows
        return target, (start, start + rows), full.chunk(tp)[rank]
    if name not in params:
        return None
    if module in ("o_proj", "down_proj"):
        return name, None, full.chunk(tp, dim=1)[rank]
    if module in ("embed_tokens", "lm_head"):
        per = params[name].shape[0]  # the padded vocabulary's share; rows past it are zeros
        part = full[rank * per : (rank + 1) * per]
        pad = full.new_zeros(per - part.shape[0], *full.shape[1:])
        return name, None, torch.cat([part, pad])
    return name, None, full


def check(model, sent: dict, cfg: dict, tp: int, rank: int) -> dict:
    """What did not land: parameters still NaN, sent tensors missing from their place."""
    import torch

    params = dict(model.named_parameters())
    unwritten = [n for n, p in params.items() if torch.isnan(p.detach().float()).any()]
    not_landed = {}
    for name, full in sent.items():
        where = expected_region(name, full, params, cfg, tp, rank)
        if where is None:
            not_landed[name] = "no parameter takes it"
            continue
        target, rows, want = where
        got = params[target].detach()
        got = got if rows is None else got[rows[0] : rows[1]]
        if got.dtype != want.dtype:
            not_landed[name] = f"{target} is {got.dtype}, sent {want.dtype}"
        elif got.shape != want.shape or not torch.equal(got, want):
            not_landed[name] = f"{target}{list(rows or [])} differs from what was sent"
    return {"unwritten": unwritten, "not_landed": not_landed}


def load_case(source: dict, tensors: dict, engine: dict) -> dict:
    """Build the engine rank, receive and load every bucket of `source`, check the result."""
    import logging

    import torch

    key = source["key"]
    sent = {n: tensors[f"{key}/sent/{i}"] for i, n in enumerate(source["sent"])}
    os.environ["SGLANG_ENABLE_WEIGHT_LOADER_V2"] = "1" if engine["loader"] == "v2" else "0"
    publish_rank(engine["tp"], engine["rank"])
    model = build_model(source["config"], getattr(torch, source["dtype"]))
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("sglang").addHandler(handler)
    try:
        with torch.no_grad():
            for j, bucket in enumerate(source["buckets"]):
                count = 1 if bucket["load_format"] == "flattened_bucket" else len(bucket["names"])
                payload = [tensors[f"{key}/bucket/{j}/{i}"] for i in range(count)]
                model.load_weights(receive(bucket, payload))
    except Exception as e:  # noqa: BLE001 - reported: SGLang refused what asyncrl sent
        return {"error": f"{type(e).__name__}: {e}", "warnings": warnings}
    finally:
        logging.getLogger("sglang").removeHandler(handler)
    return {**check(model, sent, source["config"], engine["tp"], engine["rank"]),
            "error": None, "warnings": warnings}  # fmt: skip


def main(src: Path, request: Path) -> None:
    """Every source of `request/manifest.json` into every engine rank it lists."""
    install_stubs(src)
    from safetensors.torch import load_file

    manifest = json.loads((request / "manifest.json").read_text())
    tensors = load_file(request / "tensors.safetensors")
    result = {}
    for source in manifest["sources"]:
        for engine in manifest["engines"]:
            label = f"{source['key']}|tp{engine['tp']}r{engine['rank']}|{engine['loader']}"
            result[label] = load_case(source, tensors, engine)
    (request / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
