"""An environment for partial rollouts of episodes: the built-in tool task, one or two questions in a row,
so that a batch's episodes take different numbers of turns (`tests/e2e/test_partial_rollouts.py`). A file of
its own, which a rollout worker imports by its path (task.environment=rounds.py:Rounds)."""

from __future__ import annotations

from parity.rl.episodes import LookupEnvironment, Step


class Rounds(LookupEnvironment):
    """The built-in tool task, `rounds` questions in a row (a data column; else two for the keys b, d, f, ...,
    one for the others): once the model has answered one, the next key is asked."""

    def reset(self, row):
        self.key = row["key"]
        self.left = row.get("rounds", 1 + ord(self.key) % 2)
        return super().reset(row)

    def step(self, assistant):
        step = super().step(assistant)
        self.left -= step.done
        if step.done and self.left > 0:
            self.key = chr((ord(self.key) - ord("a") + 5) % 16 + ord("a"))
            return Step([{"role": "user", "content": f"{self.key}?"}])
        return step
