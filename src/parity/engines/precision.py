"""The precisions, by their config names, with their properties; the dynamic loss scaler.

The kernels that give each precision its numerics are in `engines.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch


class Precision(StrEnum):
    """A precision as configs name it (a `str`: it compares, prints and serialises as its name)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.value]

    @property
    def loss_scaled(self) -> bool:
        """Training in it needs the dynamic loss scale: FP16's range underflows small gradients."""
        return self is Precision.FP16

    @classmethod
    def named(cls, name: str) -> Precision:
        """The precision called `name`; ValueError naming the choices for any other."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown precision {name!r}; expected one of {', '.join(PRECISIONS)}") from None


PRECISIONS = tuple(p.value for p in Precision)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# FP16 range, used by the doctor and by the loss scaler's docs.
FP16_MAX = 65504.0
FP16_MIN_NORMAL = 6.103515625e-05


def to_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a precision name (`fp32`, `bf16`, `fp16`)."""
    return Precision.named(precision).dtype


@dataclass
class LossScaleState:
    scale: float
    clean_steps: int = 0
    skipped_steps: int = 0


class DynamicLossScaler:
    """Dynamic loss scaling for FP16 training (docs/design.md, "Precision semantics").

    Start at `init_scale`; after `growth_interval` consecutive clean steps double the
    scale; on any inf/NaN gradient halve it and skip the optimizer step. With
    `enabled=False` (BF16/FP32) the scale stays 1; a non-finite gradient still
    skips the step and is counted.
    """

    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_interval: int = 200,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
    ) -> None:
        self.enabled = enabled
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.min_scale = min_scale
        self.state = LossScaleState(scale=init_scale if enabled else 1.0)

    @property
    def scale(self) -> float:
        return self.state.scale

    @property
    def skipped_steps(self) -> int:
        return self.state.skipped_steps

    def unscale(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """Divide gradients by the scale in place; return their global L2 norm (a 0-d
        tensor, inf/NaN when any gradient is not finite)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        if self.enabled and self.state.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.state.scale)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def update(self, finite: bool) -> None:
        """Advance the scaler after a step; `finite`: the norm `unscale` returned is finite."""
        if not finite:
            self.state.skipped_steps += 1
        if not self.enabled:
            return
        if finite:
            self.state.clean_steps += 1
            if self.state.clean_steps >= self.growth_interval:
                self.state.scale *= self.growth_factor
                self.state.clean_steps = 0
        else:
            self.state.clean_steps = 0
            self.state.scale = max(self.state.scale * self.backoff_factor, self.min_scale)

    def state_dict(self) -> dict[str, float]:
        return {
            "scale": self.state.scale,
            "clean_steps": self.state.clean_steps,
            "skipped_steps": self.state.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.state = LossScaleState(
            scale=float(state["scale"]),
            clean_steps=int(state["clean_steps"]),
            skipped_steps=int(state["skipped_steps"]),
        )
