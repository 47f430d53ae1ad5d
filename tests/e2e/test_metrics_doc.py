"""docs/metrics.md against what runs write: every key of a run's metrics.jsonl is named in the page's table,
and every name there is one that some run writes (the ones that need Ray, a MoE model or a drifting episode
are listed, with where they are tested)."""

from __future__ import annotations

import re
from pathlib import Path

import parity
from conftest import TINY, metrics
from parity import config
from parity.rl.loop import Run
from parity.rl.train_config import TrainConfig

DOC = Path(__file__).parents[2] / "docs" / "metrics.md"
SMALL = [*TINY, "steps=1", "checkpoint_every=-1", "eval.every=-1"]
# Runs that between them write every key one process writes.
RUNS = {
    "fp16": ["eval.every=0", "eval.precisions=[bf16]", "eval.num_prompts=4", "eval.samples=2"],
    "grpo": ["algorithm.name=grpo", "algorithm.num_minibatches=2", "algorithm.kl_coef=0.01", "trainer.warmup_steps=1"],
    "mis": ["precision=bf16", "algorithm.name=grpo_token_mis", "algorithm.token_veto=1e-4"],
    "sapo": ["algorithm.name=sapo"],
    "opsm": ["algorithm.name=grpo_opsm"],
    "shadow": ["algorithm.ratio_source=shadow"],
    "agent": ["model=builtin-agent", "task.name=lookup", "rollout.max_new_tokens=96"],
}
# Named in the page, written only where these tests run them.
ELSEWHERE = {
    "time/learner_idle": "distributed (tests/e2e/test_distributed.py)",
    "time/worker_idle": "distributed",
    "time/worker_rollout": "distributed",
    "async/staleness_mean": "distributed",
    "async/staleness_max": "distributed",
    "async/queue_depth": "distributed",
    "async/dropped": "distributed",
    "async/continued_frac": "partial rollouts (tests/e2e/test_partial_rollouts.py)",
    "async/unfinished": "partial rollouts",
    "async/dropped_tokens": "partial rollouts",
    "sync/verified": "distributed",
    "sync/seconds": "distributed",
    "sync/bytes": "distributed",
    "faults/worker_restarts": "distributed",
    "moe/routing_mismatch": "a MoE model (tests/e2e/test_moe.py)",
    "moe/routing_mismatch_layer{i}": "a MoE model",
    "retokenization/logprob_mean": "a step where an episode drifted (tests/e2e/test_agents.py)",
    "retokenization/sampled_logprob_mean": "a step where an episode drifted",
}
LOGGED = "my_metric"  # the reward function's log_metric name, documented as `<name>`


def documented() -> set[str]:
    """The names in the first column of the page's table ("`prob_abs_diff_mean` / `_max`": both)."""
    names = set()
    for line in DOC.read_text().split("## The table", 1)[1].splitlines():
        first = line.split(" | ")[0]
        if not line.startswith("| `") or "**" in first:
            continue
        previous = ""
        for name in re.findall(r"`([^`]+)`", first):
            if "(" in name:
                continue
            if name.startswith("_"):
                name = previous.rsplit("_", 1)[0] + name
            names.add(name)
            previous = name
    return names


def as_documented(key: str) -> str:
    """A written key in the page's form: placeholders for precisions, bins, names, turns and layers."""
    key = re.sub(r"^mismatch/(?!k3_turn)", "", key)
    key = re.sub(r"^(beta|kappa)/.*", r"\1/…", key)
    key = re.sub(r"^gap/(abs_mean/|adv_corr)", r"PART/\1", key)
    key = re.sub(r"/len_\d+-\d+$", "/len_LO-HI", key)
    key = re.sub(r"/p_[\d.]+-[\d.]+$", "/p_LO-HI", key)
    key = re.sub(r"^eval/(fp32|bf16|fp16|trainer)/", "eval/<p>/", key)
    key = re.sub(r"^deploy/(gap_se|gap|changed|kl)_(fp32|bf16|fp16|trainer)$", r"deploy/\1_<p>", key)
    key = re.sub(r"^(eval/<p>/|eval/|)reward/(?!mean$|std$)[^/]+/(mean|std)$", r"\1reward/<name>/\2", key)
    key = re.sub(r"^episode/end_\w+_frac$", "episode/end_<how>_frac", key)
    key = re.sub(r"_turn\d+$", "_turn<i>", key)
    return "<name>" if key == LOGGED else key


def test_every_key_a_run_writes_is_documented_and_every_documented_key_is_written(tmp_path):
    written = set()
    for name, overrides in RUNS.items():
        cfg = config.load(TrainConfig, None, [f"run_dir={tmp_path / name}", *SMALL, *overrides])
        Run.create(cfg, progress=False).train()
        written |= {k for row in metrics(tmp_path / name) for k in row}

    def correct(completions, answer, log_metric, **columns):
        log_metric(LOGGED, 1.0)
        return [float(c.rsplit(">", 1)[-1] == str(a)) for c, a in zip(completions, answer)]

    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(100, 130) for b in range(10, 13)]
    keys = dict(steps=1, prompts_per_step=4, rollout__group_size=4, rollout__max_new_tokens=32, tensorboard=False)
    keys.update(checkpoint_every=-1, eval__samples=2, eval__precisions=["fp32"], progress=False)
    parity.train("builtin", rows[:60], [correct], eval_dataset=rows[60:], run_dir=tmp_path / "api", **keys)
    written |= {k for row in metrics(tmp_path / "api") for k in row}
    written.discard("step")

    doc = documented()
    undocumented = sorted(k for k in written if as_documented(k) not in doc)
    assert not undocumented, f"written but not in docs/metrics.md: {undocumented}"
    seen = {as_documented(k) for k in written}
    unwritten = sorted(doc - seen - set(ELSEWHERE))
    assert not unwritten, f"in docs/metrics.md but written by none of these runs: {unwritten}"
