"""An environment for partial rollouts of episodes: the built-in tool task, answered once or twice, so that
a batch's episodes take different numbers of turns (`tests/e2e/test_partial_rollouts.py`). A file of
its own, which a rollout worker imports by its path (task.environment=rounds.py:Rounds)."""

from __future__ import annotations

from parity.rl.episodes import LookupEnvironment, Step


class Rounds(LookupEnvironment):
    """The built-in tool task, answered `rounds` times (a data column; else three times for the keys a, c,
    e, ..., once for the others): once the model has answered, the tool's last answer comes again, until it
    has answered `rounds` times."""

    def reset(self, row):
        self.left = row.get("rounds", 1 + 2 * (ord(row["key"]) % 2))
        self.last: list = []
        return super().reset(row)

    def step(self, assistant):
        step = super().step(assistant)
        if not step.done:
            self.last = step.messages
            return step
        self.left -= 1
        return Step(self.last) if self.left > 0 and self.last else step
