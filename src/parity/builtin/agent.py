"""Build the shipped tool-calling model, `builtin-agent`, from scratch: `parity build-model --agent`.

A Llama of the built-in model's size with a character-level tokenizer and a ChatML chat template with
Hermes-style tool calls (the format Qwen2.5 and Qwen3 use), pretrained by next-token prediction on whole
episodes of the `lookup` task (`rl/lookup.py`). So that RL has something to learn, and a way to learn
it, the pretraining questions come in two forms: `c!`, after which the call asks for the key the user
named, and `c?` (the task's form), after which it asks for a key drawn uniformly from a..p; the tool's
answer and the final answer follow from the key called. The base model follows the protocol (a
well-formed call, then the tool's answer copied) and, asked `c?`, calls the right key one time in 16: it
can copy a key, and RL has to teach it to do so for the task's question.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from parity.builtin.build import (
    builtin_model_config,
    char_tokenizer,
    check_build_dir,
    model_files,
    padded,
    set_lr,
    warmup_lr,
)
from parity.engines import kernels
from parity.engines.models.config import ModelConfig
from parity.engines.models.io import AGENT_DIR, save_model
from parity.engines.models.modules import CausalLM
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import Message, Tokenizer, load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer
from parity.rl.lookup import KEYS, TOOL_NAME, LookupProblem, lookup_problems, lookup_reward, lookup_tool
from parity.runtime import draws_bars

AGENT_SPECIALS = ("<pad>", "<|im_end|>", "<|im_start|>")  # ids 0, 1 (EOS: the end of a turn), 2
AGENT_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")  # added, not special
AGENT_CHARS = 'abcdefghijklmnopqrstuvwxyz0123456789 \n{}":,?_!'

# ChatML, one `<|im_start|>ROLE\nCONTENT<|im_end|>\n` per message. An assistant message's tool calls follow
# its content, each as <tool_call>{"name":...,"arguments":{...}}</tool_call> in compact JSON; a call is
# {"function": {"name", "arguments"}} (OpenAI's and transformers' form) or {"name", "arguments"}, its
# arguments a mapping or a JSON string written as it is. A tool message's content is wrapped in
# <tool_response>...</tool_response>. The `tools` variable is ignored: the model knows its one tool.
AGENT_CHAT_TEMPLATE = (
    "{#- builtin-agent: ChatML with Hermes-style tool calls; `tools` is ignored (the model knows its one tool, "
    "lookup(key)) -#}\n"
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' }}\n"
    "{%- if message.role == 'tool' %}\n"
    "{{- '<tool_response>' + message.content + '</tool_response>' }}\n"
    "{%- else %}\n"
    "{%- if message.content is string %}{{- message.content }}{%- endif %}\n"
    "{%- if message.tool_calls is defined and message.tool_calls %}\n"
    "{%- for call in message.tool_calls %}\n"
    "{%- set fn = call.function if call.function is defined else call %}\n"
    "{%- if fn.arguments is string %}\n"
    "{{- '<tool_call>{\"name\":' + fn.name | tojson + ',\"arguments\":' + fn.arguments + '}</tool_call>' }}\n"
    "{%- else %}\n"
    "{{- '<tool_call>' + {'name': fn.name, 'arguments': fn.arguments} | tojson(separators=(',', ':'))"
    " + '</tool_call>' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class AgentBuildConfig:
    """Every hyper-parameter of the agent model's build."""

    steps: int = 1000  # the tool's answer is copied from about step 850 on (before, a plateau at loss 0.20)
    batch_size: int = 32
    named_prob: float = 0.5  # pretraining questions of the form `c!` (the named key called); the rest `c?`
    lr: float = 3e-3
    warmup: int = 50
    seed: int = 0
    eval_problems: int = 128
    eval_samples: int = 8


def agent_model_config() -> ModelConfig:
    """The built-in model's shape with the agent's vocabulary, 2 layers (enough to copy from fixed offsets,
    twice as fast as 4) and room for a whole episode."""
    return dataclasses.replace(
        builtin_model_config(),
        vocab_size=len(AGENT_SPECIALS) + len(AGENT_ADDED) + len(AGENT_CHARS),
        num_layers=2,
        max_position_embeddings=256,
    )


def write_agent_tokenizer(out_dir: Path) -> None:
    """The agent model's `tokenizer.json`, `tokenizer_config.json` (with the chat template) and
    `generation_config.json`."""
    char_tokenizer(AGENT_CHARS, AGENT_SPECIALS, AGENT_ADDED, newline=True).save(str(out_dir / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "chat_template": AGENT_CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "pad_token_id": 0}, indent=2) + "\n")


def tool_call_message(key: str, content: str = "") -> Message:
    """The assistant's turn that calls the tool for `key`, as a chat message."""
    call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"key": key}}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def episode(problem: LookupProblem, called_key: str) -> list[Message]:
    """A whole episode whose call asks for `called_key`: the prompt, the call, the tool's answer, and
    that answer as the final message."""
    result = lookup_tool(problem.table)(key=called_key)
    return [
        *problem.prompt,
        tool_call_message(called_key),
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]


def episode_ids(tok: Tokenizer, messages: list[Message]) -> tuple[list[int], list[int], list[bool]]:
    """An episode of [prompt..., assistant call, tool, final assistant] as the trainer takes it: the ids of
    the first prompt (with the assistant's header), then the rest as one "response", and the loss mask
    over it: True on the assistant's tokens (each turn's text and its `<|im_end|>`), False on the tool's
    and the template's."""
    prompt = tok.encode_chat(messages[:-3])
    before_final = tok.encode_chat(messages[:-1])  # ...the tool's message, then `<|im_start|>assistant\n`
    if before_final[: len(prompt)] != prompt:
        raise ValueError("the chat template does not render the conversation as a prefix of its continuation")
    middle = before_final[len(prompt) :]
    call_end = middle.index(tok.eos_id) + 1  # the call's turn, up to and including its `<|im_end|>`
    final = tok.encode(messages[-1]["content"]) + [tok.eos_id]
    mask = [True] * call_end + [False] * (len(middle) - call_end) + [True] * len(final)
    return prompt, middle + final, mask


def pretraining_batch(
    tok: Tokenizer, size: int, named_prob: float, rng: random.Random
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """`size` training episodes: with `named_prob` the question `c!` and a call for key c, else the task's
    `c?` and a call for a key at random: (prompts, responses [B, T], the responses' extent [B, T] (a prefix
    of each row: what the trainer reads), the loss mask [B, T] (the assistant's tokens))."""
    prompts, responses, loss_masks = [], [], []
    for problem in lookup_problems(size, seed=rng.randrange(2**31)):
        if rng.random() < named_prob:
            problem = dataclasses.replace(problem, prompt=[{"role": "user", "content": f"{problem.key}!"}])
            called = problem.key
        else:
            called = rng.choice(KEYS)
        prompt, response, loss_mask = episode_ids(tok, episode(problem, called))
        prompts.append(prompt)
        responses.append(response)
        loss_masks.append(loss_mask)
    extent = padded([[True] * len(r) for r in responses], False, torch.bool)
    return prompts, padded(responses, tok.pad_id), extent, padded(loss_masks, False, torch.bool)


def parse_tool_call(text: str) -> dict | None:
    """The first `<tool_call>{...}</tool_call>` in `text` as {"name", "arguments"}, or None when there is
    none or it is not a call (JSON with a string `name` and an object `arguments`)."""
    found = TOOL_CALL.search(text)
    if found is None:
        return None
    try:
        call = json.loads(found.group(1))
    except ValueError:
        return None
    if (
        not isinstance(call, dict)
        or not isinstance(call.get("name"), str)
        or not isinstance(call.get("arguments"), dict)
    ):
        return None
    return call


def episode_scores(
    model: CausalLM, tokenizer_dir: str | Path, problems: list[LookupProblem], samples: int, seed: int
) -> dict[str, float]:
    """Two-turn episodes sampled at temperature 1, without the episode engine: `samples` first turns per
    problem, each parsed for its call and answered by the tool through the chat template, then the final
    turn. `protocol_rate`: a well-formed call to the tool, then the tool's answer copied as the final
    message; `accuracy`: the final message is the answer (the task's reward); `right_key_rate`: the call
    asked for the prompt's key."""
    tok = load_tokenizer(tokenizer_dir)
    engine = RolloutEngine(model.config, "fp32", tok.eos_ids, tok.pad_id, kernels.numerics())
    engine.weights.load(model.state_dict(), version=0)
    first = engine.generate(
        [tok.encode_chat(p.prompt) for p in problems], samples, SamplingParams(max_new_tokens=64), seed=seed
    )
    rows, second_prompts = [], []
    for row in range(len(problems) * samples):
        problem = problems[row // samples]
        text = tok.decode(first.response_ids[row][first.response_mask[row]].tolist())
        call = parse_tool_call(text)
        if call is None or call["name"] != TOOL_NAME:
            continue
        result = lookup_tool(problem.table)(**call["arguments"])
        content = TOOL_CALL.sub("", text, count=1)
        messages = [*problem.prompt, {**tool_call_message("", content), "tool_calls": [{"function": call}]}]
        messages.append({"role": "tool", "content": result})
        rows.append((problem, call, result))
        second_prompts.append(tok.encode_chat(messages))
    protocol = correct = right_key = 0
    if rows:
        second = engine.generate(second_prompts, 1, SamplingParams(max_new_tokens=16), seed=seed + 1)
        for i, (problem, call, result) in enumerate(rows):
            final = tok.decode(second.response_ids[i][second.response_mask[i]].tolist())
            finished = not bool(second.truncated[i])
            protocol += finished and final == result
            correct += finished and lookup_reward(final, problem.answer) == 1.0
            right_key += call["arguments"].get("key") == problem.key
    total = len(problems) * samples
    return {
        "call_rate": len(rows) / total,
        "protocol_rate": protocol / total,
        "right_key_rate": right_key / total,
        "accuracy": correct / total,
    }


def build_agent_model(out_dir: str | Path, cfg: AgentBuildConfig = AgentBuildConfig(), log=print) -> dict[str, float]:
    """Train the agent model from scratch and save it (HF format) to `out_dir`, which it replaces: refused
    unless it is new, empty, the shipped agent model's folder, or one `build-model` wrote (`outdir.py`).
    Returns `episode_scores` on held-out problems."""
    out_dir = Path(out_dir)
    check_build_dir(out_dir, AGENT_DIR)
    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory(prefix="parity-tokenizer-") as tok_dir:
        return _build(out_dir, Path(tok_dir), cfg, log)


def _build(out_dir: Path, tok_dir: Path, cfg: AgentBuildConfig, log) -> dict[str, float]:
    write_agent_tokenizer(tok_dir)
    (tok_dir / "config.json").write_text(json.dumps(agent_model_config().to_hf()))
    tok = load_tokenizer(tok_dir)

    model = CausalLM(agent_model_config(), kernels.numerics())  # trained on the CPU
    model.init_weights(cfg.seed)
    trainer = Trainer(model, "fp32", OptimConfig(lr=cfg.lr, weight_decay=0.1, beta2=0.98, grad_clip=1.0))
    rng = random.Random(cfg.seed)
    start = time.time()
    bar = tqdm(range(cfg.steps), desc="build-model --agent", unit="step", disable=not draws_bars())
    for step in bar:
        set_lr(trainer, warmup_lr(cfg.lr, step, cfg.warmup))
        prompts, responses, extent, loss_mask = pretraining_batch(tok, cfg.batch_size, cfg.named_prob, rng)
        logp = trainer.logprobs(prompts, responses, extent)
        loss = -((logp * loss_mask).sum() / loss_mask.sum())
        trainer.backward(loss)
        stats = trainer.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", gnorm=f"{stats.grad_norm:.2f}")
    bar.close()
    log(f"pretrained {cfg.steps} steps in {time.time() - start:.0f}s")
    problems = lookup_problems(cfg.eval_problems, seed=cfg.seed, split="eval")
    scores = episode_scores(model, tok_dir, problems, cfg.eval_samples, cfg.seed)
    log("held-out episodes at temperature 1: " + ", ".join(f"{k}={v:.3f}" for k, v in scores.items()))
    save_model(model, out_dir, partial(model_files, tok_dir))
    return scores
