"""`parity mismatch`: offline measurement of how far apart the two engines are.

For each (trainer precision, rollout precision) pair: load the same FP32 weights
into both engines, sample responses with the rollout engine (recording μ), score
the same tokens with the trainer (π), and report every mismatch metric.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from parity.commands.prompts import CHAT_QUESTIONS, LONG_ANSWER_REQUESTS
from parity.config import ConfigError, check_range
from parity.engines import kernels
from parity.engines import precision as prec
from parity.engines.batch import RolloutBatch
from parity.engines.budget import check_rollout_memory
from parity.engines.locate import StageDiff, first_divergence, format_table, locate_row, worst_row
from parity.engines.models.io import load_checked_config, load_model, require_finite_logits, resolve_model_dir
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import CHAT_TEMPLATE_MODES, Prompt, has_builtin_tokenizer, load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer, full_vocab_logprobs
from parity.files import regular_file_problem
from parity.outdir import claim_output_dir, write_output, write_output_json
from parity.rl.checkpoint import require_finite_weights
from parity.rl.data import PROMPT_FORM, ROW_BYTES, DataError, check_prompt, jsonl_rows, prompt_limit
from parity.rl.diagnostics import (
    LENGTH_BIN_EDGES,
    batch_shape_metrics,
    full_vocab_metrics,
    mismatch_by_length,
    mismatch_metrics,
)
from parity.rl.problems import MAX_PROBLEMS, ArithmeticTask
from parity.rl.train_config import MAX_SEED
from parity.runtime import draws_bars, progress_line

# Metrics shown in the markdown table, with their ratio to the FP16 run.
TABLE_METRICS = ("k3", "token_abs_log_ratio_mean", "seq_abs_log_ratio", "prob_abs_diff_mean", "chi2_token")


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 96

    def params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.max_new_tokens)

    def validate(self) -> None:
        try:
            self.params()
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class MismatchConfig:
    model: str = "builtin"
    # builtin: the arithmetic task's prompts for the built-in model, the shipped chat questions
    # (`prompts.CHAT_QUESTIONS`) for any other; long: the shipped requests for long answers
    # (`prompts.LONG_ANSWER_REQUESTS`); or a JSONL file, one {"prompt": ...} per line (`load_prompts`)
    prompts: str = "builtin"
    chat_template: str = "auto"  # auto (the model's chat template, when it has one) | none (raw text)
    num_prompts: int = 128
    group_size: int = 4
    # Each entry is TRAINER/ROLLOUT precision, e.g. "bf16/fp32" = BF16 trainer, FP32 rollout.
    pairs: list[str] = field(default_factory=lambda: ["fp32/fp32", "bf16/bf16", "fp16/fp16", "bf16/fp32"])
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    out: str = "parity-mismatch"
    exact: bool = False  # both engines in exact mode (docs/exact.md): pairs must match precisions
    device: str = "cpu"  # cpu | cuda: where both engines run
    # Positions where the two engines' whole next-token distributions are compared (0 = off)
    full_vocab_positions: int = 64
    # The trainer scores the same tokens again in micro-batches of this many rows: how much its
    # log-probs move with the batch's shape alone (0 = off)
    shape_micro_batch: int = 3

    def validate(self) -> None:
        kernels.check_device(self.device)
        for key in ("full_vocab_positions", "shape_micro_batch"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}: must be >= 0 (0 = off), got {getattr(self, key)}")
        if not self.pairs or len(set(self.pairs)) != len(self.pairs):
            raise ConfigError(f"pairs: expected distinct TRAINER/ROLLOUT pairs, at least one, got {self.pairs}")
        for p in self.pairs:
            train_p, roll_p = parse_pair(p)
            if self.exact and train_p != roll_p:
                raise ConfigError(
                    f"pairs: {p!r} mixes precisions, and exact=true makes the two engines compute the same bits "
                    "in one precision; use pairs like fp16/fp16"
                )
        if self.num_prompts < 1 or self.group_size < 1:
            low = "num_prompts" if self.num_prompts < 1 else "group_size"
            raise ConfigError(f"{low}: must be >= 1, got {getattr(self, low)}")
        # as `parity train`'s counts; num_prompts x group_size is checked against the model (`run_mismatch`)
        check_range("num_prompts", self.num_prompts, self.num_prompts <= MAX_PROBLEMS, f"in [1, {MAX_PROBLEMS:,}]")
        check_range("seed", self.seed, 0 <= self.seed <= MAX_SEED, f"in [0, {MAX_SEED}]")
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ConfigError(
                f"chat_template: unknown value {self.chat_template!r}; allowed: {', '.join(CHAT_TEMPLATE_MODES)}"
            )


def parse_pair(pair: str) -> tuple[str, str]:
    parts = pair.split("/")
    if len(parts) != 2 or any(p not in prec.PRECISIONS for p in parts):
        raise ConfigError(
            f"pairs: {pair!r} is not TRAINER/ROLLOUT with each one of {', '.join(prec.PRECISIONS)} "
            "(for example bf16/fp32)"
        )
    return parts[0], parts[1]


def load_prompts(source: str, n: int, seed: int, model: str = "builtin") -> list[Prompt]:
    """At most `n` prompts. `builtin`: `n` arithmetic problems for the built-in model (or a checkpoint trained
    from it: `has_builtin_tokenizer`), `n` of the shipped chat
    questions (drawn with `seed`; all of them when `n` is more) for any other model. `long`: `n` of the shipped
    requests for long answers, drawn the same way. Otherwise a JSONL file
    (UTF-8): each non-blank line an object whose "prompt" is a non-empty string or a list of chat messages
    ({"role": ..., "content": ...}, for the model's chat template); other fields are ignored and the first
    `n` prompts are used."""
    if source == "builtin":
        if str(model) == "builtin" or has_builtin_tokenizer(resolve_model_dir(model)):
            return [p.prompt for p in ArithmeticTask().problems(n, seed=seed, split="eval")]
        return random.Random(seed).sample(CHAT_QUESTIONS, min(n, len(CHAT_QUESTIONS)))
    if source == "long":
        return random.Random(seed).sample(LONG_ANSWER_REQUESTS, min(n, len(LONG_ANSWER_REQUESTS)))
    path = Path(source)
    problem = regular_file_problem(path)
    if problem is not None:
        raise ConfigError(f"prompts: {source!r} {problem} (use 'builtin', 'long' or a JSONL file)")
    prompts: list[Prompt] = []
    try:
        for where, row in jsonl_rows(path, ROW_BYTES):
            expected = f"{where}: expected an object with a {PROMPT_FORM} 'prompt'"
            if not isinstance(row, dict) or "prompt" not in row:
                raise ConfigError(expected)
            prompts.append(check_prompt(where, expected, row["prompt"]))
            if len(prompts) == n:
                break
    except DataError as e:  # a line that is not UTF-8 or JSON, or too long; a prompt of the wrong form
        raise ConfigError(str(e)) from None
    if not prompts:
        raise ConfigError(f"{path}: no prompts found")
    return prompts


@dataclass
class PairResult:
    trainer_precision: str
    rollout_precision: str
    metrics: dict[str, float]
    by_length: dict[str, float]
    num_sequences: int
    num_tokens: int
    seconds: float
    # Kept for the plots, not written to JSON.
    trainer_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    mask: torch.Tensor
    located: list[StageDiff] | None = None  # with --locate: the worst row re-scored stage by stage
    exact: bool = False  # measured in exact mode
    full_vocab: dict[str, float] = field(default_factory=dict)  # `full_vocab_metrics` at the recorded positions
    batch_shape: dict[str, float] = field(default_factory=dict)  # `batch_shape_metrics`, trainer against itself

    @property
    def label(self) -> str:
        if self.trainer_precision == self.rollout_precision:
            return self.trainer_precision + ("-exact" if self.exact else "")
        return f"{self.trainer_precision}-train/{self.rollout_precision}-roll"


def measure_pair(
    trainer: Trainer, engine: RolloutEngine, prompts: list[list[int]], cfg: MismatchConfig
) -> tuple[torch.Tensor, RolloutBatch, dict[str, float], dict[str, float]]:
    """Sample with `engine`, score with `trainer`; returns π, the batch with μ, the full-vocabulary
    comparison at `cfg.full_vocab_positions` positions and the trainer's batch-shape invariance."""
    engine.weights.load(*trainer.export_weights())
    sampling = cfg.sampling.params()
    batch = engine.generate(prompts, cfg.group_size, sampling, seed=cfg.seed, full_vocab=cfg.full_vocab_positions)

    everything = torch.arange(len(batch.prompt_ids), device=batch.response_ids.device)
    full_vocab, batch_shape = {}, {}
    with torch.no_grad():
        pi = trainer.batch_logprobs(batch, everything)
        if cfg.shape_micro_batch:
            again = torch.cat([trainer.batch_logprobs(batch, rows) for rows in everything.split(cfg.shape_micro_batch)])
            batch_shape = batch_shape_metrics(pi, again, batch.response_mask)
    if batch.full_vocab is not None:
        trainer_logprobs = full_vocab_logprobs(trainer.model, batch, trainer.dtype)
        full_vocab = full_vocab_metrics(batch.full_vocab.rollout_logprobs, trainer_logprobs)
    return pi, batch, full_vocab, batch_shape


def run_mismatch(
    cfg: MismatchConfig, progress: bool = True, texts: list[Prompt] | None = None, locate_rows: bool = False
) -> list[PairResult]:
    """Measure every pair of `cfg.pairs`; `texts` replaces the prompts `cfg.prompts` names.
    `locate_rows`: also re-score each pair's worst row stage by stage (`PairResult.located`)."""
    model_dir = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(model_dir)
    texts = load_prompts(cfg.prompts, cfg.num_prompts, cfg.seed, cfg.model) if texts is None else texts
    max_new = cfg.sampling.max_new_tokens
    config = load_checked_config(model_dir)
    limit = prompt_limit(
        tokenizer, config.max_position_embeddings, max_new, "sampling.max_new_tokens", cfg.chat_template
    )
    prompts = [limit.check(f"prompts={cfg.prompts}: prompt {i + 1}", p) for i, p in enumerate(texts)]
    keys = "num_prompts x group_size, sampling.max_new_tokens, full_vocab_positions"
    rows = len(prompts) * cfg.group_size
    check_rollout_memory(config, rows, limit.longest, max_new, keys, cfg.device, cfg.full_vocab_positions)
    numerics = kernels.numerics(cfg.device, cfg.exact)
    model = load_model(model_dir, numerics)
    require_finite_weights(model, model_dir, "no mismatch can be measured (`parity doctor` shows where)")
    require_finite_logits(model, prompts[0], {"fp32": torch.float32}, model_dir)
    results: list[PairResult] = []
    for i, pair in enumerate(tqdm(cfg.pairs, desc="mismatch", unit="pair", disable=not draws_bars(progress)), 1):
        progress_line(progress, f"mismatch: pair {i}/{len(cfg.pairs)}, {pair}: sampling and scoring {rows} responses")
        train_p, roll_p = parse_pair(pair)
        start = time.perf_counter()
        trainer = Trainer(model, train_p, OptimConfig())
        engine = RolloutEngine(model.config, roll_p, tokenizer.eos_ids, tokenizer.pad_id, numerics)
        pi, batch, full_vocab, batch_shape = measure_pair(trainer, engine, prompts, cfg)
        mu, mask = batch.rollout_logprobs, batch.response_mask
        seconds = time.perf_counter() - start
        results.append(
            PairResult(
                trainer_precision=train_p,
                rollout_precision=roll_p,
                metrics=mismatch_metrics(pi, mu, mask),
                by_length=mismatch_by_length(pi, mu, mask),
                num_sequences=int(mask.shape[0]),
                num_tokens=int(mask.sum()),
                seconds=seconds,
                trainer_logprobs=pi.cpu(),  # for the plots, on the host
                rollout_logprobs=mu.cpu(),
                mask=mask.cpu(),
                located=locate_row(trainer.model, engine, batch, worst_row(pi, batch), trainer.dtype)
                if locate_rows
                else None,
                exact=cfg.exact,
                full_vocab=full_vocab,
                batch_shape=batch_shape,
            )
        )
    return results


def results_json(model: str, results: list[PairResult]) -> dict[str, Any]:
    return {
        "model": model,
        "runs": [
            {
                "rollout_precision": r.rollout_precision,
                "trainer_precision": r.trainer_precision,
                "num_sequences": r.num_sequences,
                "num_tokens": r.num_tokens,
                "exact": r.exact,
                "seconds": r.seconds,
                "metrics": r.metrics,
                "by_length": r.by_length,
                "full_vocab": r.full_vocab,
                "batch_shape": r.batch_shape,
                **({"located": [vars(d) for d in r.located]} if r.located is not None else {}),
            }
            for r in results
        ],
    }


def markdown_table(results: list[PairResult]) -> str:
    """One row per precision pair; each metric with its ratio to the FP16/FP16 run, where both are positive (a
    ratio of a signed estimate, k1's or a χ²'s below its mean, says nothing)."""
    ref = next((r for r in results if r.trainer_precision == r.rollout_precision == prec.Precision.FP16), None)
    head = "| trainer | rollout | tokens | " + " | ".join(TABLE_METRICS) + " |"
    lines = [head, "|" + "---|" * (3 + len(TABLE_METRICS))]
    for r in results:
        cells = []
        for k in TABLE_METRICS:
            v = r.metrics[k]
            ratio = ""
            if ref is not None and ref.metrics[k] > 0 and v >= 0:
                ratio = f" ({v / ref.metrics[k]:.3g}× fp16)"
            cells.append(f"{v:.3g}{ratio}")
        lines.append(f"| {r.trainer_precision} | {r.rollout_precision} | {r.num_tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def distribution_table(results: list[PairResult]) -> str:
    """The whole next-token distribution compared at recorded positions, and the trainer against itself
    in another batch shape: one row per pair (empty when both checks are off)."""
    if not any(r.full_vocab or r.batch_shape for r in results):
        return ""
    lines = [
        "| trainer | rollout | positions | TV | KL(μ‖π) | max \\|Δ log p\\| | top-1 agree | "
        "trainer vs itself: outside [0.9, 1.1] | outside [0.99, 1.01] | max \\|Δ\\| |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        f, b = r.full_vocab, r.batch_shape
        full = (
            f"{f['positions']} | {f['tv']:.3g} | {f['kl']:.3g} | {f['max_abs_log_ratio']:.3g} | {f['top1_agree']:.3f}"
            if f.get("positions")
            else "- | - | - | - | -"
        )
        shape = (
            f"{b['outside_10pct']:.2%} | {b['outside_1pct']:.2%} | {b['max_abs_log_ratio']:.3g}" if b else "- | - | -"
        )
        lines.append(f"| {r.trainer_precision} | {r.rollout_precision} | {full} | {shape} |")
    return "\n".join(lines) + "\n"


def _length_bins() -> list[tuple[int, int, str]]:
    """(first, last, by_length key) of each response-length bin of `mismatch_by_length`'s sequence log-ratio."""
    edges = zip(LENGTH_BIN_EDGES[:-1], LENGTH_BIN_EDGES[1:])
    return [(lo + 1, hi, f"seq_abs_log_ratio/len_{lo + 1}-{hi}") for lo, hi in edges]


def length_table(results: list[PairResult]) -> str:
    """Mean |sequence log-ratio| per response-length bin for each pair (with its number of sequences), and
    BF16/BF16 against FP16/FP16 in each bin where both ran (empty with fewer than two length bins)."""
    present = [b for b in _length_bins() if any(b[2] in r.by_length for r in results)]
    if len(present) < 2:
        return ""
    by_pair = {(r.trainer_precision, r.rollout_precision): r for r in results}
    bf16, fp16 = by_pair.get(("bf16", "bf16")), by_pair.get(("fp16", "fp16"))
    ratio = bf16 is not None and fp16 is not None
    lengths = [r.mask.sum(-1) for r in results]
    head = "| response length | " + " | ".join(r.label for r in results) + (" | bf16 / fp16 |" if ratio else " |")
    lines = [head, "|" + "---|" * (1 + len(results) + ratio)]
    for first, last, key in present:
        cells = []
        for r, n in zip(results, lengths):
            count = int(((n >= first) & (n <= last)).sum())
            cells.append(f"{r.by_length[key]:.3g} ({count})" if key in r.by_length else "-")
        if ratio:
            both = key in bf16.by_length and key in fp16.by_length and fp16.by_length[key] > 0
            cells.append(f"{bf16.by_length[key] / fp16.by_length[key]:.1f}×" if both else "-")
        lines.append(f"| {first}-{last} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# What `parity mismatch` writes into `out` (`outdir.py`).


def write_outputs(cfg: MismatchConfig, results: list[PairResult]) -> Path:
    out = claim_output_dir(Path(cfg.out), "mismatch", "out")
    write_output_json(out / "mismatch.json", results_json(cfg.model, results))
    num_prompts = results[0].num_sequences // cfg.group_size if results else 0
    distributions, lengths = distribution_table(results), length_table(results)
    md = (
        f"# Training-inference mismatch: {cfg.model}\n\n"
        f"{num_prompts} prompts × {cfg.group_size} samples, temperature {cfg.sampling.temperature}, "
        f"top_k {cfg.sampling.top_k}, top_p {cfg.sampling.top_p}, max_new_tokens {cfg.sampling.max_new_tokens}, "
        f"seed {cfg.seed}. Δ = π (trainer) − μ (rollout) over response tokens; "
        "metric definitions in docs/metrics.md.\n\n"
        + markdown_table(results)
        + (
            f"\nWhole next-token distributions at {cfg.full_vocab_positions} sampled positions, rollout engine (μ) "
            "against trainer (π)"
            + (
                f"; and the trainer's log-probs of the same tokens scored in micro-batches of {cfg.shape_micro_batch} "
                "rows against one batch"
                if cfg.shape_micro_batch
                else ""
            )
            + ":\n\n"
            + distributions
            if distributions
            else ""
        )
        + (
            "\nMean |sequence log-ratio| |Σ_t (π − μ)| by response length (number of sequences in brackets):\n\n"
            + lengths
            if lengths
            else ""
        )
        + "\n![token-level μ vs π](mismatch_scatter.png)\n\n"
        + "![sequence log-ratio vs length](seq_log_ratio_vs_length.png)\n"
        + "".join(f"\n{located_text(r)}" for r in results if r.located is not None)
    )
    write_output(out / "mismatch.md", md)
    plot_mismatch_scatter(results, out / "mismatch_scatter.png")
    plot_seq_log_ratio_vs_length(results, out / "seq_log_ratio_vs_length.png")
    return out


def located_text(r: PairResult) -> str:
    """Where the pair's two engines first differ, and the stage-by-stage table (markdown-friendly)."""
    first = first_divergence(r.located)
    verdict = (
        f"first differ at **{first.stage}** (position {first.first_position}, max |Δ| {first.max_abs:.3g})"
        if first is not None
        else "give the same bits at every stage"
    )
    return (
        f"## Where the engines part: {r.label}\n\nOn the row with the largest |π − μ|, the two engines "
        f"{verdict}.\n\n```\n{format_table(r.located)}\n```\n"
    )


MAX_SCATTER_POINTS = 20000


def plot_mismatch_scatter(results: Sequence[PairResult], path: Path) -> None:
    """Per precision pair: μ vs π probability of each sampled token (top), and the
    log-ratio π − μ against μ's probability (bottom, where small gaps are visible)."""
    from parity.commands.report import plt, save_figure  # matplotlib only when plotting

    n = len(results)
    fig, axes = plt.subplots(2, n, figsize=(3.8 * n, 7.5), squeeze=False, layout="constrained")
    for col, r in enumerate(results):
        m = r.mask
        mu = r.rollout_logprobs[m].exp()[:MAX_SCATTER_POINTS].numpy()
        pi = r.trainer_logprobs[m].exp()[:MAX_SCATTER_POINTS].numpy()
        delta = (r.trainer_logprobs[m] - r.rollout_logprobs[m])[:MAX_SCATTER_POINTS].numpy()
        top, bottom = axes[0][col], axes[1][col]
        top.scatter(mu, pi, s=3, alpha=0.35)
        top.plot([0, 1], [0, 1], color="black", lw=0.7)
        top.set(
            xlim=(0, 1),
            ylim=(0, 1),
            xlabel="rollout probability μ",
            ylabel="trainer probability π" if col == 0 else None,
            title=r.label,
        )
        bottom.scatter(mu, delta, s=3, alpha=0.35, color="tab:red")
        bottom.axhline(0, color="black", lw=0.7)
        bottom.set_yscale("symlog", linthresh=1e-6)
        bottom.set(xlim=(0, 1), xlabel="rollout probability μ", ylabel="log π − log μ" if col == 0 else None)
        bottom.text(
            0.5,
            0.5,
            f"k3 = {r.metrics['k3']:.2e}\nmean |Δ| = {r.metrics['token_abs_log_ratio_mean']:.2e}",
            transform=bottom.transAxes,
            ha="center",
            va="center",
            fontsize=9,
            bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"),
        )
    fig.suptitle("Token-level training–inference mismatch")
    save_figure(fig, path)


def plot_seq_log_ratio_vs_length(results: Sequence[PairResult], path: Path) -> None:
    """|Σ_t (π − μ)| per sequence against response length, one colour per pair, with each length bin's mean."""
    from parity.commands.report import plt, save_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        lengths = r.mask.sum(-1).numpy()
        seq = (r.trainer_logprobs - r.rollout_logprobs).masked_fill(~r.mask, 0).sum(-1).abs().numpy()
        dots = ax.scatter(lengths, seq, s=8, alpha=0.5, label=f"{r.label} (mean {seq.mean():.2e})")
        bins = [(first, last, r.by_length[key]) for first, last, key in _length_bins() if key in r.by_length]
        if len(bins) > 1:  # the bin means, drawn at each bin's geometric middle
            middles = [(first * last) ** 0.5 for first, last, _ in bins]
            ax.plot(middles, [v for *_, v in bins], color=dots.get_facecolor()[0][:3], marker="o", lw=1.5)
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_xscale("log")
    ax.set(
        xlabel="response length (tokens)",
        ylabel="|sequence log-ratio| = |Σ_t log π − log μ|",
        title="Sequence-level mismatch against response length",
    )
    ax.legend(fontsize=8)
    save_figure(fig, path)
