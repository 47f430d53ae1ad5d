"""Reproduce the built-in base model from scratch: `parity build-model`.

A ~0.8M-parameter Llama with a character-level tokenizer, pretrained by supervised
next-token prediction on worked solutions of the built-in arithmetic task, and
stopped early on purpose: the base model must solve many held-out problems only
*sometimes* (per-problem accuracy in [0.2, 0.8] at temperature 1), which is the
material RL fine-tuning and the sanity test need.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from parity.commands.perfectible import problem_accuracies
from parity.engines import kernels
from parity.engines.models.config import ModelConfig
from parity.engines.models.io import BUILTIN_DIR, save_model
from parity.engines.models.modules import CausalLM
from parity.engines.rollout import RolloutEngine
from parity.engines.tokenizer import copy_tokenizer_files, load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer
from parity.outdir import check_output_dir, mark_written
from parity.rl.builtin_rewards import builtin_reward
from parity.rl.problems import BUILTIN_CHARS, BUILTIN_SPECIALS, ArithmeticTask, Problem
from parity.rl.rewards import RewardRunner
from parity.runtime import draws_bars


@dataclass(frozen=True)
class BuildConfig:
    steps: int = 1200
    batch_size: int = 64
    slip_prob: float = 0.4  # fraction of pretraining solutions with one wrong step
    lr: float = 3e-3
    warmup: int = 100
    seed: int = 0
    eval_problems: int = 128
    eval_samples: int = 16


def builtin_model_config() -> ModelConfig:
    vocab = len(BUILTIN_SPECIALS) + len(BUILTIN_CHARS)
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )


def char_tokenizer(chars: str, specials: tuple[str, ...], added: tuple[str, ...] = (), newline: bool = False):
    """A character-level `tokenizers` tokenizer: the specials first (ids 0..), then the `added` tokens (added,
    not special: decoding keeps them, as Qwen2.5's `<tool_call>`), then one id per character. `newline`: a
    line break is a character like any other (the built-in model's pattern, `.`, leaves it out)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {tok: i for i, tok in enumerate(specials + added)}
    for ch in chars:
        vocab[ch] = len(vocab)
    tok = HFTokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r".|\n" if newline else "."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def write_tokenizer(out_dir: Path) -> None:
    """The built-in model's `tokenizer.json` (plus the HF side files)."""
    char_tokenizer(BUILTIN_CHARS, BUILTIN_SPECIALS).save(str(out_dir / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "pad_token_id": 0}, indent=2) + "\n")


def accuracy_spread(model: CausalLM, tokenizer_dir: Path, problems: int, samples: int, seed: int) -> dict[str, float]:
    """Per-problem accuracy over `samples` draws at temperature 1 on held-out problems."""
    tok = load_tokenizer(tokenizer_dir)
    probs = ArithmeticTask().problems(problems, seed=seed, split="eval")
    engine = RolloutEngine(model.config, "fp32", tok.eos_ids, tok.pad_id, kernels.numerics())
    engine.weights.load(model.state_dict(), version=0)
    runner = RewardRunner(builtin_reward, isolate=False)
    acc = torch.tensor(problem_accuracies(engine, tok, probs, runner, samples, seed=seed, batch_prompts=problems))
    return {
        "mean_accuracy": float(acc.mean()),
        "spread_fraction": float(((acc >= 0.2) & (acc <= 0.8)).float().mean()),
        "solved_fraction": float((acc > 0.8).float().mean()),
        "unsolved_fraction": float((acc < 0.2).float().mean()),
    }


def _slip(problem: Problem, prob: float, rng: random.Random) -> tuple[int, int] | None:
    """With probability `prob`, one step whose sum is off by 1-3 (kept in 0..19)."""
    if rng.random() >= prob:
        return None
    step = rng.randrange(ArithmeticTask.num_steps(problem))
    true_sum = int(ArithmeticTask.solution(problem).split(",")[step].split("=")[1].split(">")[0])
    wrong = [v for v in range(true_sum - 3, true_sum + 4) if v != true_sum and 0 <= v <= 19]
    return step, rng.choice(wrong)


def check_build_dir(out_dir: Path, shipped_dir: Path) -> None:
    """Refuse `out_dir` unless it is new, empty, the shipped model's folder (Parity's own), or one
    `build-model` wrote (`outdir.py`)."""
    if out_dir.resolve() != shipped_dir.resolve():
        check_output_dir(out_dir, "build-model")


def set_lr(trainer: Trainer, lr: float) -> None:
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr


def warmup_lr(peak: float, step: int, warmup: int) -> float:
    """Linear warm-up then constant: a shorter build is a prefix of a longer one."""
    return peak * min(1.0, (step + 1) / warmup)


def padded(rows: list[list[int]], fill: int | bool, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`rows` of different lengths as one [len(rows), longest] tensor, `fill` after each row's end."""
    out = torch.full((len(rows), max(len(r) for r in rows)), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def build_model(out_dir: str | Path, cfg: BuildConfig = BuildConfig(), log=print, on_eval=None) -> dict[str, float]:
    """Train the built-in model from scratch and save it (HF format) to `out_dir`, which it replaces: refused
    unless it is new, empty, the shipped model's folder, or one `build-model` wrote (`outdir.py`)."""
    out_dir = Path(out_dir)
    check_build_dir(out_dir, BUILTIN_DIR)
    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory(prefix="parity-tokenizer-") as tok_dir:
        return _build(out_dir, Path(tok_dir), cfg, log, on_eval)


def _build(out_dir: Path, tok_dir: Path, cfg: BuildConfig, log, on_eval) -> dict[str, float]:
    write_tokenizer(tok_dir)
    (tok_dir / "config.json").write_text(json.dumps(builtin_model_config().to_hf()))
    tok = load_tokenizer(tok_dir)

    model = CausalLM(builtin_model_config(), kernels.numerics())  # trained on the CPU
    model.init_weights(cfg.seed)
    trainer = Trainer(model, "fp32", OptimConfig(lr=cfg.lr, weight_decay=0.1, beta2=0.98, grad_clip=1.0))
    task = ArithmeticTask()
    rng = random.Random(cfg.seed)
    start = time.time()
    bar = tqdm(range(cfg.steps), desc="build-model", unit="step", disable=not draws_bars())
    for step in bar:
        set_lr(trainer, warmup_lr(cfg.lr, step, cfg.warmup))
        problems = task.problems(cfg.batch_size, seed=rng.randrange(2**31))
        prompts = [tok.encode(p.prompt) for p in problems]
        answers = [tok.encode(task.solution(p, _slip(p, cfg.slip_prob, rng))) + [tok.eos_id] for p in problems]
        resp = padded(answers, tok.pad_id)
        mask = resp != tok.pad_id
        logp = trainer.logprobs(prompts, resp, mask)
        loss = -(logp.sum() / mask.sum())
        trainer.backward(loss)
        stats = trainer.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", gnorm=f"{stats.grad_norm:.2f}")
        if on_eval is not None:
            on_eval(step + 1, model, tok_dir)
    bar.close()
    log(f"pretrained {cfg.steps} steps in {time.time() - start:.0f}s")
    spread = accuracy_spread(model, tok_dir, cfg.eval_problems, cfg.eval_samples, cfg.seed)
    log("held-out accuracy: " + ", ".join(f"{k}={v:.3f}" for k, v in spread.items()))
    save_model(model, out_dir, partial(model_files, tok_dir))
    return spread


def model_files(tok_dir: Path, folder: Path) -> None:
    """The tokenizer's files beside the weights, and the mark that makes the folder Parity's to replace."""
    copy_tokenizer_files(tok_dir, folder)
    mark_written(folder, "build-model")
