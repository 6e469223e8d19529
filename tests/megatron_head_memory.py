"""Peak host memory of one Megatron learner step (CPU emulation, one rank, fp32) with the
chunked output layer (asyncrl/learner/megatron/head.py) and with the full-logits path, at a
large vocabulary: the chunked step must not hold [tokens x vocabulary] fp32 logits.

    python tests/megatron_head_memory.py MODEL_DIR OUT_JSON [VOCAB] [ROWS] [RESPONSE_LEN]

MODEL_DIR: an HF model directory with a tokenizer (e.g. the tests' tiny model); a 4-layer
variant with VOCAB (default 151936) rows is made from it. One group of ROWS (default 2)
responses of RESPONSE_LEN (default 512) tokens, all in one micro-batch. The peak is the
process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) during
`worker.step`, above the resident set before it; the chunked step runs first (a warm-up step
before it allocates the optimizer's state), the full-logits one after.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def _status(key: str) -> int:
    """A /proc/self/status memory figure in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_of(fn) -> int:
    """Bytes the resident set grew to above its size before `fn()`, at its highest."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def main() -> None:
    sys.path.insert(0, str(HERE / "gpu"))
    sys.path.insert(0, str(HERE))
    import megatron_emulation as emu
    import test_megatron_gpu as g
    from megatron_head_check import full_logits

    from asyncrl.device import SPECS
    from asyncrl.learner.megatron.worker import MegatronWorker
    from asyncrl.types import TrajectoryGroup

    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    given = [int(a) for a in sys.argv[3:6]]
    vocab, rows, length = given + [151936, 2, 512][len(given) :]
    emu.apply()
    model_dir = emu.tiny_variant(src, out.parent / "model", vocab, tied=True)
    _, cfg = g.configs(1, "[0]")
    cfg.actor_train.training_args.per_device_train_batch_size = rows
    cfg.actor.ppo_mini_batch_size = rows
    worker = MegatronWorker(model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, 0.7, 10,
                            device=SPECS["cpu"])  # fmt: skip
    rng = np.random.default_rng(0)
    responses = [{"response_ids": rng.integers(5, 90, length), "reward": float(i % 2),
                  "rollout_logprobs": -rng.random(length), "versions": np.zeros(length),
                  "finish_reason": "length"} for i in range(rows)]  # fmt: skip
    batch = [TrajectoryGroup.from_responses("g0", rng.integers(5, 90, 16), responses)]
    positions = rows * (16 + length)
    worker.step(batch)  # the optimizer's state, allocated once
    chunked = peak_of(lambda: worker.step(batch))
    with full_logits(worker.chunks):
        full = peak_of(lambda: worker.step(batch))
    result = {
        "vocab": vocab, "rows": rows, "response_len": length, "positions": positions,
        "tokens_x_vocab_fp32_bytes": positions * vocab * 4,
        "chunked_step_peak_bytes": chunked, "full_logits_step_peak_bytes": full,
        "torch": torch.__version__,
    }  # fmt: skip
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
