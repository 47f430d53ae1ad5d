"""Tasks: datasets of problems and the reward functions that score responses.

The built-in task is column addition written out step by step, right to left:

    prompt    "4705+386="
    response  "5+6=11,0+8+1=9,7+3=10,4+0+1=5>5091" then EOS

Each step names the two column digits (and +1 for a carry) and their sum; the
response ends with `>` and the answer. Worked solutions are 20-70 tokens, so the
rollout/trainer mismatch has a long sequence to accumulate over.
"""

from __future__ import annotations

import importlib
import itertools
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from parity.config import ConfigError

if TYPE_CHECKING:
    from parity.engines.tokenizer import Tokenizer


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


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
                out.append(Problem(prompt=f"{a}+{b}=", answer=str(a + b)))
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
    """At most `max_tokens` tokens per prompt, as `tokenizer.encode` counts them (BOS included).

    Tokenizing costs some hundreds of bytes of memory per byte of text, so a prompt is tokenized only
    when its length could fit: no token spans more UTF-8 bytes of the prompt than its vocabulary
    entry has (`token_bytes`, the longest entry), so a prompt of more than token_bytes x max_tokens
    bytes is certainly too long. That holds for byte-level and SentencePiece BPE vocabularies (the
    tokenizers of Llama and Qwen2 models; a byte-fallback entry "<0x0A>" spans one byte) and for the
    built-in character tokenizer; it can fail for a tokenizer whose normalizer shrinks text (NFKC,
    lowercasing) or whose unknown token spans whole words (WordPiece, WordLevel over words).
    """

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, reason: str | None = None):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.reason = f" ({reason})" if reason else ""
        self.token_bytes = tokenizer.longest_token_bytes()
        self.max_bytes = self.token_bytes * max_tokens

    def check(self, where: str, prompt: str) -> None:
        num_bytes = len(prompt.encode("utf-8"))
        if num_bytes > self.max_bytes:
            raise DataError(
                f"{where}: prompt is {num_bytes} bytes, so at least {-(-num_bytes // self.token_bytes)} tokens "
                f"(no token spans more than {self.token_bytes} bytes); at most {self.max_tokens} fit{self.reason}"
            )
        num_tokens = len(self.tokenizer.encode(prompt))
        if num_tokens > self.max_tokens:
            raise DataError(f"{where}: prompt is {num_tokens} tokens; at most {self.max_tokens} fit{self.reason}")


def load_problems(
    path: str | Path,
    tokenizer: Tokenizer | None = None,
    max_prompt_tokens: int | None = None,
    limit_reason: str | None = None,
) -> list[Problem]:
    """Problems from a JSONL or Parquet file whose rows have a non-empty string `prompt` and a string
    or number `answer`, every row checked now, so that a bad one stops the run before it starts.

    With `tokenizer` and `max_prompt_tokens`, every prompt must fit in `max_prompt_tokens` tokens
    (`limit_reason` says why that many, e.g. "model max_position_embeddings 2048 minus
    rollout.max_new_tokens 512"). The file is read a row at a time, and every error is a `DataError`
    naming the file and line (JSONL) or row (Parquet, counted from 0).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"task.data: file {str(path)!r} does not exist")
    if (tokenizer is None) != (max_prompt_tokens is None):
        raise ValueError("load_problems: pass tokenizer and max_prompt_tokens together")
    limit = PromptLimit(tokenizer, max_prompt_tokens, limit_reason) if tokenizer is not None else None
    if limit is not None and limit.max_tokens < 1:
        raise DataError(f"{path}: no prompt can fit in {limit.max_tokens} tokens{limit.reason}")
    if path.suffix == ".parquet":
        rows = _parquet_rows(path)
    else:
        prompt_room = 0 if limit is None else JSON_BYTES_PER_TEXT_BYTE * limit.max_bytes
        rows = _jsonl_rows(path, ROW_BYTES + prompt_room)
    problems = []
    for where, row in rows:
        problem = _problem(where, row)
        if limit is not None:
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
                yield f"{path}:{lineno}", json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None


def _line_length(start: bytes, f: BinaryIO) -> int:
    """Bytes in the line that begins with `start` (newline excluded), reading the rest in chunks."""
    length, part = len(start), start
    while not part.endswith(b"\n") and (part := f.readline(SKIP_CHUNK_BYTES)):
        length += len(part)
    return length - 1 if part.endswith(b"\n") else length


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        missing = {"prompt", "answer"} - set(file.schema_arrow.names)
        if missing:
            raise DataError(f"{path}: missing column(s) {sorted(missing)}; need 'prompt' and 'answer'")
        index = 0
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["prompt", "answer"]):
            for row in batch.to_pylist():
                yield f"{path}: row {index}", row
                index += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read as Parquet ({e})") from None


def _problem(where: str, row: object) -> Problem:
    """The row as a Problem, or a DataError naming what is wrong with it."""
    expected = f"{where}: expected an object with a non-empty string 'prompt' and a string or number 'answer'"
    if not isinstance(row, dict):
        raise DataError(f"{expected}; got {_kind(row)}")
    for field in ("prompt", "answer"):
        if field not in row:
            raise DataError(f"{expected}; '{field}' is missing")
    prompt, answer = row["prompt"], row["answer"]
    if not isinstance(prompt, str):
        raise DataError(f"{expected}; 'prompt' is {_kind(prompt)}")
    if not prompt.strip():
        raise DataError(f"{expected}; 'prompt' is {'empty' if not prompt else 'only whitespace'}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f"{expected}; 'answer' is {_kind(answer)}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can spell a lone surrogate, which no tokenizer takes
        raise DataError(
            f"{where}: 'prompt' is not valid Unicode (lone surrogate {ascii(prompt[e.start])} at character "
            f"{e.start + 1})"
        ) from None
    return Problem(prompt=prompt, answer=str(answer))


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


REWARDS: dict[str, RewardFn] = {
    "builtin": builtin_reward,
    "length": length_reward,
    "exact": exact_reward,
    "math": math_reward,
}
TRUSTED_REWARDS = {"builtin", "length", "exact"}  # fast, pure: run in-process


def import_reward_fn(spec: str) -> RewardFn:
    """`module:function` -> the function, called as fn(prompt, response, answer) -> float."""
    if spec.count(":") != 1:
        raise ConfigError(f"task.reward_fn: expected 'module:function', got {spec!r}")
    module_name, fn_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a missing module, a syntax error, or anything its top level raises
        summary = " ".join(f"{type(e).__name__}: {e}".split())  # one line for the CLI's error message
        raise ConfigError(f"task.reward_fn: importing {module_name!r} failed: {summary}") from None
    if not hasattr(module, fn_name):
        raise ConfigError(f"task.reward_fn: module {module_name!r} has no function {fn_name!r}")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise ConfigError(f"task.reward_fn: {module_name}.{fn_name} is a {type(fn).__name__}, not a function")

    def reward(problem: Problem, response: str, length: int) -> float:
        return float(fn(problem.prompt, response, problem.answer))

    reward.__qualname__ = spec
    return reward


# Characters of the built-in model's vocabulary (after the special tokens).
BUILTIN_CHARS = "0123456789+=,>"
BUILTIN_SPECIALS = ("<pad>", "<eos>")
