"""Parity vs TRL's GRPOTrainer with `tools=` on the same tool task (results: docs/benchmarks.md).

The task is docs/agents.md's `tools=[lookup]` example: the built-in agent model (`builtin-agent`) asked
`c?` must call `lookup(key)`, which reads one global price table (`PRICES`), then answer with the
price; the reward is 1 when the final answer is the price. Both sides get the same rows, the same tool
function, group size, budget of tokens after the prompt (`--new-tokens`: the model's and the tool's),
turns (Parity's `episode.max_turns` 4, TRL's `max_tool_calling_iterations` 3), learning rate (3e-4, one
update per rollout), loss (PPO-clip GRPO, group-normalised advantages, per-token sums over the max
length: TRL's `dr_grpo`, Parity's `grpo` + `seq_mean_token_sum_norm`), precision and torch threads
(`--threads`). Each run is a fresh process; the sides alternate, TRL then Parity, `--rounds` times.
Reported per side: the median step time over the steps after the warm-up, pooled over the rounds,
accuracy and tool calls per episode at each step, max RSS; and the ratio TRL / Parity.

TRL needs one thing for this model: a tool-call parser. It sets one (`tokenizer.response_template`)
only for chat templates it knows by their exact text, and builtin-agent's ChatML + Hermes template is
not one of them, so `GRPOTrainer` raises "Unrecognized chat template". builtin-agent writes calls as
Qwen2.5/Qwen3 do (`<tool_call>{json}</tool_call>` then `<|im_end|>`), so the script gives its tokenizer
TRL's own Qwen3 parser (`trl.chat_template_utils.qwen3_template`) before building the trainer.

The audit (`--audit-steps`, in its own processes): what TRL's loop trains against what it sampled. Every
call of `GRPOTrainer._generate_single_turn` (each turn's inputs and sampled ids) and every batch
`_compute_loss` reads (prompt, completion, masks) are recorded; each sampled turn is found in the
trained row it belongs to and compared id by id. Counted: sampled ids the trainer scores as another id,
trained (loss-mask) ids no turn sampled, and sampled ids cut off. Beside it, what a pipeline that
re-tokenizes would have trained (TRL before 1.16): the same episodes' parsed messages rendered by the
chat template and encoded again, aligned with the sampled ids (`parity.engines.turns.drifted_tokens`,
what Parity's `retokenization/tokens_frac` counts). Two templates: builtin-agent's, sampling itself; and
Qwen3's real tokenizer and chat template on a tiny random Qwen3 model driven by a scripted policy (a
logits processor given to its `generate` forces an episode whose tool call is spelled in ids that are not
the tokenizer's own encoding of its text, as a sampling model's sometimes are). Parity's count is 0 by
construction: it never re-tokenizes a sampled turn.

    pip install trl==1.16.0
    python benchmarks/agents_vs_trl.py [--steps 8] [--warmup 2] [--rounds 3] [--precisions fp32,bf16]
        [--threads 2] [--prompts 16] [--group 8] [--new-tokens 96] [--audit-steps 2]
        [--qwen3-tokenizer DIR] [--json out.json]

`--qwen3-tokenizer`: a folder with Qwen3's tokenizer.json and tokenizer_config.json (default: the cache
tests/real_tokenizers.py fills, `$PARITY_REAL_TOKENIZERS/qwen3` or ~/.cache/parity/real-tokenizers/qwen3);
without one the Qwen3 audit is skipped, saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from engines import isolated  # noqa: E402
from vs_trl import _max_rss_mb, _threads, grpo_config  # noqa: E402

LR = 3e-4
MAX_TURNS = 4  # Parity's episode.max_turns default; TRL: 1 turn + MAX_TURNS - 1 tool iterations

# ----------------------------------------------------------------------------- the task (docs/agents.md)

PRICES = {key: str(random.Random(key).randrange(100, 1000)) for key in "abcdefghijklmnop"}


def lookup(key: str) -> str:
    """The price stored under a key.

    Args:
        key: one letter, a to p.
    """
    return PRICES.get(key, f"no key {key}")


def right_price(completions, answer, **columns):  # Parity: `completions` are each episode's last answer
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def _rows(n: int) -> list[dict]:
    rows = [{"prompt": [{"role": "user", "content": f"{key}?"}], "answer": PRICES[key]} for key in PRICES]
    return (rows * (n // len(rows) + 1))[:n]


def _final_answer(messages: list[dict]) -> str:
    answers = [m for m in messages if m.get("role") == "assistant"]
    return (answers[-1].get("content") or "") if answers else ""


@dataclass(frozen=True)
class Work:
    model_dir: str
    rows: int  # data rows (enough for every step's prompts)
    prompts: int
    group: int
    new_tokens: int
    precision: str
    steps: int
    threads: int
    seed: int = 0


# ----------------------------------------------------------------------------- Parity


def parity_steps(work: Work, warmup: int) -> dict:
    import parity

    _threads(work)
    with tempfile.TemporaryDirectory() as tmp:
        history = parity.train(
            work.model_dir,
            _rows(work.rows),
            [right_price],
            tools=[lookup],
            run_dir=Path(tmp) / "run",
            progress=False,
            precision=work.precision,
            algorithm__name="grpo",
            algorithm__advantage="grpo",
            algorithm__aggregation="seq_mean_token_sum_norm",
            algorithm__truncated="keep",  # TRL keeps a truncated completion's reward
            trainer__lr=LR,
            prompts_per_step=work.prompts,
            rollout__group_size=work.group,
            rollout__max_new_tokens=work.new_tokens,
            episode__max_turns=MAX_TURNS,
            steps=work.steps,
            checkpoint_every=-1,
            tensorboard=False,
            eval__every=-1,
            log__completions=0,
            trainer__micro_batch_tokens=work.prompts * work.group * (work.new_tokens + 64),  # one micro-batch
            seed=work.seed,
        ).history
    return {
        "step_s": [m["time/step"] for m in history[warmup:]],
        "accuracy": [m["reward/right_price/mean"] for m in history],  # 0 or 1 per episode: the accuracy
        "tool_calls_mean": [m["episode/tool_calls_mean"] for m in history],
        "retokenization_tokens_frac": [m.get("retokenization/tokens_frac") for m in history],
        # its default count of what a re-tokenizing pipeline would train (episode.retokenization), in the step
        "retokenization_s": [m.get("time/retokenization") for m in history[warmup:]],
        "peak_mb": _max_rss_mb(),
    }


# ----------------------------------------------------------------------------- TRL


def trl_tokenizer(model_dir: str):
    """The model's tokenizer with a tool-call parser TRL can use: its own for a template it knows, else
    its Qwen3 parser (ChatML with `<tool_call>{json}</tool_call>`, builtin-agent's format)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        add_response_schema(tokenizer)
        parser = "trl's own (template recognised)"
    except ValueError:  # "Unrecognized chat template"
        tokenizer.response_template = qwen3_template
        parser = "trl.chat_template_utils.qwen3_template (template not recognised by TRL)"
    return tokenizer, parser


def trl_trainer(work: Work, callbacks: list, on_reward=None, trainer_class=None):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    def reward(prompts, completions, answer, **kwargs):
        finals = [_final_answer(c) for c in completions]
        scores = [float(f.strip() == a) for f, a in zip(finals, answer)]
        if on_reward is not None:
            on_reward(prompts, completions, scores, kwargs.get("completion_ids"))
        return scores

    args = grpo_config(work, LR, max_tool_calling_iterations=MAX_TURNS - 1, gradient_checkpointing=False)
    tokenizer, parser = trl_tokenizer(work.model_dir)
    trainer = (trainer_class or GRPOTrainer)(
        model=AutoModelForCausalLM.from_pretrained(work.model_dir, dtype=torch.float32),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(_rows(work.rows)),
        processing_class=tokenizer,
        tools=[lookup],
        callbacks=callbacks,
    )
    return trainer, parser


def trl_steps(work: Work, warmup: int) -> dict:
    from transformers import TrainerCallback

    _threads(work)
    times: list[float] = []
    accuracy: list[float] = []
    tool_calls: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    def on_reward(prompts, completions, scores, completion_ids):
        accuracy.append(sum(s >= 1.0 for s in scores) / len(scores))
        tool_calls.append(sum(m.get("role") == "tool" for c in completions for m in c) / len(completions))

    trainer, parser = trl_trainer(work, [StepTimer()], on_reward)
    trainer.train()
    return {
        "step_s": times[warmup:],
        "accuracy": accuracy,
        "tool_calls_mean": tool_calls,
        "parser": parser,
        "peak_mb": _max_rss_mb(),
    }


# ----------------------------------------------------------------------------- the audit


def _audited_class():
    """GRPOTrainer recording each turn it samples and each batch its loss reads, by step."""
    from trl import GRPOTrainer

    class Audited(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            turns = self.audit.setdefault(self.state.global_step, {"turns": [], "rows": []})["turns"]
            turns.extend((list(p), list(c)) for p, c in zip(prompt_ids, ids))
            return ids, logprobs

        def _compute_loss(self, model, inputs):
            rows = self.audit.setdefault(self.state.global_step, {"turns": [], "rows": []})["rows"]
            loss_mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            for p, pm, c, cm, lm in zip(
                inputs["prompt_ids"].tolist(),
                inputs["prompt_mask"].tolist(),
                inputs["completion_ids"].tolist(),
                inputs["completion_mask"].tolist(),
                loss_mask.tolist(),
            ):
                prompt = [i for i, m in zip(p, pm) if m]
                kept = [k for k, m in enumerate(cm) if m]
                rows.append((prompt, [c[k] for k in kept], [bool(lm[k]) for k in kept]))
            return super()._compute_loss(model, inputs)

    return Audited


def compare_turns(turns: list[tuple[list[int], list[int]]], rows: list[tuple]) -> dict:
    """Each sampled turn in the trained row it belongs to: a turn belongs to a row whose ids start with
    the turn's inputs; among a group's rows (same inputs) the turns are matched one to one, best first."""
    counts = {"rows": len(rows), "turns": len(turns), "sampled": 0, "differing": 0, "cut_off": 0, "trained": 0}
    counts["trained_not_sampled"] = 0
    used = [False] * len(turns)
    for prompt, completion, trained in rows:
        full = prompt + completion
        covered: set[int] = set()
        # the row's turns, shortest inputs first; each input length is one turn of this row
        candidates = sorted(
            (i for i, (inp, _) in enumerate(turns) if not used[i] and full[: len(inp)] == inp),
            key=lambda i: len(turns[i][0]),
        )
        by_length: dict[int, list[int]] = {}
        for i in candidates:
            by_length.setdefault(len(turns[i][0]), []).append(i)
        for length, group in sorted(by_length.items()):
            best = max(group, key=lambda i, at=length, seq=full: sum(a == b for a, b in zip(seq[at:], turns[i][1])))
            used[best] = True
            out = turns[best][1]
            counts["sampled"] += len(out)
            for k, token in enumerate(out):
                at = length + k
                if at >= len(full):
                    counts["cut_off"] += 1
                    continue
                covered.add(at)
                counts["differing"] += full[at] != token
        for k, is_trained in enumerate(trained):
            counts["trained"] += is_trained
            counts["trained_not_sampled"] += is_trained and (len(prompt) + k) not in covered
    counts["turns_unmatched"] = used.count(False)
    return counts


class ScriptedPolicy:
    """A logits processor that makes `generate` play the episode: in the first turn a `lookup` call for the
    key the user asked (`_non_canonical_call`'s ids), after a tool response the tool's answer, each turn
    closed by `<|im_end|>`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.response = tokenizer.convert_tokens_to_ids("<tool_response>")
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.header = tokenizer.encode("assistant\n", add_special_tokens=False)

    def _target(self, context: list[int]) -> tuple[list[int], int]:
        """This turn's ids and where it began (after the last `<|im_start|>assistant\\n`)."""
        at = max(i for i, t in enumerate(context) if t == self.start) + 1 + len(self.header)
        if self.response not in context:
            key = re.search(r"<\|im_start\|>user\n([a-p])\?", self.tokenizer.decode(context)).group(1)
            return _non_canonical_call(self.tokenizer, key)[0], at
        answer = self.tokenizer.decode(context[context.index(self.response) + 1 :]).split("</tool_response>")[0]
        return self.tokenizer.encode(answer.strip(), add_special_tokens=False), at

    def __call__(self, input_ids, scores):
        import torch

        forced = torch.full_like(scores, float("-inf"))
        for row, ids in enumerate(input_ids.tolist()):
            target, at = self._target(ids)
            done = len(ids) - at
            forced[row, target[done] if done < len(target) else self.end] = 0.0
        return forced


def _tiny_qwen3(folder: Path, tokenizer_dir: Path) -> None:
    """A random 2-layer Qwen3 with the real Qwen3 tokenizer and chat template (as TRL ships it)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    from trl.chat_template_utils import qwen3_chat_template

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
    # The npm copy's template is an earlier revision of Qwen3's (it reads `message.content` without checking
    # that it is text); TRL knows Qwen3 by the current one, which it ships: that one is used.
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = qwen3_chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=[151645, 151643],
        pad_token_id=151643,
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643).save_pretrained(folder)


def _non_canonical_call(tokenizer, key: str) -> tuple[list[int], str]:
    """The ids of a `lookup` call spelled in pieces encoded apart (`"loo` + `kup"`, `\\n` + `\\n`): the same
    text as the tokenizer's own encoding of it, other ids."""
    pieces = [
        "<tool_call>",
        "\n",
        '{"name": "loo',
        f'kup", "arguments": {{"key": "{key}"}}}}',
        "\n",
        "\n",
        "</tool_call>",
    ]
    ids = [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False)]
    text = "".join(pieces)
    assert tokenizer.decode(ids) == text and tokenizer.encode(text, add_special_tokens=False) != ids
    return ids, text


def audit_job(model_dir: str, steps: int, prompts: int, group: int, new_tokens: int, scripted: bool) -> dict:
    import torch
    from transformers import LogitsProcessorList

    from parity.engines.turns import drifted_tokens

    torch.set_num_threads(2)
    work = Work(model_dir, prompts * steps, prompts, group, new_tokens, "fp32", steps, 2)
    episodes: dict[tuple, list[dict]] = {}  # completion ids -> the episode's messages (as TRL parsed them)
    accuracy: list[float] = []

    def on_reward(prompts_, completions, scores, completion_ids):
        accuracy.append(sum(scores) / len(scores))
        for p, c, ids in zip(prompts_, completions, completion_ids):
            first = [m for m in p if m.get("role") != "assistant"][:1]
            episodes[tuple(ids)] = first + list(c)

    trainer, parser = trl_trainer(work, [], on_reward, _audited_class())
    trainer.audit = {}
    record: dict = {"parser": parser, "template_prefix_preserving": trainer.chat_template is None}
    if scripted:
        call_ids, call_text = _non_canonical_call(trainer.processing_class, "c")
        policy = ScriptedPolicy(trainer.processing_class)
        model = trainer.model
        generate = model.generate

        def scripted_generate(*args, **kwargs):
            return generate(*args, logits_processor=LogitsProcessorList([policy]), **kwargs)

        model.generate = scripted_generate
        canonical = trainer.processing_class.encode(call_text, add_special_tokens=False)
        record["scripted_call"] = {"text": call_text, "ids": call_ids, "canonical_ids": canonical}
    trainer.train()

    tokenizer = trainer.processing_class
    totals: dict[str, int] = {}
    retokenized = {"episodes": 0, "episodes_drifted": 0, "sampled_tokens": 0, "drifted_tokens": 0}
    tool_calls = 0
    for step in sorted(trainer.audit):
        turns, rows = trainer.audit[step]["turns"], trainer.audit[step]["rows"]
        for key, value in compare_turns(turns, rows).items():
            totals[key] = totals.get(key, 0) + value
        for prompt, completion, trained in rows:
            messages = episodes.get(tuple(completion))
            if messages is None:
                continue
            tool_calls += sum(m.get("role") == "tool" for m in messages)
            again = tokenizer.apply_chat_template(messages, tools=[lookup], tokenize=True, return_dict=False)
            mask = [False] * len(prompt) + trained
            drifted = len(drifted_tokens(prompt + completion, mask, list(again)))
            retokenized["episodes"] += 1
            retokenized["episodes_drifted"] += drifted > 0
            retokenized["sampled_tokens"] += sum(trained)
            retokenized["drifted_tokens"] += drifted
    record["trl_loop"] = totals
    record["accuracy"] = accuracy
    record["tool_calls_mean"] = tool_calls / max(retokenized["episodes"], 1)
    record["retokenizing_pipeline"] = retokenized
    return record


def audit(args) -> dict:
    from parity.engines.models.io import resolve_model_dir

    out = {}
    builtin = str(resolve_model_dir("builtin-agent"))
    out["builtin-agent"] = isolated(
        audit_job, builtin, args.audit_steps, args.prompts, args.group, args.new_tokens, False
    )
    folder = args.qwen3_tokenizer
    if folder is None:
        root = os.environ.get("PARITY_REAL_TOKENIZERS")
        folder = (Path(root) if root else Path.home() / ".cache" / "parity" / "real-tokenizers") / "qwen3"
    if not (folder / "tokenizer.json").is_file():
        out["qwen3"] = {"skipped": f"no Qwen3 tokenizer at {folder} (pass --qwen3-tokenizer)"}
        return out
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "qwen3-tiny"
        _tiny_qwen3(model, folder)
        out["qwen3"] = isolated(audit_job, str(model), args.audit_steps, 2, 2, args.new_tokens, True)
    return out


# ----------------------------------------------------------------------------- main


def machine() -> dict:
    import torch

    from parity.engines.kernels import cpu

    flags = sorted(f for f in cpu.cpu_flags() if f.startswith(("avx", "amx", "fma")))
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": flags,
        **cpu.features().describe(),
        "torch": torch.__version__,
        "cores": os.cpu_count(),
    }


def step_table(args) -> list[dict]:
    from parity.engines.models.io import resolve_model_dir

    model_dir = str(resolve_model_dir("builtin-agent"))
    steps = args.steps + args.warmup
    out = []
    print(
        "| precision | Parity step s | TRL step s | TRL / Parity | Parity accuracy | TRL accuracy | "
        "Parity tool calls | TRL tool calls |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for precision in args.precisions.split(","):
        work = Work(
            model_dir, args.prompts * steps, args.prompts, args.group, args.new_tokens, precision, steps, args.threads
        )
        rounds = [
            (isolated(trl_steps, work, args.warmup), isolated(parity_steps, work, args.warmup))
            for _ in range(args.rounds)
        ]
        trl = [x for r, _ in rounds for x in r["step_s"]]
        ours = [x for _, r in rounds for x in r["step_s"]]
        row = {
            "precision": precision,
            "parity_step_s": statistics.median(ours),
            "trl_step_s": statistics.median(trl),
            "parity_step_s_all": ours,
            "trl_step_s_all": trl,
            "parity_accuracy": [r["accuracy"] for _, r in rounds],
            "trl_accuracy": [r["accuracy"] for r, _ in rounds],
            "parity_tool_calls_mean": [r["tool_calls_mean"] for _, r in rounds],
            "trl_tool_calls_mean": [r["tool_calls_mean"] for r, _ in rounds],
            "parity_retokenization_tokens_frac": [r["retokenization_tokens_frac"] for _, r in rounds],
            "parity_retokenization_s": [r["retokenization_s"] for _, r in rounds],
            "parity_peak_mb": max(r["peak_mb"] for _, r in rounds),
            "trl_peak_mb": max(r["peak_mb"] for r, _ in rounds),
            "trl_parser": rounds[0][0]["parser"],
        }
        row["trl_over_parity"] = row["trl_step_s"] / row["parity_step_s"]
        out.append(row)

        def mean(runs: list[list[float]]) -> float:
            values = [x for run in runs for x in run]
            return sum(values) / len(values)

        print(
            f"| {precision} | {row['parity_step_s']:.3f} | {row['trl_step_s']:.3f} | {row['trl_over_parity']:.2f}x | "
            f"{mean(row['parity_accuracy']):.3f} | {mean(row['trl_accuracy']):.3f} | "
            f"{mean(row['parity_tool_calls_mean']):.2f} | {mean(row['trl_tool_calls_mean']):.2f} |",
            flush=True,
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="TRL/Parity run pairs per precision")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="episodes per prompt")
    parser.add_argument("--new-tokens", type=int, default=96, help="tokens after the prompt: sampled and fed")
    parser.add_argument("--audit-steps", type=int, default=2, help="steps of each audit run (0: no audit)")
    parser.add_argument("--qwen3-tokenizer", type=Path, help="folder with Qwen3's tokenizer files (the audit)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads < 1:
        parser.error("--threads must be >= 1 (both sides get the same count)")
    out = {"machine": machine(), "threads": args.threads, "settings": vars(args) | {"json": str(args.json)}}
    out["settings"]["qwen3_tokenizer"] = str(args.qwen3_tokenizer)
    out["step_time"] = step_table(args)
    if args.audit_steps:
        out["audit"] = audit(args)
        for name, record in out["audit"].items():
            print(f"audit {name}: {json.dumps(record)}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
