"""The rollout workers' tokenizer: the class AutoTokenizer picks, loaded without AutoTokenizer,
so that a worker process never imports torch; and where a worker only decodes, the driver's
tokenizer backend decoded with the `tokenizers` library alone, exactly as transformers decodes,
so that it never imports transformers either (data/tokenizer.py)."""

from __future__ import annotations

import random
import subprocess
import sys

from transformers import AutoTokenizer

from asyncrl.data.tokenizer import (
    PlainDecoder,
    load_decoder,
    load_tokenizer,
    plain_decoder_json,
    tokenizer_class_name,
)

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


def test_no_name_or_a_name_not_transformers_own_loads_as_the_directory_names_it(tiny_model):
    from asyncrl.data.tokenizer import model_tokenizer

    auto_type = type(model_tokenizer(tiny_model))
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


def test_the_plain_decoder_decodes_every_id_sequence_as_transformers_does(tiny_model):
    """The driver's tokenizer as the run loads it (transformers 5 rebuilds this one's backend:
    Qwen2Tokenizer's byte-level decoder, not the file's), its backend serialized: the same
    text for the ids of the texts, of a chat-templated conversation, and of random ids with
    special ones among them, skipping special tokens or not."""
    auto = AutoTokenizer.from_pretrained(tiny_model)
    spec = plain_decoder_json(auto)
    assert spec
    plain = load_decoder(tiny_model, tokenizer_class_name(auto), spec)
    assert isinstance(plain, PlainDecoder)
    chat = [{"role": "user", "content": "7*8=?"}, {"role": "assistant", "content": "56"}]
    texts = [*TEXTS, auto.apply_chat_template(chat, tokenize=False)]
    rng = random.Random(0)
    specials = auto.all_special_ids
    sequences = [auto.encode(t) for t in texts] + [
        [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(len(auto))
         for _ in range(rng.randrange(48))]
        for _ in range(500)
    ]  # fmt: skip
    assert any(set(ids) & set(specials) for ids in sequences)
    for ids in sequences:
        for skip in (True, False):
            assert plain.decode(ids, skip_special_tokens=skip) == auto.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)


def test_no_plain_decoder_where_transformers_decodes_otherwise(tiny_model):
    """A tokenizer that cleans up spaces, or whose class changes `decode`, decodes other than
    its backend: the workers keep the transformers tokenizer."""
    cleaning = AutoTokenizer.from_pretrained(tiny_model, clean_up_tokenization_spaces=True)
    assert plain_decoder_json(cleaning) == ""
    auto_type = type(AutoTokenizer.from_pretrained(tiny_model))

    class Shouting(auto_type):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens, **kwargs).upper()

    class Private(auto_type):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "x" + super()._decode(token_ids, skip_special_tokens, **kwargs)

    for cls in (Shouting, Private):
        assert plain_decoder_json(cls.from_pretrained(tiny_model)) == "", cls.__name__
    assert plain_decoder_json(object()) == ""
    assert type(load_decoder(tiny_model, auto_type.__name__, "")) is auto_type


def test_a_rollout_worker_that_only_decodes_never_imports_transformers(tiny_model):
    """With the driver's serialized backend (`RolloutSettings.tokenizer_json`), the worker's
    construction path loads neither transformers nor torch."""
    auto = AutoTokenizer.from_pretrained(tiny_model)
    code = (
        "import sys\n"
        "from asyncrl.rollout.ray_pool import _RayRolloutWorker\n"
        "from asyncrl.rollout.settings import RolloutSettings\n"
        "from asyncrl.rollout.single_turn import GroupBuilder\n"
        "spec = sys.stdin.read()\n"
        "s = RolloutSettings(['http://127.0.0.1:9'], '127.0.0.1', 9, sys.argv[1], sys.argv[2],\n"
        "                    tokenizer_json=spec)\n"
        "builder = GroupBuilder(s)\n"
        "print(type(builder.tokenizer).__name__, 'transformers' in sys.modules,\n"
        "      'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tiny_model), tokenizer_class_name(auto)],
        input=plain_decoder_json(auto), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["PlainDecoder", "False", "False"]


def test_the_embedded_models_tokenizer_keeps_every_character_it_was_trained_on(tiny_model):
    """The embedded model is warm-started on text its character-level tokenizer encoded with
    spaces and newlines; transformers 5's AutoTokenizer picks Qwen2Tokenizer for its qwen2
    config and rebuilds it byte-level, which drops them. What a run encodes with
    (`model_tokenizer`, the driver's prompts; the workers load its class) keeps them."""
    from pathlib import Path

    from asyncrl.config import load_config
    from asyncrl.data.prompts import PromptSource
    from asyncrl.data.tokenizer import model_tokenizer

    text = "Guess a number between 1 and 100.\nYour guess: 42 (too low)"
    tok = model_tokenizer(tiny_model)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) == len(text)  # one id per character
    assert tok.unk_token_id not in ids
    source = PromptSource(load_config(None, []), Path(tiny_model))
    assert source.tokenizer.encode(text, add_special_tokens=False) == ids
    worker = load_tokenizer(tiny_model, tokenizer_class_name(source.tokenizer))
    assert worker.encode(text, add_special_tokens=False) == ids
