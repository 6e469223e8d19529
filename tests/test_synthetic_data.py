import json

import pytest

from asyncrl.data.synthetic import (
    ArithmeticTask,
    make_rows,
    solve,
    split_of,
    to_messages,
    write_jsonl,
)


def test_rows_are_correct_and_deterministic():
    task = ArithmeticTask(digits=3, mul_digits=2)
    rows = make_rows(task, "train", 300, seed=7)
    assert rows == make_rows(task, "train", 300, seed=7)
    assert rows != make_rows(task, "train", 300, seed=8)
    for row in rows:
        body = row["prompt"].removesuffix("=")
        op = next(c for c in "+-*" if c in body)
        a, b = body.split(op)
        assert int(row["answer"]) == solve(int(a), op, int(b))
        assert int(row["answer"]) >= 0
        assert len(a) <= 3 and len(b) <= (2 if op == "*" else 3)
    assert {next(c for c in "+-*" if c in r["prompt"]) for r in rows} == {"+", "-", "*"}
    assert len({r["prompt"] for r in rows}) == len(rows)


def test_splits_are_disjoint_across_seeds():
    task = ArithmeticTask(digits=2)
    train = {r["prompt"] for seed in range(3) for r in make_rows(task, "train", 2000, seed)}
    heldout = {r["prompt"] for seed in range(3) for r in make_rows(task, "heldout", 300, seed)}
    assert not train & heldout
    assert all(split_of(p, task) == "heldout" for p in heldout)
    # A different split seed reshuffles which problems are held out.
    other = ArithmeticTask(digits=2, split_seed=1)
    assert {split_of(p, other) for p in heldout} == {"train", "heldout"}


def test_ops_subset_and_bad_task():
    rows = make_rows(ArithmeticTask(ops=("+",), digits=2), "heldout", 50, seed=0)
    assert all("+" in r["prompt"] for r in rows)
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops=("/",))
    with pytest.raises(ValueError, match="unique"):
        make_rows(ArithmeticTask(ops=("+",), digits=1), "heldout", 50, seed=0)
    with pytest.raises(ValueError, match="split"):
        make_rows(ArithmeticTask(), "test", 5, seed=0)  # type: ignore[arg-type]


def test_write_jsonl_prompt_and_messages(tmp_path):
    rows = make_rows(ArithmeticTask(), "train", 5, seed=0)
    path = write_jsonl(rows, tmp_path / "sub" / "train.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    path = write_jsonl(rows, tmp_path / "chat.jsonl", form="messages")
    first = json.loads(path.read_text().splitlines()[0])
    assert first == to_messages(rows[0])
    assert first["messages"] == [{"role": "user", "content": rows[0]["prompt"]}]
    assert first["answer"] == rows[0]["answer"] and "prompt" not in first
