"""Which msgpack library encodes the codec's header: the `msgpack` package or msgspec?

Arrays travel as raw side buffers, so the library only touches frame 0, the header. This times,
on real TrajectoryGroup headers (n=8 responses, 1k/4k/16k tokens): encode, decode, and decode
plus the structural validation the decoder needs (msgspec validates against the typed schema in
C; with `msgpack` the same checks run in Python after `unpackb`). Writes
bench/results/codec_choice.json.

    python bench/codec_choice.py [--quick | --smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import timeit
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np

from asyncrl.transport import codec
from asyncrl.types import TrajectoryGroup

RESULTS = Path(__file__).resolve().parent / "results" / "codec_choice.json"


def _group(tokens: int, n: int = 8, prompt: int = 256, seed: int = 0) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    lengths = np.full(n, tokens // n)
    total = int(lengths.sum())
    return TrajectoryGroup(
        group_id=f"prompt-{seed:06d}",
        prompt_ids=rng.integers(0, 150_000, prompt),
        response_lengths=lengths,
        response_ids=rng.integers(0, 150_000, total),
        rollout_logprobs=-rng.exponential(1.0, total),
        loss_mask=np.ones(total, np.uint8),
        versions=np.full(total, 7),
        rewards=rng.random(n),
        finish_reasons=["stop"] * n,
        advantages=rng.standard_normal(total),
        metadata={"task": "gsm8k", "prompt_index": seed, "temperature": 1.0},
    )


def _validate_py(obj: Any) -> None:
    """What `codec._Header` checks, written in Python for the `msgpack` package."""
    if not (isinstance(obj, list) and len(obj) == 4):
        raise ValueError("header")
    schema, kind, arrays, fields = obj
    if type(schema) is not int or not isinstance(kind, str) or not isinstance(arrays, dict):
        raise ValueError("header")
    for spec in arrays.values():
        if not (isinstance(spec, list) and len(spec) == 4):
            raise ValueError("spec")
        lib, dtype, shape, frame = spec
        if not (isinstance(lib, str) and isinstance(dtype, str) and isinstance(shape, list)):
            raise ValueError("spec")
        if not all(type(d) is int and d >= 0 for d in shape) or type(frame) is not int:
            raise ValueError("spec")
    if not isinstance(fields, dict):
        raise ValueError("fields")


def _refuse(code: int, data: bytes) -> Any:
    raise ValueError(code)


def _per_call_us(fn: Any, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def measure(tokens: int, number: int) -> dict[str, float]:
    header_bytes = bytes(codec.encode_group(_group(tokens))[0])
    obj = msgspec.msgpack.decode(header_bytes)  # the plain header: [schema, kind, arrays, fields]
    assert msgpack.unpackb(header_bytes, raw=False) == obj
    enc = msgspec.msgpack.Encoder()
    dec_any = msgspec.msgpack.Decoder()
    dec_typed = msgspec.msgpack.Decoder(codec._Header)
    packer = msgpack.Packer()

    def mp_decode_validated() -> None:
        _validate_py(
            msgpack.unpackb(header_bytes, raw=False, strict_map_key=True, ext_hook=_refuse)
        )

    t = {
        "header_bytes": len(header_bytes),
        "msgpack_encode_us": _per_call_us(lambda: packer.pack(obj), number),
        "msgpack_decode_us": _per_call_us(
            lambda: msgpack.unpackb(header_bytes, raw=False, strict_map_key=True), number
        ),
        "msgpack_decode_validated_us": _per_call_us(mp_decode_validated, number),
        "msgspec_encode_us": _per_call_us(lambda: enc.encode(obj), number),
        "msgspec_decode_us": _per_call_us(lambda: dec_any.decode(header_bytes), number),
        "msgspec_decode_validated_us": _per_call_us(lambda: dec_typed.decode(header_bytes), number),
    }
    t["msgpack_roundtrip_us"] = t["msgpack_encode_us"] + t["msgpack_decode_validated_us"]
    t["msgspec_roundtrip_us"] = t["msgspec_encode_us"] + t["msgspec_decode_validated_us"]
    return t


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--smoke", action="store_true", help="CI size (= --quick)")
    args = parser.parse_args(argv)
    number = 5_000 if args.quick or args.smoke else 50_000
    rows = {f"{k}k": measure(k * 1024, number) for k in (1, 4, 16)}
    mp = sum(r["msgpack_roundtrip_us"] for r in rows.values())
    ms = sum(r["msgspec_roundtrip_us"] for r in rows.values())
    result = {
        "what": "header encode + typed decode per message, microseconds (best of 5)",
        "python": sys.version.split()[0],
        "machine": platform.processor() or platform.machine(),
        "loadavg_1m": os.getloadavg()[0],  # this box is shared: context for the figures
        "msgpack_version": ".".join(map(str, msgpack.version)),
        "msgspec_version": msgspec.__version__,
        "groups": rows,
        "chosen": "msgspec" if ms < mp else "msgpack",
        "speedup_roundtrip": round(mp / ms, 2),
    }
    print(f"{'group':>6} {'hdr B':>6} | {'msgpack enc':>11} {'dec+val':>8} | "
          f"{'msgspec enc':>11} {'dec+val':>8}")  # fmt: skip
    for name, r in rows.items():
        print(
            f"{name:>6} {r['header_bytes']:>6} | {r['msgpack_encode_us']:>9.2f}us "
            f"{r['msgpack_decode_validated_us']:>6.2f}us | {r['msgspec_encode_us']:>9.2f}us "
            f"{r['msgspec_decode_validated_us']:>6.2f}us"
        )
    print(f"chosen: {result['chosen']} ({result['speedup_roundtrip']}x on encode+decode)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
