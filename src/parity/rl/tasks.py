"""Tasks: datasets of problems and the reward functions that score responses.

The built-in task is column addition written out step by step, right to left:

    prompt    "4705+386="
    response  "5+6=11,0+8+1=9,7+3=10,4+0+1=5>5091" then EOS

Each step names the two column digits (and +1 for a carry) and their sum; the
response ends with `>` and the answer. Worked solutions are 20-70 tokens, so the
rollout/trainer mismatch has a long sequence to accumulate over.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from parity.config import ConfigError
from parity.engines.tokenizer import ChatTemplateError
from parity.files import JSONError, atomic_write_text, parse_json, regular_file_problem

if TYPE_CHECKING:
    from parity.engines.tokenizer import Tokenizer


# The most problems a command generates or evaluates at once: 10**9 would only hang before the first step.
MAX_PROBLEMS = 100_000


@dataclass(frozen=True)
class Problem:
    """`prompt` is text, or a list of chat messages ({"role": ..., "content": ...}) for the chat template.
    `answer` is the reference answer as text (what the built-in rewards compare with); `columns` holds every
    column of a data file's row but the prompt, each value as the file gave it (an integer stays an integer),
    for reward functions that name them."""

    prompt: str | list[dict[str, Any]]
    answer: str
    columns: dict[str, Any] = field(default_factory=dict, compare=False)


class ArithmeticTask:
    """Addition of two numbers with `min_digits`..`max_digits` digits (the longer operand).

    `split="eval"` draws from a held-out eighth of the problem space that
    `split="train"` never produces, so evaluation problems are never seen in training.
    """

    name = "arithmetic"

    def __init__(self, min_digits: int = 3, max_digits: int = 6):
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"task digits: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        self.min_digits, self.max_digits = min_digits, max_digits

    @staticmethod
    def _held_out(a: int, b: int) -> bool:
        return (a * 1_000_003 + b * 7919) % 8 == 0

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        n = rng.randint(self.min_digits, self.max_digits)
        m = rng.randint(1, n)
        a = rng.randint(10 ** (n - 1), 10**n - 1)
        b = rng.randint(0 if m == 1 else 10 ** (m - 1), 10**m - 1)
        return (a, b) if rng.random() < 0.5 else (b, a)

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        out: list[Problem] = []
        while len(out) < n:
            a, b = self._draw(rng)
            if self._held_out(a, b) == (split == "eval"):
                out.append(Problem(prompt=f"{a}+{b}=", answer=str(a + b), columns={"answer": a + b}))
        return out

    @staticmethod
    def solution(problem: Problem, slip: tuple[int, int] | None = None) -> str:
        """The worked solution (EOS not included).

        `slip=(step, wrong_sum)` writes `wrong_sum` at that step and carries on
        consistently from it, as a person who made one slip would; the built-in
        model is pretrained on some such solutions so that it makes random slips.
        """
        a, b = problem.prompt.rstrip("=").split("+")
        width = max(len(a), len(b))
        da, db = a.zfill(width)[::-1], b.zfill(width)[::-1]
        steps, digits, carry = [], [], 0
        for i, (x, y) in enumerate(zip(da, db)):
            s = int(x) + int(y) + carry
            if slip is not None and slip[0] == i:
                s = slip[1]
            steps.append(f"{x}+{y}{'+1' if carry else ''}={s}")
            digits.append(str(s % 10))
            carry = s // 10
        answer = ("1" if carry else "") + "".join(reversed(digits))
        return ",".join(steps) + ">" + (answer.lstrip("0") or "0")

    @staticmethod
    def num_steps(problem: Problem) -> int:
        return max(len(x) for x in problem.prompt.rstrip("=").split("+"))

    @staticmethod
    def extract_answer(response: str) -> str | None:
        if ">" not in response:
            return None
        return response.rsplit(">", 1)[1].strip()

    def reward(self, problem: Problem, response: str) -> float:
        return 1.0 if self.extract_answer(response) == problem.answer else 0.0


_NAMES = ("Sam", "Maria", "Tom", "Aisha", "Ken", "Lena", "Omar", "Priya", "Jack", "Mei")
_ITEMS = ("apple", "marble", "card", "stamp", "shell", "cookie", "book", "sticker")


def _buys(name: str, item: str, a: int, b: int) -> tuple[str, int]:
    return f"{name} has {a} {item}s and buys {b} more. How many {item}s does {name} have now?", a + b


def _gives(name: str, item: str, a: int, b: int) -> tuple[str, int]:
    return f"{name} had {a} {item}s and gave {b} of them to a friend. How many {item}s are left?", a - b


def _word_problem(rng: random.Random) -> tuple[str, int]:
    """One arithmetic word problem, drawn with `rng`, and its answer (a whole number)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(12)
    if kind == 0:
        return _buys(name, item, rng.randint(5, 90), rng.randint(2, 60))
    if kind == 1:
        a = rng.randint(20, 150)
        return _gives(name, item, a, rng.randint(1, a - 1))
    if kind == 2:
        a, b = rng.randint(6, 48), rng.randint(3, 25)
        return f"A box holds {a} {item}s. How many {item}s are in {b} boxes?", a * b
    if kind == 3:
        b, q = rng.randint(2, 12), rng.randint(3, 30)
        return f"{b * q} {item}s are shared equally among {b} children. How many {item}s does each child get?", q
    if kind == 4:
        a, b = rng.randint(30, 120), rng.randint(2, 9)
        return f"A train travels at {a} miles per hour for {b} hours. How many miles does it travel?", a * b
    if kind == 5:
        a, b = rng.randint(5, 60), rng.randint(3, 30)
        return f"{name} reads {a} pages a day. How many pages does {name} read in {b} days?", a * b
    if kind == 6:
        a, b = rng.randint(2, 95), rng.randint(3, 40)
        return f"A shop sells notebooks at ${a} each. How many dollars do {b} notebooks cost?", a * b
    if kind == 7:
        a, b = rng.randint(10, 250), rng.randint(4, 52)
        c = rng.randint(1, a * b - 1)
        return (
            f"{name} saves ${a} every week. After {b} weeks, {name} spends ${c}. How many dollars are left?",
            a * b - c,
        )
    if kind == 8:
        a, b = rng.randint(5, 40), rng.randint(6, 30)
        c = rng.randint(1, a * b - 1)
        return (
            f"A hall has {a} rows of {b} chairs, and {c} chairs are empty. How many chairs are taken?",
            a * b - c,
        )
    if kind == 9:
        a, b = rng.randint(3, 20), rng.randint(4, 25)
        c = rng.randint(1, a * b - 1)
        return (
            f"{name} buys {a} packs of {b} {item}s and gives away {c} {item}s. How many {item}s does {name} keep?",
            a * b - c,
        )
    if kind == 10:
        a, b = rng.randint(3, 400), rng.randint(2, 300)
        return f"A rectangle is {a} cm long and {b} cm wide. What is its perimeter in centimeters?", 2 * (a + b)
    b, q = rng.randint(2, 25), rng.randint(4, 60)
    return (
        f"A tank holds {b * q} liters and fills at {b} liters per minute. How many minutes does it take to fill it?",
        q,
    )


def _easy_word_problem(rng: random.Random) -> tuple[str, int]:
    """One single-step word problem on numbers below 16 (adding, taking away, equal groups): a
    level a 135M instruct model solves some of the time."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        return _buys(name, item, rng.randint(2, 9), rng.randint(2, 9))
    if kind == 1:
        a = rng.randint(5, 15)
        return _gives(name, item, a, rng.randint(1, a - 1))
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    return f"{name} has {a} bags with {b} {item}s in each bag. How many {item}s does {name} have?", a * b


# Asked of every `worked` problem. SmolLM2-135M-Instruct answers it with 200-400 tokens of working at
# temperature 1 (a third run past 512), against about 90 for the bare question: long responses, where
# BF16's sequence-level mismatch is large, on problems the model still solves some of the time.
WORKED_REQUEST = "Explain your reasoning step by step in detail, then give the final answer."


def _worked_word_problem(rng: random.Random) -> tuple[str, int]:
    """An easy word problem that asks for its working: the same problems at `easy`, answered at length."""
    question, answer = _easy_word_problem(rng)
    return f"{question} {WORKED_REQUEST}", answer


DIFFICULTIES = {"standard": _word_problem, "easy": _easy_word_problem, "worked": _worked_word_problem}


def difficulty_has_no_effect(difficulty: str, task_name: str, data: str) -> bool:
    """A level other than standard applies only to task number's generated problems."""
    return difficulty != "standard" and (task_name != "number" or data != "builtin")


class NumberTask:
    """Arithmetic word problems whose answer is a whole number, for instruct models: `task.name=number`.

    `split="eval"` draws from a held-out eighth of the problems (by their text) that `split="train"`
    never produces. The reward (`number_reward`) reads the answer wherever an instruct model writes it.
    `difficulty`: standard (one or two steps, numbers into the hundreds), easy (`_easy_word_problem`) or
    worked (the easy problems asking for step-by-step working: long answers).
    """

    name = "number"

    def __init__(self, difficulty: str = "standard"):
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {', '.join(DIFFICULTIES)}, got {difficulty!r}")
        self.draw = DIFFICULTIES[difficulty]

    @staticmethod
    def _held_out(prompt: str) -> bool:
        return zlib.crc32(prompt.encode("utf-8")) % 8 == 0

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        out: list[Problem] = []
        while len(out) < n:
            prompt, answer = self.draw(rng)
            if self._held_out(prompt) == (split == "eval"):
                out.append(Problem(prompt=prompt, answer=str(answer), columns={"answer": answer}))
        return out


def builtin_problems(task_name: str, n: int, seed: int, difficulty: str = "standard") -> list[Problem]:
    """The generated problems `task.data=builtin` stands for: word problems of `difficulty` for
    `task.name=number` (its training split), else the built-in arithmetic task's held-out split, which the
    built-in model was not pretrained on."""
    if task_name == "number":
        return NumberTask(difficulty).problems(n, seed=seed, split="train")
    return ArithmeticTask().problems(n, seed=seed, split="eval")


class DataError(ValueError):
    """A dataset file that cannot be used; the message names the file and line."""


# JSONL rows are read one at a time and no longer than a cap, so one enormous line is refused without
# being held in memory. Without a prompt limit a row may hold ROW_BYTES; with one, ROW_BYTES beside the
# longest prompt that could fit, spelled out as JSON may spell it (up to 6 bytes per byte: "\u0041").
ROW_BYTES = 16 * 2**20
JSON_BYTES_PER_TEXT_BYTE = 6
SKIP_CHUNK_BYTES = 2**20  # reading past an over-long line to report its length
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
            how = "the chat template renders it" if self.tokenizer.uses_chat_template(self.chat_template) else "it"
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
) -> list[Problem]:
    """Problems from a JSONL or Parquet file whose rows have a `prompt` (a non-empty string, or a list of
    chat messages {"role": ..., "content": ...}) and a string or number `answer` (`columns` names them
    otherwise, and may leave the answer out), every row checked now, so that a bad one stops the run before
    it starts. Every other column of a row is kept in `Problem.columns`, with its type.

    With `limit`, every prompt is encoded as training will encode it (under the limit's chat template, the
    value of the config key `chat_template_key`): a list of messages needs the model's chat template, and
    every prompt must fit the limit (`prompt_limit`). The file is read a row at a time, and every error is
    a `DataError` naming the file and line (JSONL) or row (Parquet, counted from 0).
    """
    path = Path(path)
    columns = columns or DataColumns()
    problem = regular_file_problem(path)
    if problem is not None:
        raise DataError(f"task.data: {str(path)!r} {problem}")
    if limit is not None and limit.max_tokens < 1:
        raise DataError(f"{path}: no prompt can fit in {limit.max_tokens} tokens{limit.reason}")
    if path.suffix == ".parquet":
        rows = _parquet_rows(path, columns)
    else:
        prompt_room = 0 if limit is None else JSON_BYTES_PER_TEXT_BYTE * limit.max_bytes
        rows = _jsonl_rows(path, ROW_BYTES + prompt_room)
    problems = []
    for where, row in rows:
        problem = _problem(where, row, columns)
        if limit is not None:
            if not isinstance(problem.prompt, str) and not limit.tokenizer.uses_chat_template(limit.chat_template):
                why = (
                    f"{chat_template_key}=none"
                    if limit.chat_template == "none"
                    else f"the model {limit.tokenizer.source} has none ({chat_template_key}=auto)"
                )
                raise DataError(
                    f"{where}: '{columns.prompt}' is a list of messages, which needs a chat template, and {why}"
                )
            limit.check(where, problem.prompt)
        problems.append(problem)
    if not problems:
        raise DataError(f"{path}: no problems found")
    return problems


def _jsonl_rows(path: Path, max_line_bytes: int) -> Iterator[tuple[str, object]]:
    with open(path, "rb") as f:
        for lineno in itertools.count(1):
            line = f.readline(max_line_bytes + 1)  # room for the newline
            if not line:
                return
            if len(line) > max_line_bytes and not line.endswith(b"\n"):
                raise DataError(
                    f"{path}:{lineno}: line is {_line_length(line, f)} bytes, more than the {max_line_bytes} "
                    "a row may hold"
                )
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


def _line_length(start: bytes, f: BinaryIO) -> int:
    """Bytes in the line that begins with `start` (newline excluded), reading the rest in chunks."""
    length, part = len(start), start
    while not part.endswith(b"\n") and (part := f.readline(SKIP_CHUNK_BYTES)):
        length += len(part)
    return length - 1 if part.endswith(b"\n") else length


def _parquet_rows(path: Path, columns: DataColumns) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        missing = set(columns.required) - set(file.schema_arrow.names)
        if missing:
            raise DataError(
                f"{path}: missing column(s) {sorted(missing)}; need {columns.describe()} "
                f"(the file has {', '.join(file.schema_arrow.names)})"
            )
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

    @property
    def required(self) -> tuple[str, ...]:
        return (self.prompt, self.answer) if self.answer_required else (self.prompt,)

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
            raise DataError(f"{expected}; '{name}' is missing (it has {', '.join(map(repr, row)) or 'no keys'})")
    prompt = check_prompt(where, expected, row[columns.prompt], columns.prompt)
    answer = row.get(columns.answer, "")
    if columns.answer_required and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise DataError(f"{expected}; '{columns.answer}' is {_kind(answer)}")
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


def write_rows(path: Path, rows: list[dict[str, Any]], split: str) -> Path:
    """Rows (dicts of JSON values) as a JSONL file, atomically; a row JSON cannot hold is a DataError."""
    lines = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{split} dataset row {i}: expected a dict of columns, got {_kind(row)}")
        try:
            lines.append(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
        except (TypeError, ValueError) as e:
            raise DataError(f"{split} dataset row {i}: {e} (columns must hold JSON values)") from None
    if not lines:
        raise DataError(f"{split} dataset: no rows")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(lines))
    return path


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


# ----------------------------------------------------------------------------- rewards
# A reward function takes (problem, response text, response length in tokens).
RewardFn = Callable[[Problem, str, int], float]

_BOXED = re.compile(r"\\boxed\s*\{")


def extract_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} in `text` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def builtin_reward(problem: Problem, response: str, length: int) -> float:
    return ArithmeticTask().reward(problem, response)


def length_reward(problem: Problem, response: str, length: int) -> float:
    """−(response length in tokens, EOS included): the optimum is to stop at once."""
    return -float(length)


def exact_reward(problem: Problem, response: str, length: int) -> float:
    return 1.0 if response.strip() == problem.answer.strip() else 0.0


def math_reward(problem: Problem, response: str, length: int) -> float:
    """1 if the last \\boxed{} answer equals the reference under `math-verify`."""
    import logging

    from math_verify import parse, verify

    # The reward runner enforces the timeout; math-verify's own (signal-based) is off.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    boxed = extract_boxed(response)
    if boxed is None:
        return 0.0
    answer = problem.answer if "\\boxed" in problem.answer else f"${problem.answer}$"
    gold = parse(answer, parsing_timeout=None)
    guess = parse(f"\\boxed{{{boxed}}}", parsing_timeout=None)
    return 1.0 if verify(gold, guess, timeout_seconds=None) else 0.0


# A number as models write it: an optional sign or "$", digits with optional thousands commas, an optional
# decimal part ("1,234.50"; the period ending a sentence is not one), units allowed after it ("360km").
# Digits inside a word ("H2O", "v1.2") are not numbers, and a "-" after a digit or a letter is an operator
# or a hyphen ("12-7"), not a sign.
_NUMBER = re.compile(r"(?<![\w.])(-?)\$?(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?!\d)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)[\s:]*(?:\*\*)?\s*", re.IGNORECASE)


def _to_number(match: re.Match) -> Decimal:
    sign, whole, fraction = match.groups()
    return Decimal(sign + whole.replace(",", "") + (fraction or ""))


def extract_number(text: str) -> Decimal | None:
    """The answer a response gives as a number: inside its last \\boxed{} if it has one, else after its last
    "answer is" (or "answer:"), else its last number; None when there is none there."""
    boxed = extract_boxed(text)
    if boxed is not None:
        text = boxed
    else:
        stated = [m.end() for m in _ANSWER_IS.finditer(text)]
        if stated and (match := _NUMBER.match(text, stated[-1])):
            return _to_number(match)
    numbers = list(_NUMBER.finditer(text))
    return _to_number(numbers[-1]) if numbers else None


def number_reward(problem: Problem, response: str, length: int) -> float:
    """1 if the response's answer (`extract_number`) equals the reference answer as a number, else 0."""
    expected = _NUMBER.fullmatch(problem.answer.strip().rstrip("."))
    if expected is None:
        raise ValueError(f"task.name=number: the answer {problem.answer!r} is not a number")
    return 1.0 if extract_number(response) == _to_number(expected) else 0.0


REWARDS: dict[str, RewardFn] = {
    "builtin": builtin_reward,
    "length": length_reward,
    "exact": exact_reward,
    "math": math_reward,
    "number": number_reward,
}
TRUSTED_REWARDS = {"builtin", "length", "exact", "number"}  # fast, pure: run in-process


# Characters of the built-in model's vocabulary (after the special tokens).
BUILTIN_CHARS = "0123456789+=,>"
BUILTIN_SPECIALS = ("<pad>", "<eos>")
