import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.data.datasets import DatasetError, encode, load_records
from asyncrl.models.tiny import build_tokenizer

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def raw_tok():
    t = build_tokenizer()
    t.chat_template = None
    return t


def write(path, rows, fmt):
    if fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            for r in rows:
                w.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "parquet"])
def test_every_format_prompt_column(tmp_path, fmt):
    path = write(tmp_path / f"d.{fmt}", ROWS, fmt)
    records = load_records(path)
    assert [r.prompt for r in records] == [r["prompt"] for r in ROWS]
    assert [r.metadata for r in records] == [{"answer": r["answer"]} for r in ROWS]


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "parquet"])
def test_every_format_messages_column(tmp_path, fmt, tok):
    rows = [
        {"chat": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in ROWS
    ]
    path = write(tmp_path / f"d.{fmt}", rows, fmt)
    records = load_records(path, messages="chat")
    assert records[3].messages == [{"role": "user", "content": "3+1="}]
    assert records[3].prompt is None and records[3].metadata == {"answer": "4"}
    text, ids = encode(records[3], tok, "native")
    assert text == "<|im_start|>user\n3+1=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == text and ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_named_prompt_column_and_metadata(tmp_path):
    rows = [{"instruction": "hi", "answer": "1", "level": 3}]
    path = write(tmp_path / "d.jsonl", rows, "jsonl")
    [rec] = load_records(path, prompt="instruction")
    assert rec.prompt == "hi" and rec.metadata == {"answer": "1", "level": 3}


def test_prompt_and_messages_both_or_neither(tmp_path):
    both = write(tmp_path / "both.jsonl", [{"prompt": "a", "messages": []}], "jsonl")
    with pytest.raises(DatasetError, match="both 'prompt' and 'messages'") as err:
        load_records(both)
    assert str(both) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DatasetError, match="not both"):
        load_records(both, prompt="prompt", messages="messages")
    neither = write(tmp_path / "neither.jsonl", [{"q": "a"}], "jsonl")
    with pytest.raises(DatasetError, match="no 'prompt' or 'messages' column"):
        load_records(neither)
    with pytest.raises(DatasetError, match=r"prompt column 'question' not found \(columns: q\)"):
        load_records(neither, prompt="question")


@pytest.mark.parametrize(
    ("lines", "column", "match"),
    [
        ([{"prompt": "a"}, {"answer": "1"}], {}, "line 2: missing prompt column 'prompt'"),
        ([{"prompt": "a"}, {"prompt": 5}], {}, "line 2: prompt column 'prompt' must be a string"),
        ([{"prompt": "a"}, ["x"]], {}, "line 2: expected an object"),
        ([{"m": [{"role": "user"}]}], {"messages": "m"}, "line 1: message 0 must have a string"),
        ([{"m": "not json"}], {"messages": "m"}, "line 1: messages is a string but not JSON"),
        ([{"m": []}], {"messages": "m"}, "line 1: messages must be a non-empty list"),
    ],
)
def test_bad_rows_name_file_and_row(tmp_path, lines, column, match):
    path = write(tmp_path / "bad.jsonl", lines, "jsonl")
    with pytest.raises(DatasetError, match=match) as err:
        load_records(path, **column)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(DatasetError, match="unsupported extension '.txt'"):
        load_records(tmp_path / "d.txt")
    with pytest.raises(DatasetError, match="no such file"):
        load_records(tmp_path / "missing.jsonl")
    (tmp_path / "obj.json").write_text('{"prompt": "a"}')
    with pytest.raises(DatasetError, match="must be a list of objects"):
        load_records(tmp_path / "obj.json")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DatasetError, match="line 2: invalid JSON"):
        load_records(tmp_path / "broken.jsonl")
    (tmp_path / "empty.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="no rows"):
        load_records(tmp_path / "empty.csv")
    (tmp_path / "gap.csv").write_text("prompt,answer\n1+1=,2\n,3\n")
    with pytest.raises(DatasetError, match="row 2: missing prompt"):
        load_records(tmp_path / "gap.csv")


def test_templates(tmp_path, tok, raw_tok):
    [rec] = load_records(write(tmp_path / "d.jsonl", ROWS[:1], "jsonl"))
    assert encode(rec, tok, "none")[0] == "0+1="
    assert encode(rec, tok, "raw")[0] == "0+1="
    assert encode(rec, tok, "native")[0].startswith("<|im_start|>user\n0+1=")
    assert encode(rec, raw_tok, "native")[0] == "0+1="  # no chat template: the text as is
    [msg] = load_records(
        write(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "x"}]}], "jsonl")
    )
    for tokenizer, template in [(tok, "none"), (raw_tok, "native")]:
        with pytest.raises(DatasetError, match="messages need template 'native'"):
            encode(msg, tokenizer, template)
    with pytest.raises(DatasetError, match="template must be"):
        encode(rec, tok, "chatml")
    broken = build_tokenizer()
    broken.chat_template = "{{ raise_exception('no system role here\\nsecond line') }}"
    with pytest.raises(DatasetError, match=r"line 1: chat template failed \(no system") as err:
        encode(rec, broken, "native")
    assert "\n" not in str(err.value)


def test_multiple_files(tmp_path):
    a = write(tmp_path / "a.jsonl", ROWS[:3], "jsonl")
    b = write(tmp_path / "b.csv", ROWS[3:5], "csv")
    records = load_records([a, b])
    assert len(records) == 5 and records[4].source == str(b) and records[4].where == "row 2"


@pytest.mark.parametrize(
    ("name", "data", "where"),
    [
        ("p.jsonl", b'{"prompt": "1+1="}\n\n{"prompt": "caf\xe9"}\n', "line 3"),
        ("p.json", b'[\n {"prompt": "1+1="},\n {"prompt": "caf\xe9"}\n]', "line 3"),
        ("p.csv", b"prompt,answer\n1+1=,2\ncaf\xe9,0\n", "line 3"),
    ],
)
def test_non_utf8_byte_names_file_and_line(tmp_path, name, data, where):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(DatasetError) as info:
        load_records(path)
    assert str(info.value) == f"{path}: {where}: not UTF-8 text (byte 0xe9)"


def test_byte_order_mark_and_bad_csv(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"prompt": "1+1="}\n')
    (tmp_path / "a.json").write_bytes(bom + b'[{"prompt": "1+1="}]')
    (tmp_path / "a.csv").write_bytes(bom + b"prompt\n1+1=\n")
    for name in ("a.jsonl", "a.json", "a.csv"):
        assert [r.prompt for r in load_records(tmp_path / name)] == ["1+1="]
    huge = "x" * (csv.field_size_limit() + 1)
    (tmp_path / "huge.csv").write_text(f"prompt\n1+1=\n{huge}\n")
    with pytest.raises(DatasetError, match=r"huge.csv: line 3: invalid CSV \(field larger"):
        load_records(tmp_path / "huge.csv")
