"""Training-run reports and the plots they share. Each plot function takes measured results and writes one PNG."""

from __future__ import annotations

import io
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from parity.config import ConfigError  # noqa: E402
from parity.files import JSONError, LineTooLong, bounded_lines, parse_json  # noqa: E402
from parity.folders import Folder  # noqa: E402
from parity.outdir import claim_output_dir, held_output_dir, write_output, write_output_json  # noqa: E402
from parity.rl.completions import markdown_table, read_completions, sample_rows  # noqa: E402
from parity.rl.data import DataError  # noqa: E402
from parity.rl.metrics_log import MAX_LINE_BYTES  # noqa: E402
from parity.rundir import refuse_run_links  # noqa: E402

if TYPE_CHECKING:
    import torch


def save_figure(fig, path: Path) -> None:
    """The figure as the file `path` of an output folder (`outdir.write_output`: atomically, never through a
    link, its bytes recorded in the folder's mark)."""
    image = io.BytesIO()
    fig.savefig(image, format=path.suffix.removeprefix("."), dpi=110, bbox_inches="tight")
    plt.close(fig)
    write_output(path, image.getvalue())


# ----------------------------------------------------------------------------- training runs

TARGET_ACCURACY = 0.95
SMOOTHING = 5  # steps in the moving average that "training accuracy" means
# A run collapsed when, after a best of at least this accuracy, its training accuracy fell below this fraction
# of that best (a mean reward, which may be negative, is never called a collapse).
COLLAPSE_FRACTION = 0.5


# The metrics every step of `parity train` logs, which reports read (and a reward: accuracy or mean).
REPORTED = (
    "time/step",
    "mismatch/k3",
    "mismatch/seq_abs_log_ratio",
    "mismatch/token_abs_log_ratio_max",
    "precision/skipped_steps",
)


def _number(value) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def load_history(run_dir: Path) -> list[dict]:
    """The steps in RUN_DIR/metrics.jsonl. A last line cut short (a run writing it, or killed mid-write) is left out
    with a warning on stderr; any other unreadable line, or no complete step, is a DataError. A run folder
    holding a link (but W&B's own) is refused (`rundir.refuse_run_links`): report reads only what the run wrote."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    refuse_run_links(run_dir, "run")
    try:
        with Folder.open(run_dir, key="run") as run, run.open_read(path.name) as f:
            history = _history(path, f)
    except (FileNotFoundError, NotADirectoryError):
        started = (run_dir / "config.yaml").is_file()
        hint = "the run has logged no step yet" if started else "is this a `parity train` run directory?"
        raise DataError(f"{run_dir}: no metrics.jsonl; {hint}") from None
    if not history:
        raise DataError(f"{path}: no complete step yet")
    return history


def _reward_key(first: dict) -> str:
    """The reward a report reads: the accuracy where the first step logged one, else the mean reward."""
    return "reward/accuracy" if _number(first.get("reward/accuracy")) is not None else "reward/mean"


def _history(path: Path, f) -> list[dict]:
    history: list[dict] = []
    try:
        for lineno, line in enumerate(bounded_lines(f, MAX_LINE_BYTES), 1):
            if not line.strip():
                continue
            try:
                row = parse_json(line.decode("utf-8"))
            except (JSONError, UnicodeDecodeError):
                if not line.endswith(b"\n"):  # the last line, and its write never finished
                    if history:
                        steps = f"{history[0]['step']}-{history[-1]['step']}"
                        cut = "incomplete last line (the run is writing it, or was killed mid-write)"
                        warning = f"{cut}; reporting steps {steps}"
                        print(f"{path}:{lineno}: {warning}", file=sys.stderr)
                    continue
                raise DataError(
                    f"{path}:{lineno}: corrupt line (not valid JSON); only a killed run's last line may be cut short"
                ) from None
            missing = [k for k in ("step", *REPORTED) if not isinstance(row, dict) or _number(row.get(k)) is None]
            if not missing and _number(row.get(key := _reward_key(history[0] if history else row))) is None:
                missing = [key]
            if missing:
                raise DataError(f"{path}:{lineno}: expected a JSON object of metrics with a number for {missing[0]!r}")
            history.append(row)
    except LineTooLong as e:
        raise DataError(f"{path}:{e.lineno}: {e.length:,} bytes, more than a step's metrics hold") from None
    return history


def moving_average(values: list[float], n: int = SMOOTHING) -> list[float]:
    return [sum(values[max(0, i - n + 1) : i + 1]) / len(values[max(0, i - n + 1) : i + 1]) for i in range(len(values))]


def summarize(history: list[dict]) -> dict:
    """Headline figures of one run. Accuracy is the moving average over SMOOTHING steps."""
    key = _reward_key(history[0])
    acc = moving_average([m[key] for m in history])
    elapsed = [sum(m["time/step"] for m in history[: i + 1]) for i in range(len(history))]
    # 95% of an accuracy: a mean reward has no such scale (a reward of 0 to 5 passes 0.95 at once)
    hit = next((i for i, a in enumerate(acc) if a >= TARGET_ACCURACY), None) if key == "reward/accuracy" else None
    peak = acc.index(max(acc))
    fell = None
    if key == "reward/accuracy" and acc[peak] >= COLLAPSE_FRACTION:
        fell = next((i for i in range(peak, len(acc)) if acc[i] < COLLAPSE_FRACTION * acc[peak]), None)
    last = history[-SMOOTHING:]
    return {
        "steps": len(history),
        "metric": key,
        "initial_accuracy": acc[0],
        "final_accuracy": acc[-1],
        "best_accuracy": max(acc),
        "steps_to_95": None if hit is None else history[hit]["step"],
        "seconds_to_95": None if hit is None else round(elapsed[hit], 1),
        "collapse_step": None if fell is None else history[fell]["step"],
        "wall_seconds": round(elapsed[-1], 1),
        "final_mismatch_k3": sum(m["mismatch/k3"] for m in last) / len(last),
        "final_seq_abs_log_ratio": sum(m["mismatch/seq_abs_log_ratio"] for m in last) / len(last),
        "max_token_abs_log_ratio": max(m["mismatch/token_abs_log_ratio_max"] for m in history),
        "skipped_fp16_steps": history[-1]["precision/skipped_steps"],
        # Runs logged before the effective sample size was a metric have none.
        **(
            {"final_is_ess": sum(m["mismatch/is_ess"] for m in last) / len(last)}
            if "mismatch/is_ess" in last[0]
            else {}
        ),
        **held_out_summary(history),
    }


def held_out_summary(history: list[dict]) -> dict:
    """The first and last held-out evaluation's score, when the run evaluated (`eval.*`)."""
    evaluated = [m for m in history if "eval/reward_mean" in m]
    if not evaluated:
        return {}
    key = "eval/accuracy" if "eval/accuracy" in evaluated[0] else "eval/reward_mean"
    return {"eval_first": evaluated[0][key], "eval_last": evaluated[-1][key], "eval_last_step": evaluated[-1]["step"]}


def accuracy_text(x: float) -> str:
    """`x` to two decimals, but a value short of TARGET_ACCURACY that two would round up to it to three, rounded
    down: 0.9469 reads 0.946, not the 0.95 it did not reach (beside "steps to 95%: —"), and start, final and best are
    rounded alike (a best rounded down read below the final it equalled)."""
    shown = f"{x:.2f}"
    return f"{math.floor(x * 1000) / 1000:.3f}" if x < TARGET_ACCURACY <= float(shown) else shown


def summary_table(summaries: dict[str, dict]) -> str:
    """One row per run; a held-out column when any run evaluated (`eval.*`)."""
    held_out = any("eval_last" in s for s in summaries.values())
    scored = all(s["metric"] == "reward/accuracy" for s in summaries.values())
    columns = [
        "run",
        "accuracy start → final (best)" if scored else "accuracy or mean reward: start → final (best)",
        *(["held-out first → last eval"] if held_out else []),
        "steps to 95%",
        "seconds to 95%",
        "mismatch k3",
        "seq \\|log-ratio\\|",
        "IS ESS",
        "max token \\|Δ\\|, whole run",
        "skipped FP16 steps",
    ]
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for name, s in summaries.items():
        to95 = "—" if s["steps_to_95"] is None else str(s["steps_to_95"])
        sec = "—" if s["seconds_to_95"] is None else f"{s['seconds_to_95']:.0f}"
        kind = "" if scored else " accuracy" if s["metric"] == "reward/accuracy" else " mean reward"
        start, final, best = (accuracy_text(s[k]) for k in ("initial_accuracy", "final_accuracy", "best_accuracy"))
        cells = [name, f"{start} → {final} ({best}){kind}"]
        if held_out:
            cells.append(f"{s['eval_first']:.2f} → {s['eval_last']:.2f}" if "eval_last" in s else "—")
        cells += [
            to95,
            sec,
            f"{s['final_mismatch_k3']:.2e}",
            f"{s['final_seq_abs_log_ratio']:.2e}",
            f"{s['final_is_ess']:.2f}" if "final_is_ess" in s else "—",
            f"{s['max_token_abs_log_ratio']:.2e}",
            str(s["skipped_fp16_steps"]),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


@dataclass(frozen=True)
class Panel:
    key: str  # metric name in metrics.jsonl
    title: str
    log: bool = False
    hline: float | None = None
    smooth: bool = True  # a moving average over SMOOTHING steps; off for metrics logged now and then (eval/*)
    ylim: tuple[float, float] | None = None
    runs: frozenset[str] | None = None  # the runs it draws (None: every run that logs `key`)


def plot_curves(histories: dict[str, list[dict]], panels: list[Panel], path: Path) -> None:
    """One panel per metric, one line per run ({SMOOTHING}-step moving average, or the points themselves), in
    one colour in every panel: runs whose label names fp16 solid, others dashed; the legend beneath the panels,
    not over them. A log-scale panel names the runs it cannot draw, whose values are all 0 (exact mode's)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.6), squeeze=False, layout="constrained")
    for ax, panel in zip(axes[0], panels):
        unseen = []
        for i, (name, h) in enumerate(histories.items()):
            rows = [m for m in h if panel.key in m]
            if not rows or (panel.runs is not None and name not in panel.runs):
                continue
            values = [m[panel.key] for m in rows]
            if panel.log and not any(v > 0 for v in values):
                unseen.append(name)
                continue
            values = moving_average(values) if panel.smooth else values
            ls = "-" if "fp16" in name else "--"
            marker = None if panel.smooth and len(rows) > 1 else "o"  # a single point is no line
            ax.plot([m["step"] for m in rows], values, label=name, ls=ls, marker=marker, color=f"C{i % 10}")  # one each
        if panel.hline is not None:
            ax.axhline(panel.hline, color="grey", lw=0.7, ls=":")
        average = f" ({SMOOTHING}-step moving average)" if panel.smooth else ""
        ax.set(xlabel="step", ylabel=panel.key + average, title=panel.title, yscale="log" if panel.log else "linear")
        ax.xaxis.get_major_locator().set_params(integer=True)
        if unseen:
            ax.text(0.01, 0.01, "0 throughout, not drawn: " + ", ".join(unseen), transform=ax.transAxes, fontsize=7)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
    handles = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=min(4, len(handles)), fontsize=8)
    save_figure(fig, path)


def plot_accuracy(histories: dict[str, list[dict]], path: Path) -> None:
    """Training accuracy; beside it the held-out accuracy of the runs that evaluated (`eval.*`). Runs scored by
    their mean reward (no accuracy) get a panel of their own: on an accuracy's axis they would not be drawn."""
    scored = frozenset(name for name, h in histories.items() if "reward/accuracy" in h[0])
    rewarded = frozenset(histories) - scored
    panels = []
    if scored:
        scale = (0.0, 1.02)
        panels.append(Panel("reward/accuracy", "Training accuracy", hline=TARGET_ACCURACY, ylim=scale))
        if any("eval/accuracy" in m for h in histories.values() for m in h):
            panels.append(
                Panel("eval/accuracy", "Held-out accuracy (served by the rollout engine)", smooth=False, ylim=scale)
            )
    if rewarded:
        panels.append(Panel("reward/mean", "Training mean reward", runs=rewarded))
        if any("eval/reward_mean" in m for name in rewarded for m in histories[name]):
            title = "Held-out mean reward (served by the rollout engine)"
            panels.append(Panel("eval/reward_mean", title, smooth=False, runs=rewarded))
    plot_curves(histories, panels, path)


def plot_mismatch_curves(histories: dict[str, list[dict]], path: Path) -> None:
    plot_curves(
        histories,
        [
            Panel("mismatch/k3", "Token-level mismatch KL(μ‖π) (k3)", log=True),
            Panel("mismatch/seq_abs_log_ratio", "Sequence-level |Σ log π − log μ|", log=True),
            Panel("mismatch/is_ess", "Sequence IS weights: effective sample size", hline=1.0, ylim=(0, 1.05)),
        ],
        path,
    )


def plot_beta_distribution(beta: torch.Tensor, probs: torch.Tensor, path: Path) -> None:
    """Histogram of token-level β, and |β| against the token's probability."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.3), layout="constrained")
    b = beta.double().numpy()
    axes[0].hist(b, bins=200, color="tab:purple")
    axes[0].set(
        yscale="log",
        xlabel="β = log π_FP32 − log π_BF16 (same weights)",
        ylabel="tokens",
        title="Distribution of the precision gap β",
    )
    axes[1].scatter(probs.numpy(), abs(b), s=3, alpha=0.4, color="tab:purple")
    axes[1].set(
        xscale="log", yscale="symlog", xlabel="token probability μ", ylabel="|β|", title="|β| against token probability"
    )
    save_figure(fig, path)


def plot_bars(
    groups: dict[str, list[float]], categories: list[str], xlabel: str, ylabel: str, title: str, path: Path
) -> None:
    """Grouped bars on a log scale: one value per category for each named group."""
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(categories)), 4.3), layout="constrained")
    width = 0.8 / max(len(groups), 1)
    for i, (name, values) in enumerate(groups.items()):
        ax.bar([c + i * width for c in range(len(categories))], values, width, label=name)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(categories))], categories)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, yscale="log")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_histogram(counts: list[int], lo: float, hi: float, path: Path) -> None:
    k = len(counts) - 1
    fig, ax = plt.subplots(figsize=(7, 3.8), layout="constrained")
    colors = ["tab:green" if lo <= i / k <= hi else "tab:grey" for i in range(k + 1)]
    ax.bar(range(k + 1), counts, color=colors)
    ax.set(
        xlabel=f"times solved out of {k} samples",
        ylabel="problems",
        title=f"Base-model accuracy per problem (green: kept, accuracy in [{lo}, {hi}])",
    )
    save_figure(fig, path)


REPORTED_COMPLETIONS = 6  # rows of each run's newest completions in report.md


def completions_section(completions: dict[str, list[dict]]) -> str:
    """Each run's newest step's completions (`read_completions`), by its label, a few rows with their rewards."""
    parts = []
    for label, rows in completions.items():
        if rows:
            shown = markdown_table(sample_rows(rows, REPORTED_COMPLETIONS))
            parts.append(f"\n## {label}: completions of step {rows[0]['step']}\n\n{shown}")
    return "".join(parts)


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's name in the report: its folder's, with as many parents as tell runs of one name apart
    (`a/run`, `b/run`); the same run given twice is a ConfigError."""
    paths = [Path(d).resolve() for d in run_dirs]
    twice = next((d for d, p in zip(run_dirs, paths) if paths.count(p) > 1), None)
    if twice is not None:
        raise ConfigError(f"{twice}: the same run given twice")
    for depth in range(1, max(len(p.parts) for p in paths) + 1):
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def report_runs(run_dirs: list[Path], out: Path) -> dict[str, dict]:
    """`parity report`: summary table and plots for `parity train` runs, side by side."""
    labels = run_labels(run_dirs)
    with held_output_dir(out, "report"):  # before the runs are read: a second report there is refused at once
        histories = {label: load_history(Path(d)) for label, d in zip(labels, run_dirs)}  # all read before writing
        completions = {label: read_completions(Path(d), MAX_LINE_BYTES) for label, d in zip(labels, run_dirs)}
        summaries = {name: summarize(h) for name, h in histories.items()}
        claim_output_dir(out, "report")
        plot_accuracy(histories, out / "accuracy.png")
        plot_mismatch_curves(histories, out / "mismatch.png")
        write_output_json(out / "summary.json", summaries)
        md = (
            "# Runs\n\n"
            + summary_table(summaries)
            + f"\nAccuracy (or the mean reward, for runs of other rewards) is the {SMOOTHING}-step moving average "
            "over the training batches; mismatch figures are means of the last 5 steps.\n\n"
            "![training accuracy](accuracy.png)\n\n![mismatch](mismatch.png)\n" + completions_section(completions)
        )
        write_output(out / "report.md", md)
    return summaries
