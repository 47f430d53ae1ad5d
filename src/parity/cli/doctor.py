"""`parity doctor`: its flags and the call to `commands/doctor.py`."""

from __future__ import annotations

import argparse
from pathlib import Path

from parity.engines.tokenizer import CHAT_TEMPLATE_MODES


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor",
        help="is this model FP16-safe? weight/activation range per layer, mismatch per precision, a recommendation",
        description=(
            "Checks a local Hugging Face model directory of any family Parity runs (Llama, Mistral, Qwen2/2.5, "
            "Qwen3, Qwen3-MoE, Gemma 2/3), or the built-in model, for FP16 safety. Example: parity doctor --model "
            "builtin"
        ),
    )
    p.add_argument("--model", default="builtin", help="model directory, or 'builtin' (default)")
    p.add_argument("--out", help="also write doctor.json and doctor.md here")
    p.add_argument("--prompts", type=int, default=8, help="how many prompts to probe with (default 8)")
    p.add_argument(
        "--chat-template",
        choices=CHAT_TEMPLATE_MODES,
        default="auto",
        help="auto (default): encode the probe prompts with the model's chat template when it has one; none: raw text",
    )
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default) or cuda")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from parity.commands.doctor import UNTRAINABLE, render, run_doctor

    result = run_doctor(
        args.model,
        Path(args.out) if args.out else None,
        num_prompts=args.prompts,
        chat_template=args.chat_template,
        device=args.device,
    )
    print(render(result))
    return 1 if result["recommendation"] == UNTRAINABLE else 0
