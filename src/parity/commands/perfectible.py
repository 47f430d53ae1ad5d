"""`parity perfectible`: problems the base model solves sometimes.

Sample K responses per problem at temperature 1 with the base model, score them
with the task's checker as training does (a response cut off at the length limit
scores 0 under the default `truncated=zero_reward`), and keep the problems whose
accuracy lies in [lo, hi] (default [0.2, 0.8]). On such a set any sound RL algorithm must reach
near-100% training accuracy: the model can already produce the right answer,
it only has to learn to prefer it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from parity.config import ConfigError, check_range, one_of
from parity.engines import kernels
from parity.engines.budget import check_rollout_memory
from parity.engines.models.io import load_checked_config, load_model, resolve_model_dir
from parity.engines.precision import PRECISIONS
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import CHAT_TEMPLATE_MODES, Tokenizer, load_tokenizer
from parity.files import JSONError, parse_json, regular_file_problem
from parity.folders import atomic_write_text
from parity.outdir import check_writable
from parity.rl.algorithms import TRUNCATION_MODES
from parity.rl.data import load_problems, prompt_limit
from parity.rl.problems import DIFFICULTIES, MAX_PROBLEMS, Problem
from parity.rl.rewards import RewardRunner, score_rollouts, training_rewards
from parity.rl.tasks import TASKS, builtin_problems, difficulty_has_no_effect
from parity.rl.train_config import MAX_SEED
from parity.runtime import draws_bars


@dataclass
class PerfectibleConfig:
    model: str = "builtin"
    task: str = "builtin"  # the checker: builtin | exact | math | number
    data: str = "builtin"  # builtin (generated problems: word problems for task=number) or a JSONL/Parquet file
    difficulty: str = "standard"  # task=number's generated word problems: standard | easy | worked
    num_candidates: int = 256  # builtin data: how many problems to try
    samples: int = 16  # K
    lo: float = 0.2
    hi: float = 0.8
    max_new_tokens: int = 96
    precision: str = "fp32"
    seed: int = 0
    batch_prompts: int = 32  # prompts per generate() call
    out: str = "perfectible.jsonl"
    chat_template: str = "auto"  # auto (the model's chat template, when it has one) | none (raw text)
    device: str = "cpu"  # cpu | cuda: where the rollout engine runs
    truncated: str = "zero_reward"  # a response cut off at max_new_tokens, as training scores it (algorithm.truncated)

    def validate(self) -> None:
        kernels.check_device(self.device)
        one_of("precision", self.precision, PRECISIONS)
        check_range("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, ">= 1")
        if self.task not in TASKS or not TASKS[self.task].binary:
            raise ConfigError(f"task: {self.task!r} has no right answer; use builtin, exact, math or number")
        if TASKS[self.task].episodes:
            raise ConfigError(
                f"task: {self.task!r} is answered in episodes with tools, which perfectible does not sample (one "
                "turn per problem); use builtin, exact, math or number"
            )
        if self.difficulty not in DIFFICULTIES:
            raise ConfigError(f"difficulty: unknown value {self.difficulty!r}; allowed: {', '.join(DIFFICULTIES)}")
        if difficulty_has_no_effect(self.difficulty, self.task, self.data):
            raise ConfigError("difficulty: only the generated word problems of task=number (data=builtin) have levels")
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ConfigError(
                f"chat_template: unknown value {self.chat_template!r}; allowed: {', '.join(CHAT_TEMPLATE_MODES)}"
            )
        if self.truncated not in TRUNCATION_MODES:
            raise ConfigError(
                f"truncated: unknown value {self.truncated!r}; allowed: {', '.join(TRUNCATION_MODES)} "
                "(as algorithm.truncated)"
            )
        if not 0 <= self.lo <= self.hi <= 1:
            raise ConfigError(f"lo, hi: need 0 <= lo <= hi <= 1, got {self.lo}, {self.hi}")
        for key in ("samples", "num_candidates", "batch_prompts"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be >= 1, got {getattr(self, key)}")
        problem = regular_file_problem(Path(self.data).expanduser()) if self.data != "builtin" else None
        if problem is not None:
            raise ConfigError(f"data: {self.data!r} {problem} (builtin, or a JSONL/Parquet file)")
        # as `parity train`'s counts; batch_prompts x samples is checked against the model (`candidate_problems`)
        check_range(
            "num_candidates", self.num_candidates, self.num_candidates <= MAX_PROBLEMS, f"in [1, {MAX_PROBLEMS:,}]"
        )
        check_range("seed", self.seed, 0 <= self.seed <= MAX_SEED, f"in [0, {MAX_SEED}]")


def filter_perfectible(accuracies: list[float], lo: float, hi: float) -> list[int]:
    """Indices of problems whose accuracy lies in [lo, hi]."""
    return [i for i, a in enumerate(accuracies) if lo <= a <= hi]


def histogram(accuracies: list[float], samples: int) -> list[int]:
    """Number of problems solved k times, k = 0..samples."""
    counts = [0] * (samples + 1)
    for a in accuracies:
        counts[round(a * samples)] += 1
    return counts


def format_histogram(counts: list[int], lo: float, hi: float, width: int = 40) -> str:
    k = len(counts) - 1
    top = max(counts) or 1
    lines = []
    for solved, n in enumerate(counts):
        mark = "*" if lo <= solved / k <= hi else " "
        lines.append(f"{solved:>3}/{k} {mark} {'#' * round(width * n / top):<{width}} {n}")
    return "\n".join(lines) + f"\n(* = kept: accuracy in [{lo}, {hi}])"


def candidate_problems(cfg: PerfectibleConfig) -> list[Problem]:
    """The problems to search, every prompt checked to fit the model with `max_new_tokens` after it, and a
    generate() call of `batch_prompts` of them x `samples` to fit in memory."""
    model_dir = resolve_model_dir(cfg.model)
    config = load_checked_config(model_dir)
    positions = config.max_position_embeddings
    limit = prompt_limit(load_tokenizer(model_dir), positions, cfg.max_new_tokens, "max_new_tokens", cfg.chat_template)
    if cfg.data != "builtin":
        problems = load_problems(cfg.data, limit, "chat_template", key="data")
    else:
        problems = builtin_problems(cfg.task, cfg.num_candidates, cfg.seed, cfg.difficulty)
        for i, problem in enumerate(problems):
            limit.check(f"generated problem {i}", problem.prompt)
    rows = min(cfg.batch_prompts, len(problems)) * cfg.samples
    keys = "batch_prompts x samples, max_new_tokens"
    check_rollout_memory(config, rows, limit.longest, cfg.max_new_tokens, keys, cfg.device)
    return problems


def problem_accuracies(
    engine: RolloutEngine,
    tokenizer: Tokenizer,
    problems: list[Problem],
    runner: RewardRunner,
    samples: int,
    max_new_tokens: int = 96,
    seed: int = 0,
    batch_prompts: int = 32,
    progress: bool = False,
    chat_template: str = "auto",
    truncated: str = "zero_reward",
) -> list[float]:
    """Fraction of `samples` responses at temperature 1 that score 1 as training scores them, per problem
    (prompts encoded under `chat_template`, one of CHAT_TEMPLATE_MODES; a response cut off at
    `max_new_tokens` under `truncated`, one of TRUNCATION_MODES: `zero_reward` scores it 0)."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    accuracies: list[float] = []
    for start in tqdm(
        range(0, len(problems), batch_prompts), desc="perfectible", unit="batch", disable=not draws_bars(progress)
    ):
        chunk = problems[start : start + batch_prompts]
        prompts = [tokenizer.encode_prompt(p.prompt, chat_template) for p in chunk]
        batch = engine.generate(prompts, samples, sampling, seed=seed + start)
        checked = torch.tensor(score_rollouts(batch, chunk, tokenizer, runner).rewards)
        scores = training_rewards(checked, batch.truncated.cpu(), truncated).view(len(chunk), samples)
        accuracies.extend((scores >= 1.0).float().mean(-1).tolist())
    return accuracies


def measure_accuracies(cfg: PerfectibleConfig, problems: list[Problem], progress: bool = True) -> list[float]:
    model_dir = resolve_model_dir(cfg.model)
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, kernels.numerics())
    engine = RolloutEngine(model.config, cfg.precision, tok.eos_ids, tok.pad_id, kernels.numerics(cfg.device))
    engine.weights.load(model.state_dict(), version=0)
    task = TASKS[cfg.task]
    runner = RewardRunner(task.reward, isolate=not task.trusted)
    try:
        return problem_accuracies(
            engine,
            tok,
            problems,
            runner,
            cfg.samples,
            cfg.max_new_tokens,
            cfg.seed,
            cfg.batch_prompts,
            progress,
            cfg.chat_template,
            cfg.truncated,
        )
    finally:
        runner.close()


SET_FIELDS = {"prompt", "answer", "base_accuracy"}  # each row `write_set` writes, and only those
MAX_SET_BYTES = 256 * 2**20


def check_out(path: Path) -> None:
    """Refuse an `out` that cannot be written, or that exists and is not a perfectible set (every line a row
    `write_set` writes): Parity replaces only a file it wrote, never one of the user's under the same name.
    The search's cache folder must take it too (`cache_dir`)."""
    check_writable(path.parent, f"out: {path}")
    check_writable(cache_dir(), f"the perfectible search's cache {cache_dir()} (XDG_CACHE_HOME)")
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_SET_BYTES:
        raise ConfigError(f"out: {path} exists and is not a perfectible set Parity wrote; choose another out")
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                row = parse_json(line.decode("utf-8"))
            except (JSONError, UnicodeDecodeError):
                row = None
            if not isinstance(row, dict) or row.keys() != SET_FIELDS:
                raise ConfigError(
                    f"out: {path}:{lineno} is not a row of a perfectible set, so the file is not one Parity "
                    "wrote; it is left as it is: choose another out"
                )


def write_set(path: Path, problems: list[Problem], accuracies: list[float], keep: list[int]) -> None:
    rows = [
        json.dumps({"prompt": problems[i].prompt, "answer": problems[i].answer, "base_accuracy": accuracies[i]})
        for i in keep
    ]
    atomic_write_text(path, "".join(r + "\n" for r in rows))


def cache_key(cfg: PerfectibleConfig) -> str:
    """Identifies a perfectible search: the model directory's files (its weights, and its config, tokenizer
    and chat template, which shape its answers as much) and every setting that shapes its accuracies (the
    bounds lo and hi only filter them)."""
    model_dir = resolve_model_dir(cfg.model)
    h = hashlib.sha256()
    for f in sorted(f for f in model_dir.iterdir() if f.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    settings = {k: v for k, v in vars(cfg).items() if k not in ("model", "out", "batch_prompts", "lo", "hi")}
    h.update(json.dumps(settings, sort_keys=True).encode())
    if cfg.data != "builtin":  # a data file edited in place is another set of problems
        h.update(Path(cfg.data).read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "parity"  # empty: unset, as XDG says


def search_path(cfg: PerfectibleConfig) -> Path:
    """Where the cache keeps the accuracies of `cfg`'s candidates."""
    return cache_dir() / f"perfectible-{cache_key(cfg)}.json"


def _cached_accuracies(meta: Path, cfg: PerfectibleConfig) -> list[float] | None:
    """The accuracies a search cached, or None when the file is not one it wrote for `cfg` (then it is
    measured again and rewritten: the cache is Parity's own folder)."""
    try:
        accuracies = parse_json(meta.read_text(encoding="utf-8")).get("accuracies")
    except (JSONError, UnicodeDecodeError, AttributeError, OSError):
        return None
    count = cfg.num_candidates if cfg.data == "builtin" else None
    ok = isinstance(accuracies, list) and all(isinstance(a, float) and 0 <= a <= 1 for a in accuracies)
    return accuracies if ok and count in (None, len(accuracies)) else None


def build_or_load(cfg: PerfectibleConfig, progress: bool = True) -> tuple[Path, list[float], bool]:
    """The perfectible set for `cfg`: its candidates' accuracies from the cache, or measured and cached,
    and the set they give within [lo, hi] written beside them. The bounds only filter, so other bounds
    do not measure again.

    Returns (path of the JSONL set, accuracies of all candidates, whether they were cached).
    """
    meta = search_path(cfg)
    path = meta.with_name(f"{meta.stem}-{cfg.lo:g}-{cfg.hi:g}.jsonl")
    accuracies = _cached_accuracies(meta, cfg) if meta.is_file() else None
    cached = accuracies is not None
    problems = None  # the candidates are read (a data file tokenized) only when something needs them
    if not cached:
        problems = candidate_problems(cfg)
        accuracies = measure_accuracies(cfg, problems, progress)
        atomic_write_text(meta, json.dumps({"accuracies": accuracies}) + "\n")
    if not path.is_file():
        if problems is None:
            problems = candidate_problems(cfg)
        write_set(path, problems, accuracies, filter_perfectible(accuracies, cfg.lo, cfg.hi))
    return path, accuracies, cached
