"""Weight sync from the learners to the rollout workers: versioned, and checked tensor by tensor.

The learners send their weights once per RL step through Ray's object store, in the rollout
precision when the two engines share a precision (half the bytes of FP32 in FP16/BF16) and in
FP32 when they differ (the worker's π_old scorer then needs the trainer's master weights).
A `SyncManifest` travels separately from the tensors, with a checksum of every tensor as
each of the worker's two copies must hold it: the rollout engine's (rollout precision,
fused projections) and the scorer's (wire precision). The worker checks both copies after
loading; a difference stops the run and names the tensor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from parity.engines import precision as prec


class SyncError(RuntimeError):
    """A worker's loaded weights differ from what the learners sent."""


@dataclass(frozen=True)
class SyncManifest:
    version: int  # the policy version: RL steps the learners have trained
    wire_dtype: str  # the dtype of the tensors in the object store
    engine: dict[str, str]  # name -> checksum of the tensor in the rollout precision
    scorer: dict[str, str]  # name -> checksum in the wire dtype
    bytes: int


def checksum(t: torch.Tensor) -> str:
    """BLAKE2b of a tensor's bytes (any dtype; contiguous copy when needed)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def wire_dtype(rollout_precision: str, trainer_precision: str) -> torch.dtype:
    if rollout_precision == trainer_precision:
        return prec.to_dtype(rollout_precision)
    return torch.float32


def pack_weights(
    state: dict[str, torch.Tensor], version: int, rollout_precision: str, trainer_precision: str
) -> tuple[dict[str, torch.Tensor], SyncManifest]:
    """The tensors to send (FP32 master `state` cast to the wire dtype) and their manifest."""
    wire = wire_dtype(rollout_precision, trainer_precision)
    roll = prec.to_dtype(rollout_precision)
    tensors = {k: v.to(wire).contiguous() for k, v in state.items()}
    scorer = {k: checksum(v) for k, v in tensors.items()}
    engine = scorer if wire == roll else {k: checksum(v.to(roll)) for k, v in tensors.items()}
    size = sum(v.numel() * v.element_size() for v in tensors.values())
    return tensors, SyncManifest(version, str(wire).removeprefix("torch."), engine, scorer, size)


def verify(loaded: dict[str, torch.Tensor], expected: dict[str, str], where: str, version: int) -> None:
    """Raise SyncError naming the first tensor in `loaded` whose checksum is not `expected`'s."""
    for name, want in expected.items():
        if name not in loaded:
            raise SyncError(f"weight sync v{version}: {where} holds no {name}")
        got = checksum(loaded[name])
        if got != want:
            raise SyncError(
                f"weight sync v{version}: {name} in {where} does not match the learners' checksum "
                f"({got[:12]} loaded, {want[:12]} sent)"
            )
