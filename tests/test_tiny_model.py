import json
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.data.synthetic import ArithmeticTask, make_rows
from asyncrl.models import tiny
from asyncrl.models import warm_start as warm
from asyncrl.models.tiny import (
    MARKER,
    TinyModelSpec,
    build_model,
    build_tokenizer,
    default_cache_dir,
    ensure_embedded_model,
    evaluate_accuracy,
    greedy_responses,
)
from asyncrl.rewards.arithmetic import parse_first_integer

SMALL = TinyModelSpec(
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    train_rows=512,
    heldout_rows=32,
    steps=30,
    batch_size=32,
    chat_fraction=0.25,
)


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    return ensure_embedded_model(tmp_path_factory.mktemp("cache"), SMALL, verbose=False)


def test_tokenizer_round_trip():
    tok = build_tokenizer()
    text = "12+345=357 Hello, world!\n~{}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text  # one token per character
    eos = tok.eos_token_id
    assert tok.convert_ids_to_tokens(eos) == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok("7<|im_end|>", add_special_tokens=False)["input_ids"][-1] == eos
    assert tok.decode(tok("é", add_special_tokens=False)["input_ids"]) == "<unk>"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"


def test_warm_start_corpus_mixes_exact_answers_and_estimates():
    assert warm.answer_text("357", estimate=False) == "357"
    assert warm.answer_text("357", estimate=True) == "~360"
    assert warm.answer_text("355", estimate=True) == "~360"  # half rounds up
    assert warm.answer_text("4", estimate=True) == "~0"
    tok = build_tokenizer()
    rows = make_rows(SMALL.task, "train", 400, seed=3)
    examples = warm.encode_examples(tok, rows, "none", 0.6, seed=0)
    targets = [tok.decode([t for t in labels if t != -100]) for _, labels in examples]
    share = sum(t.startswith("~") for t in targets) / len(targets)
    assert 0.5 < share < 0.7  # about estimate_fraction, decided per row from the seed
    chat = warm.encode_examples(tok, rows, "native", 0.6, seed=0)
    chat_targets = [tok.decode([t for t in labels if t != -100]) for _, labels in chat]
    assert chat_targets == targets  # a row keeps its style in every template
    exact = [t for t, r in zip(targets, rows) if not t.startswith("~")]
    assert all(t == r["answer"] + "<|im_end|>" for t, r in zip(targets, rows) if t in exact)


def test_warm_start_lowers_the_loss(small_model_dir):
    tok = build_tokenizer()
    rows = make_rows(SMALL.task, "train", 64, seed=9)
    batch = warm.collate(
        warm.encode_examples(tok, rows, "none", SMALL.estimate_fraction, SMALL.seed),
        tok.pad_token_id,
    )
    fresh = build_model(SMALL, tok)  # the same initialisation, before the warm-start
    trained = AutoModelForCausalLM.from_pretrained(small_model_dir)
    with torch.no_grad():
        assert float(trained(**batch).loss) < float(fresh(**batch).loss) - 0.5


def test_model_dir_loads_with_auto_classes(small_model_dir):
    names = {p.name for p in small_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= names
    model = AutoModelForCausalLM.from_pretrained(small_model_dir)
    tok = AutoTokenizer.from_pretrained(small_model_dir)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id
    assert tok.chat_template and tok.padding_side == "left"
    report = json.loads((small_model_dir / MARKER).read_text())
    assert 0.0 <= report["heldout_accuracy"] <= 1.0 and report["warm_start_seconds"] > 0
    assert "heldout_accuracy_chat" in report and report["digest"] == SMALL.digest()


def test_greedy_batched_equals_unbatched(small_model_dir):
    model = AutoModelForCausalLM.from_pretrained(small_model_dir)
    tok = AutoTokenizer.from_pretrained(small_model_dir)
    prompts = [r["prompt"] for r in make_rows(SMALL.task, "heldout", 12, seed=1)]
    for template in ("none", "native"):
        one = greedy_responses(model, tok, prompts, 5, batch_size=1, template=template)
        many = greedy_responses(model, tok, prompts, 5, batch_size=12, template=template)
        assert one == many  # left padding must not change greedy outputs


def test_evaluate_accuracy(small_model_dir):
    model = AutoModelForCausalLM.from_pretrained(small_model_dir)
    tok = AutoTokenizer.from_pretrained(small_model_dir)
    rows = make_rows(SMALL.task, "heldout", 8, seed=1)
    texts = greedy_responses(model, tok, [r["prompt"] for r in rows], 5, 4)
    # Gold answers made to agree with whatever the model says: accuracy counts the parseable.
    parsed = [parse_first_integer(t) for t in texts]
    gold = [{**r, "answer": str(p if p is not None else -1)} for r, p in zip(rows, parsed)]
    expected = sum(p is not None for p in parsed) / len(rows)
    assert evaluate_accuracy(model, tok, gold, 5, 4) == expected
    gold[0]["answer"] = str((parsed[0] or 0) + 1)  # one answer now wrong
    assert evaluate_accuracy(model, tok, gold, 5, 4) == expected - (parsed[0] is not None) / 8
    model.train()
    tok.padding_side = "right"
    assert 0.0 <= evaluate_accuracy(model, tok, rows, 5, 3, template="native") <= 1.0
    assert model.training and tok.padding_side == "right"  # the caller's state is restored
    with pytest.raises(ValueError, match="at least one row"):
        evaluate_accuracy(model, tok, [], 3, 2)


def test_cached_second_call_does_not_rebuild(small_model_dir, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt")

    monkeypatch.setattr(tiny, "build_embedded_model", no_build)
    assert ensure_embedded_model(small_model_dir.parent, SMALL, verbose=False) == small_model_dir
    assert not [p for p in small_model_dir.parent.iterdir() if ".tmp-" in p.name]


def test_concurrent_callers_build_once(tmp_path, monkeypatch):
    calls = []

    def fake_build(out_dir, spec, progress=False):
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / MARKER).write_text(json.dumps({"warm_start_seconds": 0, "heldout_accuracy": 0}))
        return {"warm_start_seconds": 0, "heldout_accuracy": 0.0}

    monkeypatch.setattr(tiny, "build_embedded_model", fake_build)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_embedded_model(tmp_path, SMALL)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1
    assert (results[0] / "config.json").exists()


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken_build(out_dir, spec, progress=False):
        (out_dir / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(tiny, "build_embedded_model", broken_build)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_embedded_model(tmp_path, SMALL, verbose=False)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_spec_digest_and_cache_dir(monkeypatch, tmp_path):
    assert SMALL.digest() == TinyModelSpec(**{**SMALL.__dict__}).digest()
    assert SMALL.digest() != TinyModelSpec(task=ArithmeticTask(digits=3)).digest()
    monkeypatch.delenv("ASYNCRL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "asyncrl"
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"


def test_warm_start_reports_progress(tmp_path, capsys):
    """A fresh build shows the warm-start's steps, loss and ETA (a plain line every 10 % of the
    steps when stderr is not a terminal, as here; a rich bar on one)."""
    spec = TinyModelSpec(
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        train_rows=64,
        heldout_rows=8,
        steps=5,
        batch_size=8,
    )
    ensure_embedded_model(tmp_path, spec, verbose=True)
    lines = [x for x in capsys.readouterr().err.splitlines() if "warm-start:" in x]
    assert [x.split()[2] for x in lines] == ["1/5", "2/5", "3/5", "4/5", "5/5"]
    assert all("loss " in x and "eta " in x for x in lines)
    ensure_embedded_model(tmp_path, spec, verbose=True)  # cached: no second report
    assert "warm-start:" not in capsys.readouterr().err
