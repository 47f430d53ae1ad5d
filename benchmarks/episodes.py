"""Episodes continued from the KV cache against the conversation prefilled again at every turn.

Parity's rollout engine continues an episode from its KV cache: after a turn it feeds only the ids that
come between (the tool's answer and the next turn's prompt), one decode step each, and samples the next
turn (`RolloutEngine.generate(between=...)`). A pipeline that calls its inference engine once per turn
prefills the whole conversation again each time. This script measures both at equal work: it runs the
episodes the engine's way, records each row's turns, then replays the same structure as one call per
turn whose prompts are the conversations so far and whose row limits are the recorded turn lengths (on an
engine without an end-of-turn id, so that every row samples exactly its recorded turn). The two are timed
in turn (A, B, A, B, ...) after a warm-up of each; the ratio is of medians.

    python benchmarks/episodes.py [--model llama-4.4M] [--prompt-tokens 200] [--turns 4] [--fed 40] [--json out.json]

`--model llama-4.4M` (the default) is the 4.4M-parameter Llama the benchmarks share (`engines.make_llama_4m`,
random weights); a random model's turns end where it samples one of `--end-ids` ids taken as end-of-turn
tokens (a turn of about vocabulary / end-ids tokens). A shipped model (`builtin`, `builtin-agent`) ends its
turns with its own end-of-turn token.

The figures, with the machine, are in docs/benchmarks.md ("Episodes: the KV cache against prefilling again").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from parity.engines import kernels
from parity.engines.kernels import cpu
from parity.engines.models.io import export_state, load_model, resolve_model_dir
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import make_llama_4m  # noqa: E402


class FixedTurns:
    """Feeds the same `fed` ids after each of the first `turns` - 1 turns, and records each row's turns."""

    def __init__(self, fed: list[int], turns: int, limit: int):
        self.fed, self.turns, self.limit = fed, turns, limit
        self.ends: dict[int, list[int]] = {}  # row -> the column after each of its turns

    def __call__(self, rows, tokens, rooms):
        out = {}
        for row, ids, room in zip(rows, tokens, rooms):
            ends = self.ends.setdefault(row, [])
            ends.append(len(ids))
            if len(ends) < self.turns and len(self.fed) + 1 < room:
                out[row] = (self.fed, self.limit)
        return out


def structure(batch, turns: FixedTurns, fed: int) -> list[list[tuple[int, int]]]:
    """Each row's turns as (first column, tokens sampled), the last one to its end."""
    out = []
    for row, length in enumerate(batch.response_lengths.tolist()):
        starts, spans = [0], []
        for end in turns.ends.get(row, []):
            spans.append((starts[-1], end - starts[-1]))
            starts.append(end + fed)
        if starts[-1] < length:
            spans.append((starts[-1], length - starts[-1]))
        out.append([s for s in spans if s[1] > 0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-4.4M")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="the first prompt (system, tools, question)")
    parser.add_argument("--end-ids", type=int, default=128, help="a random model's end-of-turn ids")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--fed", type=int, default=40, help="ids fed between two turns")
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()

    scratch = tempfile.TemporaryDirectory()
    random_model = args.model == "llama-4.4M"
    model_dir = make_llama_4m(Path(scratch.name)) if random_model else resolve_model_dir(args.model)
    tok = load_tokenizer(model_dir)
    numerics = kernels.numerics()
    model = load_model(model_dir, numerics)
    weights = export_state(model)
    vocab = model.config.vocab_size
    ends = tuple(range(vocab - args.end_ids, vocab)) if random_model else tok.eos_ids
    cont = RolloutEngine(model.config, args.precision, ends, tok.pad_id, numerics)
    again = RolloutEngine(model.config, args.precision, (), tok.pad_id, numerics)  # rows run to their limits
    for engine in (cont, again):
        engine.weights.load(weights, version=0)
    gen = torch.Generator().manual_seed(0)
    top = vocab - (args.end_ids if random_model else 0)  # the prompts and fed ids hold no end-of-turn id
    prompts = [torch.randint(3, top, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.prompts)]
    fed = torch.randint(3, top, (args.fed,), generator=gen).tolist()
    budget = args.turns * (args.turn_tokens + args.fed)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=budget)
    rows = args.prompts * args.group

    def continued(seed: int):
        turns = FixedTurns(fed, args.turns, args.turn_tokens)
        batch = cont.generate(prompts, args.group, sampling, seed, limits=[args.turn_tokens] * rows, between=turns)
        return batch, turns

    batch, turns = continued(0)
    spans = structure(batch, turns, args.fed)
    ids = [batch.prompt_ids[r] + batch.response_ids[r].tolist() for r in range(rows)]

    def prefilled_again(seed: int) -> None:
        """One call per turn: each row that has turn i prefills its conversation up to it and samples it."""
        for i in range(max(len(s) for s in spans)):
            live = [r for r in range(rows) if len(spans[r]) > i]
            context = [ids[r][: len(batch.prompt_ids[r]) + spans[r][i][0]] for r in live]
            limits = [spans[r][i][1] for r in live]
            again.generate(context, 1, SamplingParams(temperature=1.0, max_new_tokens=max(limits)), seed, limits=limits)

    arms = {"kv_cache": lambda s: continued(s), "prefill_again": prefilled_again}
    for fn in arms.values():
        fn(1)  # warm-up
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(args.repeats):
        for arm in list(arms)[r % 2 :] + list(arms)[: r % 2]:
            start = time.perf_counter()
            arms[arm](0)
            times[arm].append(time.perf_counter() - start)
    median = {arm: statistics.median(t) for arm, t in times.items()}
    turn_counts = [len(s) for s in spans]
    record = {
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "fed_per_gap": args.fed,
        "precision": args.precision,
        "rows": rows,
        "turns_mean": statistics.mean(turn_counts),
        "rows_with_all_turns": sum(c == args.turns for c in turn_counts),
        "sampled_tokens": int(batch.sampled_mask.sum()),
        "fed_tokens": int(batch.env_mask.sum()),
        "seconds": median,
        "prefill_again_over_kv_cache": median["prefill_again"] / median["kv_cache"],
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        **cpu.features().describe(),
    }
    print(json.dumps(record, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
