"""Every stored full-size result has a baseline to be compared with, and that baseline holds
every headline figure the result reports (a missing key would be flagged as a regression on
the next run, so it must be recorded before, not discovered then). A result measured on
another device than its bench's baseline is not compared (`common.accelerator`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
sys.path.insert(0, str(RESULTS.parent))

from common import accelerator  # noqa: E402

STORED = sorted(RESULTS.glob("*.json")) + sorted((RESULTS / "gpu").glob("*.json"))


@pytest.mark.parametrize("path", STORED, ids=lambda p: str(p.relative_to(RESULTS)))
def test_a_stored_result_has_a_baseline_with_its_headline_keys(path):
    result = json.loads(path.read_text())
    if not result.get("headline") or result.get("smoke"):
        pytest.skip("no headline figures (or a smoke run): nothing to compare")
    baseline_path = RESULTS / "baseline" / f"{result['name']}.json"
    assert baseline_path.exists(), f"no baseline for bench {result['name']!r}"
    baseline = json.loads(baseline_path.read_text())
    if accelerator(baseline) != accelerator(result):
        pytest.skip(f"measured on {accelerator(result)}, baseline on {accelerator(baseline)}")
    missing = set(result["headline"]) - set(baseline["headline"])
    assert not missing, f"baseline {baseline_path.name} lacks {sorted(missing)}"
