"""Per-request `sampling_seed` on SGLang: honoured only with `--enable-deterministic-inference`.

Read from the wheels of the lowest and highest supported SGLang (cached like
tests/test_sglang_contract.py; skipped with the reason when a wheel cannot be had): the seed
tensor is built only when the server runs deterministic inference, so an engine whose server
info reports the flag off is named in a warning (`seed_warning`): sampling works, not
reproducibly.
"""

from __future__ import annotations

import re

import pytest

from asyncrl.engine.versions import (
    MAX_VERSION,
    MIN_VERSION,
    seed_warning,
)
from tests.test_sglang_contract import wheel

VERSIONS = [".".join(map(str, v)) for v in (MIN_VERSION, MAX_VERSION)]


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_builds_the_seed_tensor_only_under_deterministic_inference(version):
    whl = wheel(version)
    names = whl.namelist()
    info = whl.read("sglang/srt/sampling/sampling_batch_info.py").decode()
    # `sampling_seed = (torch.tensor([... r.sampling_params.sampling_seed ...]) if
    # enable_deterministic else None)`: without the flag every request's seed is dropped
    built = re.search(r"sampling_seed = \((.*?)\n        \)\n", info, re.S)
    assert built and "if enable_deterministic" in built[1] and "else None" in built[1]
    # ... and the flag is a server argument of this version (0.5.6: server_args.py; later
    # ones declare their arguments under srt/arg_groups/)
    args = [n for n in names if n == "sglang/srt/server_args.py" or "srt/arg_groups/" in n]
    assert any("enable_deterministic_inference" in whl.read(n).decode() for n in args)


def test_an_engine_reporting_the_flag_off_is_named_in_one_warning_line():
    warning = seed_warning({"version": "0.5.23", "enable_deterministic_inference": False}, "u")
    assert warning and "\n" not in warning
    assert (
        "--enable-deterministic-inference" in warning
        and "enable_deterministic_inference: true" in warning
    )
    assert seed_warning({"version": "0.5.23", "enable_deterministic_inference": True}, "u") is None
    assert (
        seed_warning({"version": "asyncrl-hf"}, "u") is None
    )  # not reported: asyncrl's own server
