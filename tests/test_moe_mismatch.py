"""The R3 effect as a measured claim (not a timing): on the warm-started embedded tiny MoE,
rollouts from a bf16 hf engine scored by the fp32 learner (`asyncrl bench mismatch`).

Measured (bench/results/mismatch.json): without replay ~1 % of the positions the engine
forwarded are routed differently by the learner in some layer; with R3 none is, the k3
mismatch KL falls ~3x over all responses and ~7x over the responses where routing differed
(the rest of the mismatch is bf16 arithmetic, which replay cannot remove). Slow: the bench's
full size (64 prompts x 8 samples: ~15 s on an idle 2-core box, a minute on a loaded one) and,
when not cached yet, the model's warm start (~3 CPU minutes)."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main


@pytest.mark.slow
def test_r3_removes_the_routing_share_of_the_mismatch(tmp_path):
    assert main(["bench", "mismatch", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "mismatch.json").read_text())
    off, r3 = result["rows"]["off"], result["rows"]["r3"]
    assert off["routes_differ_frac"] > 0 and off["flipped_rows"] > 0  # there is something to fix
    assert r3["routes_differ_frac"] == 0.0  # the replayed forward used the engine's experts
    assert r3["mismatch_k3_kl"] < 0.5 * off["mismatch_k3_kl"]
    assert r3["flipped_mismatch_k3_kl"] <= 0.2 * off["flipped_mismatch_k3_kl"]
    assert r3["is_ess"] >= off["is_ess"] and r3["flipped_is_ess"] >= off["flipped_is_ess"]
