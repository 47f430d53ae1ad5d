"""Dataset files are checked when loaded: shape, encoding and prompt length, with the file and line."""

from __future__ import annotations

import json
import time
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parity.commands.perfectible import PerfectibleConfig, candidate_problems
from parity.engines.tokenizer import load_tokenizer
from parity.rl import tasks
from parity.rl.tasks import DataError, Problem, load_problems

REASON = "model max_position_embeddings 128 minus rollout.max_new_tokens 120"


@pytest.fixture(scope="module")
def tokenizer():
    """The built-in character tokenizer: one token per character, no BOS, longest entry "<pad>" (5 bytes)."""
    return load_tokenizer("builtin")


@pytest.fixture
def counted(tokenizer, monkeypatch):
    """The tokenizer, counting the prompts it is asked to encode."""
    calls = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text: calls.append(len(text)) or encode(text))
    return tokenizer, calls


def write_jsonl(path, rows: list[object]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_valid_file_loads_intact(tmp_path, tokenizer):
    jl = tmp_path / "d.jsonl"
    jl.write_bytes(
        b'{"prompt": "12+3=", "answer": 15, "source": "x"}\r\n'
        b"\n   \n"
        b'{"prompt": "caf\\u00e9 \xe2\x9c\x93 =", "answer": "2.5"}\n'
        b'{"prompt": "1+1=", "answer": 2.0}'  # no newline at the end
    )
    expected = [Problem("12+3=", "15"), Problem("café ✓ =", "2.5"), Problem("1+1=", "2.0")]
    assert load_problems(jl) == expected
    assert load_problems(jl, tokenizer, 8) == expected  # "café ✓ =" is 8 characters, so 8 tokens

    pq.write_table(pa.table({"prompt": ["12+3=", "1+1="], "answer": [15, 2], "extra": [1, 2]}), tmp_path / "d.parquet")
    assert load_problems(tmp_path / "d.parquet", tokenizer, 8) == [Problem("12+3=", "15"), Problem("1+1=", "2")]


def test_over_long_prompt_is_refused_at_load_jsonl(tmp_path, tokenizer):
    jl = tmp_path / "d.jsonl"
    write_jsonl(jl, [{"prompt": "1+1=", "answer": 2}, {"prompt": "12+3=", "answer": 15}, {"prompt": "1234567+1="}])
    (tmp_path / "e.jsonl").write_text(jl.read_text().replace('"1234567+1="}', '"1234567+1=", "answer": 1234568}'))
    assert len(load_problems(tmp_path / "e.jsonl", tokenizer, 10)) == 3  # 10 tokens fit in 10
    with pytest.raises(DataError, match=rf"^{tmp_path}/e.jsonl:3: prompt is 10 tokens; at most 9 fit \({REASON}\)$"):
        load_problems(tmp_path / "e.jsonl", tokenizer, 9, REASON)


def test_over_long_prompt_is_refused_at_load_parquet(tmp_path, tokenizer):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "1234567+1=", "2+2="], "answer": ["2", "1234568", "4"]}), path)
    with pytest.raises(DataError, match=rf"^{path}: row 1: prompt is 10 tokens; at most 9 fit \({REASON}\)$"):
        load_problems(path, tokenizer, 9, REASON)


def test_prompt_too_long_to_fit_is_refused_without_tokenizing(tmp_path, counted):
    """No token of the built-in vocabulary spans more than 5 bytes, so 41 bytes cannot fit in 8 tokens."""
    tokenizer, calls = counted
    prompt = "1" * 1_000_000
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2}, {"prompt": prompt, "answer": 1}])
    pq.write_table(pa.table({"prompt": ["1+1=", prompt], "answer": ["2", "1"]}), tmp_path / "d.parquet")
    for path, where in ((tmp_path / "d.jsonl", "d.jsonl:2"), (tmp_path / "d.parquet", "d.parquet: row 1")):
        calls.clear()
        start = time.perf_counter()
        with pytest.raises(DataError, match=rf"{where}: prompt is 1000000 bytes, so at least 200000 tokens"):
            load_problems(path, tokenizer, 8, REASON)
        assert time.perf_counter() - start < 0.5
        assert calls == [4]  # only "1+1=" was tokenized


@pytest.mark.parametrize("with_limit", [True, False])
def test_huge_line_is_refused_with_bounded_memory(tmp_path, counted, monkeypatch, with_limit):
    """A 50 MiB line is refused after reading one row's worth of it (the cap lowered to 1 MiB here)."""
    tokenizer, calls = counted
    monkeypatch.setattr(tasks, "ROW_BYTES", 2**20)
    line_bytes = 50 * 2**20
    path = tmp_path / "d.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "')
        f.write(b"1" * (line_bytes - len(b'{"prompt": "') - len(b'", "answer": 1}')))
        f.write(b'", "answer": 1}\n{"prompt": "2+2=", "answer": 4}\n')
    args = (tokenizer, 8) if with_limit else ()
    message = rf"d.jsonl:2: line is {line_bytes} bytes, more than the {2**20 + 240 if with_limit else 2**20} a row"
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(DataError, match=message):
            load_problems(path, *args)
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 1.0
    assert peak < 5 * 2**20  # a few row caps, not the 50 MiB line
    assert calls == ([4] if with_limit else [])


def test_not_utf8_names_line_and_column(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "caf\xe9=", "answer": 1}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\)$"):
        load_problems(path)


@pytest.mark.parametrize(
    "line, problem",
    [
        ("[1, 2]", "got an array"),
        ('{"answer": 1}', "'prompt' is missing"),
        ('{"prompt": "1+1="}', "'answer' is missing"),
        ('{"prompt": 3, "answer": 1}', "'prompt' is a number"),
        ('{"prompt": "", "answer": 1}', "'prompt' is empty"),
        ('{"prompt": " \\n", "answer": 1}', "'prompt' is only whitespace"),
        ('{"prompt": "1+1=", "answer": null}', "'answer' is null"),
        ('{"prompt": "1+1=", "answer": true}', "'answer' is a boolean"),
        ('{"prompt": "1+1=", "answer": {"value": 2}}', "'answer' is an object"),
    ],
)
def test_bad_row_names_line_and_field(tmp_path, line, problem):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n' + line + "\n")
    with pytest.raises(DataError, match=rf"d.jsonl:2: expected an object with .*; {problem}$"):
        load_problems(path)


def test_bad_json_and_lone_surrogate_name_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n\n{"prompt": "1+1=", "answer": 2\n')
    with pytest.raises(DataError, match=r"d.jsonl:3: invalid JSON \(Expecting ',' delimiter at column 31\)$"):
        load_problems(path)
    path.write_text('{"prompt": "1+\\ud800=", "answer": 2}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: 'prompt' is not valid Unicode \(lone surrogate '\\ud800'"):
        load_problems(path)


def test_bad_parquet_rows_name_the_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", None], "answer": ["2", "4"]}), path)
    with pytest.raises(DataError, match=r"d.parquet: row 1: expected an object .*; 'prompt' is null$"):
        load_problems(path)
    pq.write_table(pa.table({"prompt": [1, 2], "answer": ["2", "4"]}), path)
    with pytest.raises(DataError, match=r"d.parquet: row 0: .*; 'prompt' is a number$"):
        load_problems(path)
    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), path)
    with pytest.raises(DataError, match=r"d.parquet: missing column\(s\) \['prompt'\]"):
        load_problems(path)
    path.write_text("not parquet")
    with pytest.raises(DataError, match=r"d.parquet: cannot read as Parquet"):
        load_problems(path)


def test_empty_file_and_no_room_for_a_prompt(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(DataError, match="d.jsonl: no problems found"):
        load_problems(path)
    write_jsonl(path, [{"prompt": "1+1=", "answer": 2}])
    with pytest.raises(DataError, match=rf"d.jsonl: no prompt can fit in 0 tokens \({REASON}\)"):
        load_problems(path, tokenizer, 0, REASON)


def test_perfectible_checks_prompts_against_the_model(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [{"prompt": "1+1=", "answer": 2}, {"prompt": "1" * 40 + "+1=", "answer": 1}])
    cfg = PerfectibleConfig(data=str(path), max_new_tokens=96)  # the built-in model has 128 positions
    message = r"d.jsonl:2: prompt is 43 tokens; at most 32 fit \(model max_position_embeddings 128 minus"
    with pytest.raises(DataError, match=message):
        candidate_problems(cfg)
