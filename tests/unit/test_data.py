"""Dataset files are checked when loaded: shape, encoding and prompt length, with the file and line."""

from __future__ import annotations

import json
import re
import shutil
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from families import write_config, write_tokenizer
from parity import config
from parity.commands.perfectible import PerfectibleConfig, candidate_problems
from parity.config import ConfigError
from parity.engines.tokenizer import load_tokenizer
from parity.rl import data
from parity.rl.data import DataError, PromptLimit, load_problems
from parity.rl.problems import WORKED_REQUEST, NumberTask, Problem
from parity.rl.train_config import TrainConfig

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
    assert load_problems(jl, PromptLimit(tokenizer, 8)) == expected  # "café ✓ =" is 8 characters, so 8 tokens

    pq.write_table(pa.table({"prompt": ["12+3=", "1+1="], "answer": [15, 2], "extra": [1, 2]}), tmp_path / "d.parquet")
    assert load_problems(tmp_path / "d.parquet", PromptLimit(tokenizer, 8)) == [
        Problem("12+3=", "15"),
        Problem("1+1=", "2"),
    ]


def test_over_long_prompt_is_refused_at_load_jsonl(tmp_path, tokenizer):
    jl = tmp_path / "d.jsonl"
    write_jsonl(jl, [{"prompt": "1+1=", "answer": 2}, {"prompt": "12+3=", "answer": 15}, {"prompt": "1234567+1="}])
    (tmp_path / "e.jsonl").write_text(jl.read_text().replace('"1234567+1="}', '"1234567+1=", "answer": 1234568}'))
    assert len(load_problems(tmp_path / "e.jsonl", PromptLimit(tokenizer, 10))) == 3  # 10 tokens fit in 10
    with pytest.raises(DataError, match=rf"^{tmp_path}/e.jsonl:3: prompt is 10 tokens; at most 9 fit \({REASON}\)$"):
        load_problems(tmp_path / "e.jsonl", PromptLimit(tokenizer, 9, REASON))


def test_over_long_prompt_is_refused_at_load_parquet(tmp_path, tokenizer):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "1234567+1=", "2+2="], "answer": ["2", "1234568", "4"]}), path)
    with pytest.raises(DataError, match=rf"^{path}: row 1: prompt is 10 tokens; at most 9 fit \({REASON}\)$"):
        load_problems(path, PromptLimit(tokenizer, 9, REASON))


def test_prompt_too_long_to_fit_is_refused_without_tokenizing(tmp_path, counted):
    """No token of the built-in vocabulary spans more than 5 bytes, so 41 bytes cannot fit in 8 tokens."""
    tokenizer, calls = counted
    prompt = "1" * 1_000_000
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2}, {"prompt": prompt, "answer": 1}])
    pq.write_table(pa.table({"prompt": ["1+1=", prompt], "answer": ["2", "1"]}), tmp_path / "d.parquet")
    for path, where in ((tmp_path / "d.jsonl", "d.jsonl:2"), (tmp_path / "d.parquet", "d.parquet: row 1")):
        calls.clear()
        with pytest.raises(DataError, match=rf"{where}: prompt is 1000000 bytes, so at least 200000 tokens"):
            load_problems(path, PromptLimit(tokenizer, 8, REASON))
        assert calls == [4]  # only "1+1=" was tokenized


@pytest.mark.parametrize("with_limit", [True, False])
def test_huge_line_is_refused_with_bounded_memory(tmp_path, counted, monkeypatch, with_limit):
    """A 50 MiB line is refused after reading one row's worth of it (the cap lowered to 1 MiB here)."""
    tokenizer, calls = counted
    monkeypatch.setattr(data, "ROW_BYTES", 2**20)
    line_bytes = 50 * 2**20
    path = tmp_path / "d.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "')
        f.write(b"1" * (line_bytes - len(b'{"prompt": "') - len(b'", "answer": 1}')))
        f.write(b'", "answer": 1}\n{"prompt": "2+2=", "answer": 4}\n')
    args = (PromptLimit(tokenizer, 8),) if with_limit else ()
    message = rf"d.jsonl:2: line is {line_bytes} bytes, more than the {2**20 + 240 if with_limit else 2**20} a row"
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=message):
            load_problems(path, *args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
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
        ('{"prompt": 3, "answer": 1}', "'prompt' is a number"),
        ('{"prompt": "", "answer": 1}', "'prompt' is empty"),
        ('{"prompt": " \\n", "answer": 1}', "'prompt' is only whitespace"),
        ('{"prompt": "1+1=", "answer": null}', "'answer' is null"),
        ('{"prompt": "1+1=", "answer": true}', "'answer' is a boolean"),
        ('{"prompt": "1+1=", "answer": {"value": 2}}', "'answer' is an object"),
        ('{"prompt": "1+1=", "answer": NaN}', "'answer' is nan, which no response can be checked against"),
        ('{"prompt": [], "answer": 1}', "'prompt' is an empty list"),
        ('{"prompt": ["hi"], "answer": 1}', "'prompt' message 0 is a string"),
        ('{"prompt": [{"role": "user"}], "answer": 1}', "'prompt' message 0: 'content' is missing, not a string"),
        (
            '{"prompt": [{"role": "user", "content": "a"}, {"role": 1, "content": "b"}], "answer": 1}',
            "'prompt' message 1: 'role' is a number, not a string",
        ),
    ],
)
def test_bad_row_names_line_and_field(tmp_path, line, problem):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n' + line + "\n")
    with pytest.raises(DataError, match=rf"d.jsonl:2: expected an object with .*; {problem}$"):
        load_problems(path)


@pytest.mark.parametrize(
    "line, problem",
    [
        (
            '{"question": "1+1=", "answer": 1}',
            "no prompt column 'prompt' (task.prompt_column=prompt; the row has 'question', 'answer'): set "
            "task.prompt_column to the column that holds the prompt",
        ),
        (
            '{"prompt": "1+1="}',
            "no answer column 'answer' (task.answer_column=answer; the row has 'prompt'): set task.answer_column to "
            "the column that holds the answer",
        ),
        ("{}", "no prompt column 'prompt' (task.prompt_column=prompt; the row has no columns): set task.prompt_column"),
    ],
)
def test_a_missing_column_names_the_key_that_names_it(tmp_path, line, problem):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n' + line + "\n")
    with pytest.raises(DataError, match=rf"^{re.escape(f'{path}:2: {problem}')}"):
        load_problems(path, columns=data.DataColumns(keys=True))  # a run's columns, as `task.*` names them
    # a command without those keys (`parity mismatch`'s prompts) names the column and the row's alone
    plain = problem.split(" (")[0]
    with pytest.raises(DataError, match=rf"^{re.escape(f'{path}:2: {plain} (the row has ')}[^:]*\)$"):
        load_problems(path)


def test_a_key_given_twice_in_a_row_names_the_line(tmp_path):
    """JSON keeps a repeated key's last value silently: which answer the row meant is not known."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2=", "answer": 4, "answer": 5}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: invalid JSON \(the key 'answer' is given twice in one object\)"):
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
    with pytest.raises(
        DataError,
        match=r"d.parquet: no prompt column 'prompt' \(the file has 'question', 'answer'\)$",
    ):
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
        load_problems(path, PromptLimit(tokenizer, 0, REASON))


def test_perfectible_checks_prompts_against_the_model(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [{"prompt": "1+1=", "answer": 2}, {"prompt": "1" * 40 + "+1=", "answer": 1}])
    cfg = PerfectibleConfig(data=str(path), max_new_tokens=96)  # the built-in model has 128 positions
    message = r"d.jsonl:2: prompt is 43 tokens; at most 32 fit \(model max_position_embeddings 128 minus"
    with pytest.raises(DataError, match=message):
        candidate_problems(cfg)


def test_a_perfectible_search_is_of_the_model_directory_s_files_not_only_its_weights(tmp_path):
    """A copy of the built-in model with another rope_theta (the same weights) reused the original's search:
    200 of 256 problems kept, where a search of its own keeps none."""
    from parity.commands.perfectible import cache_key
    from parity.engines.models.io import BUILTIN_DIR

    copy = tmp_path / "m"
    shutil.copytree(BUILTIN_DIR, copy)
    same = cache_key(PerfectibleConfig(model=str(copy)))
    assert same == cache_key(PerfectibleConfig())
    settings = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**settings, "rope_theta": 10.0}))
    assert cache_key(PerfectibleConfig(model=str(copy))) != same


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A Qwen2-style tokenizer with its ChatML template."""
    path = tmp_path_factory.mktemp("qwen2")
    write_config(path, write_tokenizer(path, "qwen2"))
    return load_tokenizer(path)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?", "name": "x"}]


def test_prompts_as_messages_load_and_count_the_template(tmp_path, chat_tokenizer):
    jl = tmp_path / "d.jsonl"
    write_jsonl(jl, [{"prompt": MESSAGES, "answer": 4}, {"prompt": "What is 3+3?", "answer": 6}])
    expected = [Problem(MESSAGES, "4"), Problem("What is 3+3?", "6")]
    assert load_problems(jl) == expected
    pq.write_table(pa.table({"prompt": [MESSAGES], "answer": ["4"]}), tmp_path / "d.parquet")
    assert load_problems(tmp_path / "d.parquet", PromptLimit(chat_tokenizer, 100)) == expected[:1]
    # The limit counts the prompt as training encodes it: the whole chat template (system turn included).
    longest = max(len(chat_tokenizer.encode_prompt(p.prompt, "auto")) for p in expected)
    assert longest > len(chat_tokenizer.encode("What is 3+3?")) + 10
    assert load_problems(jl, PromptLimit(chat_tokenizer, longest, REASON)) == expected
    with pytest.raises(DataError, match=rf"d.jsonl:\d: prompt is {longest} tokens; at most {longest - 1} fit"):
        load_problems(jl, PromptLimit(chat_tokenizer, longest - 1, REASON))
    # Raw text (chat_template=none) counts the prompt alone.
    write_jsonl(jl, [{"prompt": "What is 3+3?", "answer": 6}])
    raw = len(chat_tokenizer.encode("What is 3+3?"))
    assert load_problems(jl, PromptLimit(chat_tokenizer, raw, REASON, "none")) == expected[1:]


def test_messages_need_a_chat_template(tmp_path, tokenizer, chat_tokenizer):
    jl = tmp_path / "d.jsonl"
    write_jsonl(jl, [{"prompt": "1+1=", "answer": 2}, {"prompt": MESSAGES, "answer": 4}])
    message = r"d.jsonl:2: 'prompt' is a list of messages, which needs a chat template, and the model .* has none"
    with pytest.raises(DataError, match=message + r" \(task.chat_template=auto\)$"):
        load_problems(jl, PromptLimit(tokenizer, 100, REASON))
    with pytest.raises(DataError, match=r"d.jsonl:2: .* needs a chat template, and task.chat_template=none$"):
        load_problems(jl, PromptLimit(chat_tokenizer, 100, REASON, "none"))
    with pytest.raises(DataError, match=r"and chat_template=none$"):
        load_problems(jl, PromptLimit(chat_tokenizer, 100, REASON, "none"), chat_template_key="chat_template")


def test_number_task_data_is_generated_and_held_out():
    cfg = PerfectibleConfig(task="number", num_candidates=40, seed=3, max_new_tokens=16)
    problems = candidate_problems(cfg)
    assert problems == NumberTask().problems(40, seed=3, split="train")
    assert all(p.prompt.endswith("?") and p.answer.isdigit() for p in problems)
    train = {p.prompt for p in NumberTask().problems(2000, seed=0)}
    held_out = {p.prompt for p in NumberTask().problems(200, seed=0, split="eval")}
    assert len(train) > 1900 and not train & held_out
    assert NumberTask().problems(5, seed=1) == NumberTask().problems(5, seed=1) != NumberTask().problems(5, seed=2)


def test_easy_word_problems_are_one_step_on_small_numbers():
    problems = NumberTask("easy").problems(300, seed=0)
    for p in problems:
        a, b = (int(n) for n in re.findall(r"\d+", p.prompt))
        assert max(a, b) < 16 and int(p.answer) in (a + b, a - b, a * b)
    held_out = {p.prompt for p in NumberTask("easy").problems(100, seed=0, split="eval")}
    assert not {p.prompt for p in problems} & held_out
    easy = PerfectibleConfig(task="number", difficulty="easy", num_candidates=5, max_new_tokens=16)
    assert candidate_problems(easy) == problems[:5]
    for p in NumberTask("worked").problems(100, seed=0):  # the same problems, asking for their working
        question, request = p.prompt.split("? ")
        a, b = (int(n) for n in re.findall(r"\d+", question))
        assert request == WORKED_REQUEST and int(p.answer) in (a + b, a - b, a * b)
    with pytest.raises(ValueError, match="difficulty must be one of standard, easy, worked"):
        NumberTask("hard")
    with pytest.raises(ConfigError, match="task.difficulty=easy: only the generated word problems"):
        config.load(TrainConfig, None, ["task.difficulty=easy"])
    assert config.load(TrainConfig, None, ["task.name=number", "task.difficulty=easy"]).task.difficulty == "easy"


# ----------------------------------------------------------------------------- hostile data files


def _nested(depth: int) -> str:
    return json.dumps({"prompt": "1+1=", "answer": "x"}).replace('"x"', "[" * depth + "]" * depth)


def _one_error(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("parity ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (_nested(100_000), ":2: JSON nested more than 100 deep"),
        ('{"prompt": "1+1=", "answer": ' + "9" * 5000 + "}", ":2: JSON value out of range"),
    ],
    ids=["nested 100,000 deep", "a 5000-digit answer"],
)
def test_a_hostile_row_names_its_file_and_line_everywhere(row, message, tmp_path, capsys):
    """task.data, eval.data and `parity eval data=`: one line naming the file and line, nothing written."""
    from parity.cli import main

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "2+2=", "answer": "4"}\n' + row + "\n")
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    runs = [
        ["train", f"run_dir={tmp_path / 'r1'}", f"task.data={path}"],
        ["train", f"run_dir={tmp_path / 'r2'}", f"task.data={good}", f"eval.data={path}"],
        ["eval", "builtin", f"data={path}", f"out={tmp_path / 'e'}"],
    ]
    for argv in runs:
        assert main(argv) == 2, argv
        assert f"{path}{message}" in _one_error(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "good.jsonl"]


def test_a_metrics_file_nested_deep_is_one_line_in_report(tmp_path, capsys):
    from parity.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": ' + "[" * 100_000 + "]" * 100_000 + "}\n{}\n")
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 2
    assert "metrics.jsonl:1: corrupt line" in _one_error(capsys.readouterr().err)
    assert not (tmp_path / "rep").exists()


def test_a_fifo_or_a_device_as_data_is_named_as_such(tmp_path, capsys):
    import os

    from parity.cli import main

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    for source in (fifo, "/dev/zero"):
        for argv in (
            ["train", f"run_dir={tmp_path / 'run'}", f"task.data={source}"],
            ["eval", "builtin", f"data={source}", f"out={tmp_path / 'e'}"],
            ["mismatch", f"prompts={source}", f"out={tmp_path / 'm'}"],
            ["train", str(source), f"run_dir={tmp_path / 'run'}"],
        ):
            assert main(argv) == 2, argv
            assert "is not a regular file (a FIFO, a socket or a device)" in _one_error(capsys.readouterr().err), argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.jsonl"]
