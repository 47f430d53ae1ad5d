"""What a batch of rollouts costs in memory, checked against the machine before the engine allocates it.

The rollout engine samples every row of a call at once: its KV cache holds every row's keys and values for
every position it reaches, and each decode step holds a few vocabulary-wide rows of logits per row. A
setting such as `rollout.group_size=10**9` passes every range check and is then killed by the kernel for
memory; `check_rollout_memory` refuses it in one line instead, naming the keys that set the size.
"""

from __future__ import annotations

import torch

from parity.config import ConfigError
from parity.engines.models.config import ModelConfig

# Vocabulary-wide rows of FP32 per sampled row in a decode step: the logits, the filtered logits, their
# log-softmax and its exponential (what `sampling.filter_logits` and the sampler hold at once).
LOGIT_ROWS = 4
# Per row and new token, the outputs kept (token id, log-prob, mask) and the trainer's scores of them.
BYTES_PER_NEW_TOKEN = 8 + 4 + 1 + 3 * 4


def rollout_bytes(model: ModelConfig, rows: int, prompt_tokens: int, new_tokens: int, full_vocab: int = 0) -> int:
    """Bytes the rollout engine allocates for `rows` rows of up to `prompt_tokens` + `new_tokens` positions
    (keys and values stored in FP32, as on the CPU), `full_vocab` recorded distributions included."""
    kv = 2 * model.num_layers * model.num_kv_heads * model.head_dim * (prompt_tokens + new_tokens) * 4
    per_row = kv + LOGIT_ROWS * model.vocab_size * 4 + new_tokens * BYTES_PER_NEW_TOKEN
    return rows * per_row + full_vocab * model.vocab_size * 4


def available_bytes(device: str) -> int:
    """Memory free for new allocations where the engine runs: the GPU's, or the host's."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    import psutil

    return psutil.virtual_memory().available


def check_rollout_memory(
    model: ModelConfig, rows: int, prompt_tokens: int, new_tokens: int, keys: str, device: str, full_vocab: int = 0
) -> None:
    """Refuse a rollout batch that cannot fit in the memory free now; `keys` names the settings that size it."""
    need, free = rollout_bytes(model, rows, prompt_tokens, new_tokens, full_vocab), available_bytes(device)
    if need > free:
        raise ConfigError(
            f"{keys}: {rows:,} rows of up to {prompt_tokens + new_tokens:,} tokens need about {need / 2**30:,.1f} GiB "
            f"for the rollout engine, and {free / 2**30:,.1f} GiB is free on {device}; lower them"
        )
