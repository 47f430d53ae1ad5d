"""Tokenizers: a model directory's `tokenizer.json` plus the special ids generation needs.

Every id a step sees comes from here, so it must tokenize exactly as `transformers`
does for the same directory (DESIGN.md: a different prompt is a different policy).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parity.engines.models import ModelError, read_json, resolve_model_dir


class Tokenizer:
    """A `tokenizer.json` tokenizer plus the special ids generation needs. `eos_ids` holds
    every id that ends a response (instruct models often have several, e.g. end of turn and
    end of text); `eos_id` is the first of them."""

    def __init__(self, path: Path, eos_ids: tuple[int, ...], pad_id: int, bos_id: int | None):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))
        self.eos_ids, self.pad_id, self.bos_id = eos_ids, pad_id, bos_id
        self.eos_id = eos_ids[0]
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def longest_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry (added tokens included)."""
        return max(len(entry.encode("utf-8")) for entry in self._tok.get_vocab(with_added_tokens=True))

    def decode(self, ids: list[int]) -> str:
        stop = {*self.eos_ids, self.pad_id}
        return self._tok.decode([i for i in ids if i not in stop], skip_special_tokens=True)


def _special_id(tok_cfg: dict[str, Any], key: str, tokenizer_json: Path) -> int | None:
    """Resolve `tokenizer_config.json`'s `eos_token` etc. (a string or {"content": ...}) to an id."""
    token = tok_cfg.get(key)
    if isinstance(token, dict):
        token = token.get("content")
    if not token:
        return None
    vocab = json.loads(tokenizer_json.read_text())
    for added in vocab.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    return (
        vocab.get("model", {}).get("vocab", {}).get(token)
        if isinstance(vocab.get("model", {}).get("vocab"), dict)
        else None
    )


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    model_dir = resolve_model_dir(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelError(
            f"{model_dir}: no tokenizer.json; save the tokenizer beside the weights "
            "(tokenizer.save_pretrained(DIR) writes it)"
        )
    cfg = read_json(model_dir / "config.json")
    tok_cfg = read_json(model_dir / "tokenizer_config.json") if (model_dir / "tokenizer_config.json").is_file() else {}
    gen_cfg = (
        read_json(model_dir / "generation_config.json") if (model_dir / "generation_config.json").is_file() else {}
    )

    def ids(value) -> list[int]:
        return [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]

    # generation_config.json decides when generation stops (transformers' generate reads it);
    # the tokenizer's own EOS token is added so that a model whose generation config forgets it still stops.
    eos: list[int] = []
    for value in (gen_cfg.get("eos_token_id"), _special_id(tok_cfg, "eos_token", path), cfg.get("eos_token_id")):
        eos += [i for i in ids(value) if i not in eos]
    if not eos:
        raise ModelError(
            f"{model_dir}: no EOS token id in generation_config.json, tokenizer_config.json or config.json"
        )
    pad = next(
        (
            i
            for v in (gen_cfg.get("pad_token_id"), _special_id(tok_cfg, "pad_token", path), cfg.get("pad_token_id"))
            for i in ids(v)
        ),
        eos[0],
    )
    add_bos = tok_cfg.get("add_bos_token", cfg.get("model_type") == "llama" and cfg.get("bos_token_id") is not None)
    bos = (
        next(iter(ids(_special_id(tok_cfg, "bos_token", path)) + ids(cfg.get("bos_token_id"))), None)
        if add_bos
        else None
    )
    return Tokenizer(path, eos_ids=tuple(eos), pad_id=pad, bos_id=bos)
