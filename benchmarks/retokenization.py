"""What a re-tokenizing pipeline would train on, measured on a real model in a real `parity.train` run.

Each episode has two user turns: the first is a question of Parity's shipped chat prompts
(`commands/prompts.CHAT_QUESTIONS`), and after the model's first answer the environment writes one more
user message (`--followup`, "Are you sure? Answer again in one sentence." by default); the episode ends
after the second answer. Every episode therefore renders a conversation holding sampled assistant turns
again, which is what `retokenization/*` counts (`rl/episodes.Episodes.count_drift`).

For the same rollouts the script also counts the single-turn figure: each sampled assistant turn decoded
to text alone (its end-of-turn token dropped) and encoded again with no chat template around it, the two
id lists aligned as the in-run metric aligns them (`engines/turns.drifted_tokens`). That is the figure of
a decode -> re-encode of one completion; the in-run one is of whole conversations, so it also holds what
the template adds (the text around a turn can merge with its first or last characters) and counts an
episode once if either of its turns drifted.

    python benchmarks/retokenization.py MODEL_DIR [--temperature 1.0] [--prompts 24] [--group 10]
        [--prompts-per-step 8] [--turn-tokens 128] [--max-new-tokens 320] [--precision fp32]
        [--json out.json]

The figures, with the machine, are in docs/agents.md ("The metrics").
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from difflib import SequenceMatcher
from pathlib import Path

import torch

import parity
from parity.commands.prompts import CHAT_QUESTIONS
from parity.engines.turns import drifted_tokens, retokenized_ids
from parity.rl.episodes import ENDS, Episodes

FOLLOWUP = "Are you sure? Answer again in one sentence."


class TwoUserTurns:
    """The question, then after the first answer one more user message; done after the second answer."""

    followup = FOLLOWUP

    def __init__(self):
        self.answers = 0

    def reset(self, row):
        return row["prompt"]

    def step(self, assistant):
        self.answers += 1
        if self.answers == 1:
            return parity.Step([{"role": "user", "content": self.followup}])
        return parity.Step(done=True)


class Counts:
    """Per step: the in-run counts (as `count_drift` gives them) and the single-turn ones, from the same batch."""

    def __init__(self, examples: int = 4):
        self.steps: list[dict[str, int]] = []
        self.examples: list[dict[str, object]] = []  # a few drifts, as token strings: sampled -> encoded again
        self.max_examples = examples  # of each kind

    def example(self, tokenizer, kind: str, sampled: list[int], again: list[int], at: int) -> None:
        """The tokens around sampled position `at`, and what the re-encoding has in their place."""
        if sum(e["kind"] == kind for e in self.examples) >= self.max_examples:
            return
        matcher = SequenceMatcher(None, sampled, again, autojunk=False)
        for tag, a0, a1, b0, b1 in matcher.get_opcodes():
            if tag != "equal" and a0 <= at < max(a1, a0 + 1):
                show = lambda ids: [tokenizer.token_text(i) for i in ids]  # noqa: E731
                lo = max(a0 - 2, 0)
                self.examples.append(
                    {
                        "kind": kind,
                        "sampled": show(sampled[lo : a1 + 2]),
                        "encoded_again": show(again[b0 - (a0 - lo) : b1 + 2]),
                    }
                )
                return

    def count(self, episodes: Episodes, batch, drift: tuple[int, int, int]) -> None:
        tokenizer, tools = episodes.setup.tokenizer, episodes.setup.tools
        special = tokenizer.special_ids | set(tokenizer.eos_ids)
        lengths = batch.response_lengths.tolist()
        sampled, turn_of = batch.sampled_mask, batch.turn_index()
        c = dict.fromkeys(
            [
                "episodes",
                "sampled_tokens",
                "conv_episodes",
                "conv_tokens",
                "turns",
                "turns_drifted",
                "turn_tokens_drifted",
                "first_turns",
                "first_turns_drifted",
                "first_turn_tokens",
                "first_turn_tokens_drifted",
                "ended_turns",
                "ended_turns_drifted",
                "both",
                "conversation_only",
                "turns_only",
            ],
            0,
        )
        for row, episode in enumerate(episodes.episodes):
            n, prompt = lengths[row], batch.prompt_ids[row]
            response = batch.response_ids[row, :n].tolist()
            trained = sampled[row, :n].tolist()
            turns = turn_of[row, :n].tolist()
            # The conversation, as count_drift counts it.
            again = retokenized_ids(tokenizer, episode.messages, tools)
            conv = drifted_tokens(prompt + response, [False] * len(prompt) + trained, again)
            c["conv_episodes"] += bool(conv)
            c["conv_tokens"] += len(conv)
            conv_ids = prompt + response
            # Each sampled turn alone: decoded, encoded again, aligned.
            any_turn = False
            for t in range(max(turns) + 1):
                ids = [response[i] for i in range(n) if turns[i] == t]
                text_ids = [i for i in ids if i not in special]
                ended = len(text_ids) < len(ids)  # the turn ends with its end-of-turn token
                encoded = tokenizer.encode_template(tokenizer.decode(text_ids))
                drifted = len(drifted_tokens(text_ids, [True] * len(text_ids), encoded))
                if drifted:
                    at = drifted_tokens(text_ids, [True] * len(text_ids), encoded)[0]
                    self.example(tokenizer, "turn", text_ids, encoded, at)
                any_turn |= drifted > 0
                c["turns"] += 1
                c["turns_drifted"] += drifted > 0
                c["turn_tokens_drifted"] += drifted
                c["ended_turns"] += ended
                c["ended_turns_drifted"] += ended and drifted > 0
                if t == 0:
                    c["first_turns"] += 1
                    c["first_turns_drifted"] += drifted > 0
                    c["first_turn_tokens"] += len(ids)
                    c["first_turn_tokens_drifted"] += drifted
            c["both"] += bool(conv) and any_turn
            c["conversation_only"] += bool(conv) and not any_turn
            if conv and not any_turn:
                self.example(tokenizer, "conversation only", conv_ids, again, conv[0])
            c["turns_only"] += any_turn and not conv
            c["episodes"] += 1
        c["sampled_tokens"] = int(sampled.sum())
        if (c["conv_episodes"], c["conv_tokens"], c["sampled_tokens"]) != tuple(drift):
            raise AssertionError(f"the recount {c} differs from count_drift's {drift}")
        self.steps.append(c)


def figures(c: dict[str, int]) -> dict[str, float]:
    """The shares of a step's (or the run's) counts."""
    return {
        "in_run_episodes_frac": c["conv_episodes"] / c["episodes"],
        "in_run_tokens_frac": c["conv_tokens"] / max(c["sampled_tokens"], 1),
        "single_turn_turns_frac": c["turns_drifted"] / max(c["turns"], 1),
        "single_turn_tokens_frac": c["turn_tokens_drifted"] / max(c["sampled_tokens"], 1),
        "single_turn_first_turns_frac": c["first_turns_drifted"] / max(c["first_turns"], 1),
        "single_turn_first_turn_tokens_frac": c["first_turn_tokens_drifted"] / max(c["first_turn_tokens"], 1),
        "single_turn_ended_turns_frac": c["ended_turns_drifted"] / max(c["ended_turns"], 1),
        "episodes_with_any_turn_drifted_frac": (c["both"] + c["turns_only"]) / c["episodes"],
    }


def machine() -> dict[str, object]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line), "")
    except (OSError, subprocess.SubprocessError):
        model = ""
    return {
        "cpu": model or platform.processor(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model directory with a chat template (e.g. SmolLM2-135M-Instruct converted)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=24, help="questions, the first of CHAT_QUESTIONS")
    ap.add_argument("--group", type=int, default=10, help="episodes per question")
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--lr", type=float, default=1e-7)
    ap.add_argument("--followup", default=FOLLOWUP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default=None, help="where the run writes (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.prompts % args.prompts_per_step or args.prompts > len(CHAT_QUESTIONS):
        ap.error(f"--prompts must be a multiple of --prompts-per-step and at most {len(CHAT_QUESTIONS)}")
    TwoUserTurns.followup = args.followup
    steps = args.prompts // args.prompts_per_step
    rows = [{"prompt": q} for q in CHAT_QUESTIONS[: args.prompts]]

    counts = Counts()
    original = Episodes.count_drift

    def count_drift(self, batch):
        drift = original(self, batch)
        counts.count(self, batch, drift)
        return drift

    step_ends: list[float] = []

    class Clock(parity.Callback):
        def on_step_end(self, step, metrics):
            step_ends.append(time.perf_counter())

    Episodes.count_drift = count_drift
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = parity.train(
                args.model,
                rows,
                environment=TwoUserTurns,
                callbacks=[Clock()],
                progress=False,
                steps=steps,
                prompts_per_step=args.prompts_per_step,
                seed=args.seed,
                precision=args.precision,
                run_dir=args.run_dir or str(Path(tmp) / "run"),
                checkpoint_every=-1,
                config={
                    "rollout.temperature": args.temperature,
                    "rollout.group_size": args.group,
                    "rollout.max_new_tokens": args.max_new_tokens,
                    "episode.turn_tokens": args.turn_tokens,
                    "episode.max_turns": 2,
                    "trainer.lr": args.lr,
                    "eval.every": -1,
                },
            )
    finally:
        Episodes.count_drift = original
    seconds = time.perf_counter() - start

    keys = ["retokenization/episodes_frac", "retokenization/tokens_frac", "episode/turns_mean"]
    keys += [f"episode/end_{end}_frac" for end in ENDS]
    per_step = []
    times = [b - a for a, b in zip([start] + step_ends, step_ends)]
    for i, (metrics, c) in enumerate(zip(result.history, counts.steps)):
        per_step.append(
            {
                "step": i + 1,
                **{k: metrics.get(k) for k in keys},
                "response/length_mean": metrics.get("response/length_mean"),
                **figures(c),
                "counts": c,
                "seconds": times[i] if i < len(times) else None,
            }
        )
    total = {k: sum(c[k] for c in counts.steps) for k in counts.steps[0]}
    out = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "model": str(args.model),
        "temperature": args.temperature,
        "prompts": args.prompts,
        "group": args.group,
        "episodes": total["episodes"],
        "turn_tokens": args.turn_tokens,
        "max_new_tokens": args.max_new_tokens,
        "precision": args.precision,
        "followup": args.followup,
        "total": {**figures(total), "counts": total},
        "ends": {end: sum(s[f"episode/end_{end}_frac"] or 0.0 for s in per_step) / len(per_step) for end in ENDS},
        "per_step": per_step,
        "examples": counts.examples,
        "seconds": seconds,
        "machine": machine(),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
