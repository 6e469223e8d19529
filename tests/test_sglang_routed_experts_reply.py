"""SGLang's own reply-side code for routed experts, per release that has the field (0.5.10 on),
from its wheel (tests/fake_sglang/wheels.py), on a known array; asyncrl's client decode
(`asyncrl.engine.replies.parse_completion`) must read the same ids back.

SGLang's path, executed here from each wheel's source: the scheduler's capturer hands the
tokenizer side an int32 tensor [prompt + output - 1, layers, top_k]; from 0.5.13 the
detokenizer base64-encodes it (`DetokenizerManager._b64_encode_per_request`) and the tokenizer
manager puts the string into `meta_info["routed_experts"]`; in 0.5.10 the tokenizer manager
encodes the tensor itself in that same `if getattr(recv_obj, "routed_experts", None):` block.
Both run with the real `pybase64` (the `test` extra). SGLang's own decoder
(`extract_routed_experts_from_meta_info`) reads the reply back too. The functions are taken
out of SGLang's modules by their syntax tree and run alone: importing those modules would pull
in the scheduler's CUDA stack.
"""

from __future__ import annotations

import ast
import textwrap
import types
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.engine.replies import parse_completion
from asyncrl.engine.versions import CONTRACT_VERSIONS
from tests.fake_sglang.wheels import unpacked

pybase64 = pytest.importorskip("pybase64")
FIRST = (0, 5, 10)
WITH_FIELD = [v for v in CONTRACT_VERSIONS if tuple(int(x) for x in v.split(".")) >= FIRST]
# the names SGLang's code and its annotations use
NAMES = {"pybase64": pybase64, "torch": torch, "np": np, "Optional": typing.Optional,
         "List": list}  # fmt: skip


def _source(path: Path) -> tuple[str, ast.Module]:
    text = path.read_text()
    return text, ast.parse(text)


def function(path: Path, name: str) -> types.FunctionType:
    """SGLang's function (or method) `name` from `path`, decorators dropped, defined alone."""
    text, tree = _source(path)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    scope = dict(NAMES)
    exec(compile(ast.Module([node], []), str(path), "exec"), scope)  # noqa: S102
    return scope[name]


def routes_block(path: Path) -> types.CodeType:
    """The tokenizer manager's `if getattr(recv_obj, "routed_experts", None):` block."""
    text, tree = _source(path)
    test = ast.dump(ast.parse('getattr(recv_obj, "routed_experts", None)', mode="eval").body)
    found = [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.dump(n.test) == test]
    assert len(found) == 1, f"{path}: {len(found)} routed_experts blocks"
    block = textwrap.dedent(ast.get_source_segment(text, found[0], padded=True))
    return compile(block, str(path), "exec")


def sglang_reply(root: Path, routed: torch.Tensor, prompt: int, output: list[int]) -> dict:
    """A /generate reply item whose meta_info["routed_experts"] SGLang's own code made."""
    srt = root / "sglang" / "srt"
    detok = srt / "managers" / "detokenizer_manager.py"
    sent: list = [routed]  # 0.5.10's detokenizer hands the tensor on as it is
    if "_b64_encode_per_request" in detok.read_text():
        sent = function(detok, "_b64_encode_per_request")([routed])
    meta: dict = {"finish_reason": {"type": "stop"}, "weight_version": "3",
                  "prompt_tokens": prompt}  # fmt: skip
    scope = {**NAMES, "recv_obj": types.SimpleNamespace(routed_experts=sent), "i": 0,
             "meta_info": meta}  # fmt: skip
    exec(routes_block(srt / "managers" / "tokenizer_manager.py"), scope)  # noqa: S102
    return {"output_ids": output, "meta_info": meta}


def sglang_decoder(root: Path) -> types.FunctionType:
    srt = root / "sglang" / "srt"
    for rel in ("state_capturer/routed_experts.py", "layers/moe/routed_experts_capturer.py"):
        if (srt / rel).exists():
            return function(srt / rel, "extract_routed_experts_from_meta_info")
    raise AssertionError(f"{root}: no extract_routed_experts_from_meta_info")


@pytest.mark.parametrize("version", WITH_FIELD)
def test_asyncrl_reads_back_the_experts_sglang_encodes(version):
    root = unpacked(version)
    prompt, output, layers, k = 5, [11, 12, 13, 14], 3, 8
    gen = torch.Generator().manual_seed(0)
    rows = prompt + len(output) - 1  # the last sampled token is never forwarded
    routed = torch.randint(0, 128, (rows, layers, k), generator=gen, dtype=torch.int32)
    routed[0, 0, 0], routed[-1, -1, -1] = 0, 127  # both ends of a 128-expert model's ids
    reply = sglang_reply(root, routed, prompt, output)
    assert isinstance(reply["meta_info"]["routed_experts"], str)
    # SGLang's own decoder agrees with what its encoder wrote
    flat = sglang_decoder(root)(reply)
    assert np.array_equal(flat, routed.numpy().reshape(-1))
    done = parse_completion("http://engine", reply, want_logprob=False, want_routes=True)
    assert done.routed_experts.dtype == np.uint8
    assert done.routed_experts.shape == (rows, layers * k)
    assert np.array_equal(done.routed_experts, routed.numpy().reshape(rows, layers * k))


def test_the_releases_with_the_field_are_the_declared_ones():
    assert WITH_FIELD == ["0.5.10", "0.5.13", "0.5.14", "0.5.21", "0.5.23"]
