"""`trainer.lr_schedule` and `trainer.warmup_steps` give, step for step, the learning rate transformers'
schedulers give a TRL run of the same number of steps."""

from __future__ import annotations

import pytest
import torch
import transformers

from parity.engines.trainer import scheduled_lr
from parity.rl.train_config import TrainConfig

# Parity's schedule name -> transformers' scheduler, each taking (optimizer, warmup steps, total steps).
SCHEDULERS = {
    "constant": lambda opt, warmup, total: transformers.get_constant_schedule_with_warmup(opt, warmup),
    "linear": transformers.get_linear_schedule_with_warmup,
    "cosine": transformers.get_cosine_schedule_with_warmup,
}


def transformers_lrs(schedule: str, base: float, warmup: int, total: int) -> list[float]:
    """The learning rate of each of `total` optimizer steps under transformers' scheduler."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=base)
    scheduler = SCHEDULERS[schedule](optimizer, warmup, total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_every_schedule_parity_offers_is_compared():
    assert TrainConfig().trainer.lr_schedule == "constant"
    for schedule in SCHEDULERS:
        cfg = TrainConfig()
        cfg.trainer.lr_schedule = schedule
        cfg.validate()  # each name is one Parity takes
    cfg = TrainConfig()
    cfg.trainer.lr_schedule = "inverse_sqrt"
    with pytest.raises(Exception, match="trainer.lr_schedule"):
        cfg.validate()


@pytest.mark.parametrize("schedule", sorted(SCHEDULERS))
@pytest.mark.parametrize(("warmup", "total"), [(0, 7), (1, 7), (3, 10), (5, 5), (8, 6), (10, 50)])
def test_the_learning_rate_of_every_step_is_transformers(schedule, warmup, total):
    base = 3e-4
    ours = [scheduled_lr(base, schedule, warmup, step, total) for step in range(total)]
    theirs = transformers_lrs(schedule, base, warmup, total)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-12)
    if warmup:
        assert ours[0] == 0.0  # the first step of a warm-up does not move the weights, as in transformers
    assert ours[-1] > 0  # the last step still learns
