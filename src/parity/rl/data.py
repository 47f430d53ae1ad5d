"""Problems from data files (JSONL, Parquet), every row checked before a run starts; the limit on a
prompt's tokens (`PromptLimit`); in-memory datasets written into a run directory (`write_rows`); and the
order a run draws problems in (`DataOrder`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from parity.config import ConfigError
from parity.engines.tokenizer import ChatTemplateError
from parity.files import JSONError, LineTooLong, bounded_lines, parse_json, regular_file_problem
from parity.folders import Folder
from parity.rl.problems import Problem

if TYPE_CHECKING:
    from parity.engines.tokenizer import Tokenizer


class DataError(ValueError):
    """A dataset file that cannot be used; the message names the file and line."""


# JSONL rows are read one at a time and no longer than a cap, so one enormous line is refused without
# being held in memory. Without a prompt limit a row may hold ROW_BYTES; with one, ROW_BYTES beside the
# longest prompt that could fit, spelled out as JSON may spell it (up to 6 bytes per byte: "\u0041").
ROW_BYTES = 16 * 2**20
JSON_BYTES_PER_TEXT_BYTE = 6
PARQUET_BATCH_ROWS = 1024


class PromptLimit:
    """At most `max_tokens` tokens per prompt, as `tokenizer.encode_prompt` counts them under `chat_template`
    (BOS and the chat template's tokens included).

    Tokenizing costs some hundreds of bytes of memory per byte of text, so a prompt is tokenized only
    when its length could fit: no token spans more UTF-8 bytes of the prompt than its vocabulary
    entry has (`token_bytes`, the longest entry), so a prompt of more than token_bytes x max_tokens
    bytes is certainly too long. That holds for byte-level and SentencePiece BPE vocabularies (the
    tokenizers of Llama and Qwen2 models; a byte-fallback entry "<0x0A>" spans one byte) and for the
    built-in character tokenizer; it can fail for a tokenizer whose normalizer shrinks text (NFKC,
    lowercasing) or whose unknown token spans whole words (WordPiece, WordLevel over words).
    """

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, reason: str | None = None, chat_template: str = "auto"):
        self.tokenizer, self.max_tokens, self.chat_template = tokenizer, max_tokens, chat_template
        self.why = reason
        self.reason = f" ({reason})" if reason else ""
        self.token_bytes = tokenizer.longest_token_bytes()
        self.max_bytes = self.token_bytes * max_tokens
        self.longest = 0  # tokens of the longest prompt checked so far

    def check(self, where: str, prompt: str | list[dict[str, Any]]) -> list[int]:
        """The prompt's token ids, or a DataError naming `where` when they do not fit (or cannot be made)."""
        # A chat template adds text around the messages, so their contents alone bound the tokens from below.
        num_bytes = sum(len(text.encode("utf-8")) for text in _prompt_texts(prompt))
        if num_bytes > self.max_bytes:
            raise DataError(
                f"{where}: prompt is {num_bytes} bytes, so at least {-(-num_bytes // self.token_bytes)} tokens "
                f"(no token spans more than {self.token_bytes} bytes); at most {self.max_tokens} fit{self.reason}"
            )
        try:
            ids = self.tokenizer.encode_prompt(prompt, self.chat_template)
        except ChatTemplateError as e:
            raise DataError(f"{where}: {e}") from None
        num_tokens = len(ids)
        if not ids:  # an empty chat template, or one that renders only whitespace or comments: nothing to sample after
            templated = self.tokenizer.uses_chat_template(self.chat_template, prompt)
            how = "the chat template renders it" if templated else "it"
            raise DataError(f"{where}: the prompt encodes as no tokens at all ({how} as nothing)")
        if num_tokens > self.max_tokens:
            raise DataError(f"{where}: prompt is {num_tokens} tokens; at most {self.max_tokens} fit{self.reason}")
        self.longest = max(self.longest, num_tokens)
        return ids


def prompt_limit(
    tokenizer: Tokenizer, positions: int, max_new_tokens: int, key: str, chat_template: str = "auto"
) -> PromptLimit:
    """The limit on prompts when responses may take `max_new_tokens` (the config key `key`) of the model's
    `positions`; a ConfigError naming `key` when not even a one-token prompt would fit."""
    if max_new_tokens >= positions:
        raise ConfigError(
            f"{key}={max_new_tokens}: the model's max_position_embeddings is {positions}, so at most "
            f"{positions - 1} new tokens fit after a prompt"
        )
    room = f"model max_position_embeddings {positions} minus {key} {max_new_tokens}"
    return PromptLimit(tokenizer, positions - max_new_tokens, room, chat_template)


def load_problems(
    path: str | Path,
    limit: PromptLimit | None = None,
    chat_template_key: str = "task.chat_template",
    columns: DataColumns | None = None,
    run_dir: Path | None = None,
    key: str = "task.data",
) -> list[Problem]:
    """Problems from a JSONL or Parquet file whose rows have a `prompt` (a non-empty string, or a list of
    chat messages {"role": ..., "content": ...}) and a string or number `answer` (`columns` names them
    otherwise, and may leave the answer out), every row checked now, so that a bad one stops the run before
    it starts. Every other column of a row is kept in `Problem.columns`, with its type.

    With `limit`, every prompt is encoded as training will encode it (under the limit's chat template, the
    value of the config key `chat_template_key`): a list of messages needs the model's chat template, and
    every prompt must fit the limit (`prompt_limit`). The file is read a row at a time, and every error is
    a `DataError` naming the file and line (JSONL) or row (Parquet, counted from 0), or the config `key` that
    names a file that cannot be read; in the file `write_rows`
    made in `run_dir` of the rows given from Python, the dataset's row (a refused run removes the file).
    """
    path = Path(path)
    columns = columns or DataColumns()
    problem = regular_file_problem(path)
    if problem is not None:
        raise DataError(f"{key}: {str(path)!r} {problem}")
    if limit is not None and limit.max_tokens < 1:
        raise DataError(f"{path}: no prompt can fit in {limit.max_tokens} tokens{limit.reason}")
    if path.suffix == ".parquet":
        rows = _parquet_rows(path, columns)
    else:
        prompt_room = 0 if limit is None else JSON_BYTES_PER_TEXT_BYTE * limit.max_bytes
        rows = jsonl_rows(path, ROW_BYTES + prompt_room)
    given = path.stem if run_dir is not None and path.parent.resolve() == (run_dir / DATA_DIR).resolve() else None
    problems = []
    for where, row in rows:
        if given is not None:  # one row per line, as `write_rows` wrote them
            where = f"{given} dataset row {int(where.rpartition(':')[2]) - 1}"
        problem = _problem(where, row, columns)
        if limit is not None:
            if not limit.tokenizer.uses_chat_template(limit.chat_template, problem.prompt) and not isinstance(
                problem.prompt, str
            ):
                why = (
                    f"{chat_template_key}=none"
                    if limit.chat_template == "none"
                    else f"the model {limit.tokenizer.source} has none ({chat_template_key}={limit.chat_template})"
                )
                raise DataError(
                    f"{where}: '{columns.prompt}' is a list of messages, which needs a chat template, and {why}"
                )
            limit.check(where, problem.prompt)
        problems.append(problem)
    if not problems:
        raise DataError(f"{path}: no problems found")
    return problems


def jsonl_rows(path: Path, max_line_bytes: int) -> Iterator[tuple[str, object]]:
    with open(path, "rb") as f:
        try:
            for lineno, line in enumerate(bounded_lines(f, max_line_bytes), 1):
                try:
                    text = line.decode("utf-8").rstrip("\r\n")  # so that JSON's error columns count in this line
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path}:{lineno}: not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})"
                    ) from None
                if not text.strip():
                    continue
                try:
                    row = parse_json(text)
                except JSONError as e:
                    raise DataError(f"{path}:{lineno}: {e}") from None
                yield f"{path}:{lineno}", row
        except LineTooLong as e:
            raise DataError(
                f"{path}:{e.lineno}: line is {e.length} bytes, more than the {max_line_bytes} a row may hold"
            ) from None


def _parquet_rows(path: Path, columns: DataColumns) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        missing = [name for name in columns.required if name not in file.schema_arrow.names]
        if missing:
            raise DataError(f"{path}: {columns.missing(missing[0], file.schema_arrow.names, 'the file')}")
        index = 0
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                yield f"{path}: row {index}", row
                index += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read as Parquet ({e})") from None


PROMPT_FORM = "non-empty string (or list of {role, content} messages)"  # what a row's prompt may be


@dataclass(frozen=True)
class DataColumns:
    """Which columns of a data file hold the prompt and the answer (`task.prompt_column`,
    `task.answer_column`), and whether an answer is needed (the built-in rewards compare with it; reward
    functions of your own read whichever columns they name)."""

    prompt: str = "prompt"
    answer: str = "answer"
    answer_required: bool = True
    keys: bool = False  # the columns are the ones `task.prompt_column` and `task.answer_column` name (a run's)
    prefix: str = "task."  # of those keys' names (`parity eval`'s are prompt_column and answer_column)

    @property
    def required(self) -> tuple[str, ...]:
        return (self.prompt, self.answer) if self.answer_required else (self.prompt,)

    def missing(self, name: str, have: list[str], holder: str = "the row") -> str:
        """What to say of data without column `name` (one of the two), whose `holder` has the columns `have`:
        the config key that names the column, and the columns there are."""
        what = "prompt" if name == self.prompt else "answer"
        key = f"{self.prefix}{what}_column"
        has = f"{holder} has {', '.join(map(repr, have))}" if have else f"{holder} has no columns"
        if not self.keys:
            return f"no {what} column '{name}' ({has})"
        return f"no {what} column '{name}' ({key}={name}; {has}): set {key} to the column that holds the {what}"

    def describe(self) -> str:
        prompt = f"a {PROMPT_FORM} '{self.prompt}'"
        return f"{prompt} and a string or number '{self.answer}'" if self.answer_required else prompt


def _problem(where: str, row: object, columns: DataColumns) -> Problem:
    """The row as a Problem, or a DataError naming what is wrong with it."""
    expected = f"{where}: expected an object with {columns.describe()}"
    if not isinstance(row, dict):
        raise DataError(f"{expected}; got {_kind(row)}")
    for name in columns.required:
        if name not in row:
            raise DataError(f"{where}: {columns.missing(name, list(row))}")
    prompt = check_prompt(where, expected, row[columns.prompt], columns.prompt)
    answer = row.get(columns.answer, "")
    if columns.answer_required and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise DataError(f"{expected}; '{columns.answer}' is {_kind(answer)}")
    if isinstance(answer, float) and not math.isfinite(answer):  # JSON's NaN: no response can equal it
        raise DataError(f"{expected}; '{columns.answer}' is {answer}, which no response can be checked against")
    extra = {k: v for k, v in row.items() if k != columns.prompt}
    return Problem(prompt=prompt, answer=str(answer) if answer is not None else "", columns=extra)


def check_prompt(where: str, expected: str, prompt: object, name: str = "prompt") -> str | list[dict[str, Any]]:
    """`prompt` if it is a non-empty string or a non-empty list of messages, each an object with a string
    'role' and a string 'content' (other keys are kept for the chat template, null ones dropped); else a
    DataError that starts with `expected`."""
    if isinstance(prompt, list):
        if not prompt:
            raise DataError(f"{expected}; '{name}' is an empty list")
        for i, message in enumerate(prompt):
            if not isinstance(message, dict):
                raise DataError(f"{expected}; '{name}' message {i} is {_kind(message)}")
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    got = "missing" if key not in message else _kind(message[key])
                    raise DataError(f"{expected}; '{name}' message {i}: '{key}' is {got}, not a string")
                _check_unicode(where, f"'{name}' message {i} '{key}'", message[key])
        # A null field is no field (chat templates test for missing keys; Parquet structs fill them with null).
        return [{k: v for k, v in m.items() if v is not None} for m in prompt]
    if not isinstance(prompt, str):
        raise DataError(f"{expected}; '{name}' is {_kind(prompt)}")
    if not prompt.strip():
        raise DataError(f"{expected}; '{name}' is {'empty' if not prompt else 'only whitespace'}")
    _check_unicode(where, f"'{name}'", prompt)
    return prompt


def _check_unicode(where: str, what: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can spell a lone surrogate, which no tokenizer takes
        raise DataError(
            f"{where}: {what} is not valid Unicode (lone surrogate {ascii(text[e.start])} at character {e.start + 1})"
        ) from None


def _prompt_texts(prompt: str | list[dict[str, Any]]) -> list[str]:
    """The text a prompt holds: itself, or its messages' contents."""
    return [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]


def _kind(value: object) -> str:
    """What a parsed JSON (or Parquet) value is, in JSON's words."""
    kinds = {
        type(None): "null",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        dict: "an object",
        list: "an array",
    }
    return kinds.get(type(value), f"a {type(value).__name__}")


DATA_DIR = "data"  # in a run directory: the datasets the Python API was given in memory, as JSONL


def write_rows(
    run_dir: Path, name: str, rows: list[dict[str, Any]], split: str, columns: DataColumns | None = None
) -> Path:
    """Rows (dicts of JSON values) as the JSONL file `name` in the run's folder, atomically; a row JSON cannot
    hold, or one without a column `columns` requires, is a DataError naming the dataset and row (not the
    file, which is Parity's own)."""
    lines = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{split} dataset row {i}: expected a dict of columns, got {_kind(row)}")
        if columns is not None:
            _problem(f"{split} dataset row {i}", row, columns)  # its prompt and answer, named by the row
        try:
            lines.append(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
        except (TypeError, ValueError) as e:
            raise DataError(f"{split} dataset row {i}: {_unwritable(row, e)} (columns must hold JSON values)") from None
    if not lines:
        raise DataError(f"{split} dataset: no rows")
    with Folder.open(run_dir, key="run_dir") as run:
        run.mkdir(str(Path(name).parent))
        run.write_text(name, "".join(lines))
    return run_dir / name


def _unwritable(row: dict[str, Any], error: Exception) -> str:
    """What of `row` JSON cannot hold, named by its column: a NaN (pandas' missing value), a set, an object."""
    for column, value in row.items():
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:
            return f"column {column!r} holds NaN or an infinity, which JSON has no number for (missing? fill it)"
        except TypeError as e:
            return f"column {column!r}: {e}"
    return str(error)


def fingerprint(problems: list[Problem]) -> str:
    """A SHA-256 of the problems, in order (prompt, answer, columns): a resume checks that it trains on the
    problems its data position counts in."""
    rows = [[p.prompt, p.answer, p.columns] for p in problems]
    return hashlib.sha256(json.dumps(rows, sort_keys=True, ensure_ascii=False, default=repr).encode()).hexdigest()


class DataOrder:
    """Which problem comes next: a fresh seeded permutation every epoch.

    The whole state is `position`, so a resumed run draws exactly the same prompts.
    """

    def __init__(self, num_items: int, seed: int, position: int = 0):
        self.num_items, self.seed, self.position = num_items, seed, position
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            epoch, offset = divmod(self.position, self.num_items)
            if epoch != self._epoch:
                gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                self._epoch, self._perm = epoch, torch.randperm(self.num_items, generator=gen)
            out.append(int(self._perm[offset]))
            self.position += 1
        return out
