"""The megatron-core range the `megatron` extra declares is the range the tests ran
(`compat.MIN_VERSION`..`compat.MAX_VERSION`), the `test` extra installs releases inside it (the
newest per Python), and the learner says so in one line when the installed release is outside
it. Megatron is not needed (the checks read pyproject.toml and compare version strings)."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from asyncrl.learner.megatron.compat import (
    MAX_VERSION,
    MIN_VERSION,
    MegatronVersionError,
    check_version,
    parse_version,
)

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _extra(name: str) -> list[Requirement]:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return [r for r in map(Requirement, extras[name]) if r.name == "megatron-core"]


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def test_the_megatron_extra_declares_exactly_the_tested_range():
    (req,) = _extra("megatron")
    bounds = {(s.operator, parse_version(s.version)) for s in req.specifier}
    assert bounds == {(">=", MIN_VERSION[:2]), ("<=", MAX_VERSION)}, req


def test_the_test_extra_pins_the_newest_tested_release_per_python():
    (allowed,) = _extra("megatron")
    pins = {}
    for req in _extra("test"):
        (spec,) = req.specifier
        assert spec.operator == "==" and Version(spec.version) in allowed.specifier, req
        for python in ("3.11", "3.12"):
            if req.marker.evaluate({"python_version": python}):
                pins[python] = parse_version(spec.version)
    # 0.17+ publish cp312 wheels only: Python 3.11's newest is 0.16.1
    assert pins == {"3.11": (0, 16, 1), "3.12": MAX_VERSION}


def test_a_release_older_than_the_learner_needs_is_refused_in_one_line():
    with pytest.raises(MegatronVersionError) as e:
        check_version("0.14.0")
    message = str(e.value)
    assert "\n" not in message
    assert "megatron-core 0.14.0 is older" in message and _dotted(MIN_VERSION) in message


def test_a_release_newer_than_any_tested_warns_in_one_line(caplog):
    newer = _dotted((*MAX_VERSION[:2], MAX_VERSION[2] + 1))
    with caplog.at_level(logging.WARNING, logger="asyncrl.learner.megatron.compat"):
        message = check_version(newer)
    assert message and "\n" not in message
    assert f"megatron-core {newer} is newer" in message
    assert f"megatron-core<={_dotted(MAX_VERSION)}" in message
    assert [r.getMessage() for r in caplog.records] == [message]


@pytest.mark.parametrize("version", ["0.15.0", "0.16.1", "0.17.0rc1", "0.19.2"])
def test_a_tested_release_passes_silently(version, caplog):
    with caplog.at_level(logging.WARNING):
        assert check_version(version) is None
    assert not caplog.records


def test_the_installed_release_is_one_the_tests_ran():
    pytest.importorskip("megatron.core")
    assert check_version() is None
