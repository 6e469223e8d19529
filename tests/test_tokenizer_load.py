"""The rollout workers' tokenizer: the class AutoTokenizer picks, loaded without AutoTokenizer,
so that a worker process never imports torch (data/tokenizer.py)."""

from __future__ import annotations

import subprocess
import sys

from transformers import AutoTokenizer

from asyncrl.data.tokenizer import load_tokenizer, tokenizer_class_name

TEXTS = ["12+34=46", "<|im_start|>user\n7*8=?<|im_end|>", ""]


def test_the_named_class_loads_the_tokenizer_autotokenizer_loads(tiny_model):
    auto = AutoTokenizer.from_pretrained(tiny_model)
    name = tokenizer_class_name(auto)
    assert name == type(auto).__name__
    direct = load_tokenizer(tiny_model, name)
    assert type(direct) is type(auto)
    for text in TEXTS:
        ids = auto.encode(text)
        assert direct.encode(text) == ids
        assert direct.decode(ids, skip_special_tokens=True) == auto.decode(
            ids, skip_special_tokens=True
        )
    assert (direct.eos_token_id, direct.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)
    assert direct.get_vocab() == auto.get_vocab()


def test_no_name_or_a_name_not_transformers_own_goes_through_autotokenizer(tiny_model):
    auto_type = type(AutoTokenizer.from_pretrained(tiny_model))
    for name in ("", "NoSuchTokenizer", "logging", "AutoConfig"):
        assert type(load_tokenizer(tiny_model, name)) is auto_type, name

    class Wrapped(auto_type):  # not exported by transformers: its name is not handed on
        pass

    assert tokenizer_class_name(Wrapped.from_pretrained(tiny_model)) == ""


def test_a_rollout_worker_builds_without_importing_torch(tiny_model):
    """The worker's whole construction path (settings, the group builder with its tokenizer,
    engine clients, reward) in a fresh process: torch stays out of sys.modules."""
    name = tokenizer_class_name(AutoTokenizer.from_pretrained(tiny_model))
    code = (
        "import sys\n"
        "from asyncrl.rollout.ray_pool import _RayRolloutWorker\n"
        "from asyncrl.rollout.settings import RolloutSettings\n"
        "from asyncrl.rollout.single_turn import GroupBuilder\n"
        "s = RolloutSettings(['http://127.0.0.1:9'], '127.0.0.1', 9, sys.argv[1], sys.argv[2])\n"
        "builder = GroupBuilder(s)\n"
        "print(type(builder.tokenizer).__name__, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tiny_model), name],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.split() == [name, "False"]
