"""PromptSource: epoch order and reshuffling, the resumable position, overlong prompts skipped
and counted, rendering, the embedded default and env seeds."""

import json
import threading

import pytest

from asyncrl.config import load_config
from asyncrl.data.datasets import DatasetError
from asyncrl.data.prompts import EMBEDDED_TRAIN_ROWS, PromptSource
from asyncrl.data.synthetic import make_rows
from asyncrl.models.tiny import DEFAULT_SPEC, build_tokenizer

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return path


def source(model_dir, *overrides):
    cfg = load_config(None, [f"actor_train.model_args.model_name_or_path={model_dir}", *overrides])
    return PromptSource(cfg, model_dir)


def data(tmp_path, rows, *overrides, key="file_name"):
    """Overrides that train on (or, with `key="eval_file_name"`, hold out) `rows`."""
    path = tmp_path / f"{key}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return (f"actor_train.data_args.{key}=[{path}]", *overrides)


def answers(src, n):
    return [int(src.next_item().metadata["answer"]) - 1 for _ in range(n)]


def test_epochs_and_deterministic_shuffle(tmp_path, model_dir):
    src = source(model_dir, *data(tmp_path, ROWS, "seed=3"))
    first, second = answers(src, 10), answers(src, 10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second and first != list(range(10))  # reshuffled every epoch
    assert src.epoch == 1
    assert answers(source(model_dir, *data(tmp_path, ROWS, "seed=3")), 20) == first + second
    ordered = source(model_dir, *data(tmp_path, ROWS, "actor_train.data_args.shuffle=false"))
    item = ordered.next_item()
    assert (item.key, item.prompt_text, item.metadata) == ("e0-i0", "0+1=", {"answer": "1"})
    assert item.prompt_ids == ordered.tokenizer("0+1=", add_special_tokens=False)["input_ids"]


def test_state_dict_round_trip(tmp_path, model_dir):
    overrides = data(tmp_path, ROWS, "seed=5")
    src = source(model_dir, *overrides)
    for _ in range(13):
        src.next_item()
    state = json.loads(json.dumps(src.state_dict()))  # must survive a checkpoint
    assert state == {"epoch": 1, "index": 3, "skipped": 0}
    expected = [src.next_item() for _ in range(15)]
    resumed = source(model_dir, *overrides)
    resumed.load_state_dict(state)
    assert [resumed.next_item() for _ in range(15)] == expected
    assert resumed.state_dict() == src.state_dict()
    keys = [src.next_item().key for _ in range(10)]
    assert keys[0] == "e2-i8" and len(set(keys)) == 10


def test_long_prompts_skipped_and_counted(tmp_path, model_dir, caplog):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1" * 30 + "+1=", "answer": "x"}]
    overrides = data(tmp_path, rows, "actor_train.data_args.shuffle=false")
    src = source(
        model_dir, *overrides, *data(tmp_path, rows, "prompt_length=8", key="eval_file_name")
    )
    assert [src.next_item().prompt_text for _ in range(3)] == ["1+1="] * 3
    assert src.skipped == 2 and src.state_dict()["skipped"] == 2
    assert "line 2: prompt over prompt_length=8, skipped" in caplog.text
    assert [it.key for it in src.heldout_items(5)] == ["heldout-0"]
    with pytest.raises(DatasetError, match="no training prompt fits prompt_length=2"):
        source(model_dir, *overrides, "prompt_length=2").next_item()


def test_messages_and_templates(tmp_path, model_dir):
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}], **r} for r in ROWS]
    rows = [{k: v for k, v in r.items() if k != "prompt"} for r in rows]
    native = source(model_dir, *data(tmp_path, rows, "actor_train.data_args.template=native"))
    item = native.next_item()
    assert item.prompt_text.startswith("<|im_start|>user\n") and "prompt" not in item.metadata
    assert native.render({"prompt": "3+1="}) == (
        "<|im_start|>user\n3+1=<|im_end|>\n<|im_start|>assistant\n"
    )
    raw = source(model_dir, *data(tmp_path, rows))
    with pytest.raises(DatasetError, match="line .*: messages need template 'native'"):
        raw.next_item()
    assert source(model_dir, *data(tmp_path, ROWS)).render({"prompt": "3+1="}) == "3+1="


def test_embedded_default(model_dir):
    src = source(model_dir, "logging.eval_size=4")
    assert len(src.train_records) == EMBEDDED_TRAIN_ROWS
    # the default run's curve depends on this order: same prompts, same order, for seed 0
    assert [src.next_item().prompt_text for _ in range(3)] == ["4+63=", "83-51=", "89+74="]
    heldout = src.heldout_items(4)
    assert [it.key for it in heldout] == [f"heldout-{i}" for i in range(4)]
    rows = make_rows(DEFAULT_SPEC.task, "heldout", 4, seed=0)
    assert [(it.prompt_text, it.metadata) for it in heldout] == [
        (r["prompt"], {"answer": r["answer"]}) for r in rows
    ]


def test_env_seeds(model_dir):
    env = ("env.name=guess_number", "env.config={max_guesses: 3}", "env.num_seeds=3")
    src = source(model_dir, *env)
    items = [src.next_item() for _ in range(6)]
    assert [it.key for it in items[:4]] == ["e0-i0", "e0-i1", "e0-i2", "e1-i0"]
    assert all(it.prompt_ids == [] and it.prompt_text == "" for it in items)
    assert sorted(it.metadata["env_seed"] for it in items[:3]) == [0, 1, 2]
    assert src.heldout_items(8) == []


def test_next_item_thread_safe(tmp_path, model_dir):
    src = source(model_dir, *data(tmp_path, ROWS))
    keys: list[str] = []

    def take():
        keys.extend(src.next_item().key for _ in range(50))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 200 and src.state_dict()["epoch"] == 19
