"""The two engines on one model, for the tests that compare them: the rollout engine beside the model it was
loaded from, random prompts, the trainer's π of a batch's tokens, and an episode's `between` (`Turns`) (for
tests/unit/test_exact.py and the tests of episodes, kernels, architectures and the GPU engines)."""

from __future__ import annotations

import torch

from parity.engines import kernels
from parity.engines import precision as prec
from parity.engines.models.io import export_state, load_model, resolve_model_dir
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer
from parity.engines.trainer import sequence_logprobs

PLAIN = SamplingParams(max_new_tokens=20)
FILTERED = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=20)
FED = [5, 6, 1, 7]  # holds id 1, the built-in model's end-of-turn: a fed id never ends a turn


def engines(model_dir, precision: str, exact: bool = True):
    model = load_model(model_dir, kernels.numerics(exact=exact))
    tok = load_tokenizer(resolve_model_dir(model_dir))
    engine = RolloutEngine(model.config, precision, tok.eos_ids, tok.pad_id, model.numerics)
    engine.weights.load(export_state(model), version=0)
    return model, engine


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of 1 to 12 tokens (ids above the special ones)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]


def trainer_logprobs(model, batch, precision: str, micro_batch: int) -> torch.Tensor:
    """π of the batch's tokens from the trainer's code path, in micro-batches of `micro_batch` rows."""
    parts = []
    with torch.no_grad():
        for rows in torch.arange(len(batch.prompt_ids)).split(micro_batch):
            support = None if batch.support is None else batch.support[rows]
            parts.append(
                sequence_logprobs(
                    model,
                    [batch.prompt_ids[i] for i in rows.tolist()],
                    batch.response_ids[rows],
                    batch.response_mask[rows],
                    support,
                    batch.sampling.temperature,
                    prec.to_dtype(precision),
                )[1]
            )
    return torch.cat(parts)


class Turns:
    """Feeds FED after each turn, `turns` turns in all, each at most `limit` tokens; records what it saw."""

    def __init__(self, turns: int, limit: int = 24):
        self.turns, self.limit = turns, limit
        self.ended: dict[int, int] = {}
        self.seen: list[tuple[int, list[int], int]] = []

    def __call__(self, rows, tokens, rooms):
        out = {}
        for row, ids, room in zip(rows, tokens, rooms):
            self.seen.append((row, ids, room))
            self.ended[row] = self.ended.get(row, 0) + 1
            if self.ended[row] < self.turns and len(FED) + 1 < room:
                out[row] = (FED, self.limit)
        return out
