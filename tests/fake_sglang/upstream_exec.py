"""Run SGLang releases' own code on what asyncrl sends (a forked child per release).

`python -m tests.fake_sglang.upstream_exec` reads a JSON request on stdin (per release: the
wheel's `sglang/` unpacked by tests/fake_sglang/wheels.py, and what to run) and writes the JSON
results on stdout. Torch and transformers are imported once; each release then runs in a forked
child of its own: two SGLang versions cannot share `sys.modules`.

What is stubbed, and why (nothing of the request structs, the sampling parameters, the radix
key or the server-argument parser):
- `sglang/__init__.py` is not run (the frontend language and its imports): `sglang` is
  registered as a bare package over ROOT/sglang, so `sglang.srt...` modules load from the wheel.
- `STUBBED_SGLANG`: SGLang modules that do not import on a CPU box and whose code never runs
  on what asyncrl sends (io_struct and server_args take type names and constants from them).
- a third-party module that is not installed here (sgl_kernel, triton, flashinfer, pybase64
  ...) and that SGLang's own code imports becomes a stand-in whose attributes are inert
  classes; imports by anything else (library probes for optional packages) fail as usual.
The stand-ins used are reported back (`stubbed`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import inspect
import io
import json
import os
import sys
import traceback
import types
from typing import Any

#: SGLang modules that do not import on a CPU box, none of whose code runs on what asyncrl sends:
#: the scheduler's batch (io_struct takes type names and `Modality` from it; CUDA kernels), the
#: model-config registry (registers with transformers, clashes with this box's transformers), and
#: a Triton kernel module server_args takes one constant from (a hybrid-attention model check).
STUBBED_SGLANG = (
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.configs",
    "sglang.srt.utils.hf_transformers_utils",
    "sglang.srt.layers.attention.fla.chunk_delta_h",
)
STUBBED: set[str] = set()


class _Inert(type):
    """An attribute of a stand-in module: a class; a decorator when called on one function."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _inert(f"{cls.__name__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], types.FunctionType):
            return args[0]
        return _inert(cls.__name__)

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__


def _any_schema(cls: type, source: Any, handler: Any) -> Any:
    from pydantic_core import core_schema

    return core_schema.any_schema()


def _inert(name: str) -> type:
    # pydantic models of SGLang may name one in a field (e.g. xgrammar's StructuralTag)
    return _Inert(name, (), {"__get_pydantic_core_schema__": classmethod(_any_schema)})


class StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _inert(f"{self.__name__}.{name}")


def _stand_in(name: str) -> StandIn:
    STUBBED.add(name)
    module = StandIn(name)
    module.__path__ = []
    return module


class _MissingForSGLang(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: a module no real finder has, imported by SGLang's own code."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        parent = sys.modules.get(fullname.rpartition(".")[0])
        if isinstance(parent, StandIn):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        top = fullname.split(".")[0]
        if top in sys.stdlib_module_names or top.startswith("_") or top == "sglang":
            return None
        if top in sys.modules and not isinstance(sys.modules[top], StandIn):
            return None  # a submodule probe of an installed package
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(
            ("importlib", "_frozen_importlib")
        ):
            frame = frame.f_back
        if frame is None or not frame.f_globals.get("__name__", "").startswith("sglang"):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> StandIn:
        return _stand_in(spec.name)

    def exec_module(self, module: Any) -> None:
        pass


def setup(root: str) -> None:
    sys.path.insert(0, root)
    sys.meta_path.append(_MissingForSGLang())
    package = types.ModuleType("sglang")
    package.__path__ = [f"{root}/sglang"]
    sys.modules["sglang"] = package
    for name in STUBBED_SGLANG:
        sys.modules[name] = _stand_in(name)


def error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _child_key(radix: Any, token_ids: list[int], extra_key: Any) -> Any:
    """The radix cache's dict key for the request's first token (0.5.6: `get_child_key`)."""
    key = radix.RadixKey(token_ids, extra_key)
    child = key.child_key() if hasattr(key, "child_key") else radix.get_child_key(key)
    hash(child)  # the tree keys a node's children by it
    return child


def run_generate(io_struct: Any, radix: Any, body: dict) -> dict:
    """What SGLang's tokenizer manager makes of one /generate body: the request built from the
    JSON, normalized, split per sub-request (`obj[i]`) as its batch path does, each one's
    sampling parameters built and verified, and its radix-cache key."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:
        req = io_struct.GenerateReqInput(**body)
        req.normalize_batch_and_arguments()
        if req.is_single:
            subs = [req]
        else:
            subs = [req[i] for i in range(req.batch_size * req.parallel_sample_num)]
    except Exception as exc:  # noqa: BLE001 - SGLang's own refusal is the result
        return {"error": error(exc)}
    out = []
    for sub in subs:
        one: dict[str, Any] = {"rid": sub.rid, "extra_key": repr(sub.extra_key), "error": None}
        # what the request carries on to the scheduler (None: this release has no such field)
        one["return_routed_experts"] = getattr(sub, "return_routed_experts", None)
        try:
            params = SamplingParams(**(sub.sampling_params or {}))
            params.normalize(None)
            takes_vocab = "vocab_size" in inspect.signature(params.verify).parameters
            params.verify(64) if takes_vocab else params.verify()
            if radix is not None:  # else `radix_error` says why (and the test fails)
                _child_key(radix, list(sub.input_ids), sub.extra_key)
            if not (sub.extra_key is None or isinstance(sub.extra_key, str)):  # Req's type
                raise TypeError(f"extra_key {sub.extra_key!r} is not a str or None")
        except Exception as exc:  # noqa: BLE001
            one["error"] = error(exc)
        out.append(one)
    return {"error": None, "subs": out}


def run_struct(io_struct: Any, name: str, body: dict) -> str | None:
    """`Struct(**body)` with its own post-init checks: None, or SGLang's error."""
    cls = getattr(io_struct, name, None)
    if cls is None:
        return f"SGLang has no {name}"
    try:
        cls(**body)
    except Exception as exc:  # noqa: BLE001
        return error(exc)
    return None


def run_server_args(argv: list[str]) -> str | None:
    """SGLang's own parser on a `launch_server` command line: `add_cli_args`, argparse, then
    `from_cli_args` (every field). Not `__post_init__` (nor `check_server_args`, which reads
    what it derives): it probes the accelerator and reads the model, which this box lacks."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    post_init = ServerArgs.__post_init__
    ServerArgs.__post_init__ = lambda self: None
    try:
        ServerArgs.from_cli_args(args)
    except Exception as exc:  # noqa: BLE001
        return error(exc)
    finally:
        ServerArgs.__post_init__ = post_init
    return None


def run_release(root: str, request: dict) -> dict:
    """Everything of `request` through the SGLang unpacked at `root` (in a forked child)."""
    setup(root)
    from sglang.srt.managers import io_struct

    try:
        from sglang.srt.mem_cache import radix_cache

        radix_error = None
    except Exception as exc:  # noqa: BLE001 - reported
        radix_cache, radix_error = None, error(exc)
    return {
        "generate": [run_generate(io_struct, radix_cache, b) for b in request["generate"]],
        "structs": [run_struct(io_struct, n, b) for n, b in request["structs"]],
        "server_args": [run_server_args(a) for a in request["server_args"]],
        "radix_error": radix_error,
        "stubbed": sorted(STUBBED),
    }


def _fork(root: str, request: dict) -> tuple[int, int]:
    """`run_release` in a forked child (pid, the pipe its JSON comes on): the heavy imports
    this process made are shared, and each release gets a `sys.modules` of its own."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            out = run_release(root, request)
        except BaseException:  # noqa: BLE001 - the parent reports it
            out = {"crash": traceback.format_exc()[-4000:]}
        with os.fdopen(write, "w") as f:
            json.dump(out, f)
        os._exit(0)
    os.close(write)
    return pid, read


def _collect(pid: int, read: int) -> dict:
    with os.fdopen(read) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    return json.loads(data) if data else {"crash": f"the child died (wait status {status})"}


def main() -> None:
    """stdin: {version: {"root": ..., "generate": [...], "structs": [...], "server_args": [...]}}."""
    request = json.load(sys.stdin)
    import torch  # noqa: F401 - imported once here, shared by every release's child
    import torch._inductor.compile_fx  # noqa: F401 - likewise (SGLang's @torch.compile uses)

    # What transformers imports lazily probes for triton & co.: done before any stand-in exists
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer  # noqa

    width = max(1, min(2, os.cpu_count() or 1))  # releases run side by side, two at most
    pending, running, results = list(request.items()), [], {}
    while pending or running:
        while pending and len(running) < width:
            version, job = pending.pop(0)
            running.append((version, _fork(job["root"], job)))
        version, child = running.pop(0)
        results[version] = _collect(*child)
    print("\n@@RESULT@@" + json.dumps(results))


if __name__ == "__main__":
    main()
