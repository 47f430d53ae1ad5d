"""Parity: RL fine-tuning of language models in which the policy that is trained is the policy that samples.

The Python API (`parity.train`, `parity.evaluate`, `parity.Reward`, ...: docs/your-task.md) is loaded on
first use, so that `import parity` and the CLI's start stay light.
"""

__version__ = "0.1.0"

_API = (
    "Callback",
    "CallbackError",
    "ConfigError",
    "DataError",
    "GRPOConfig",
    "Reward",
    "RewardError",
    "Step",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "evaluate",
    "push_to_hub",
    "train",
)
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from parity import api

        return getattr(api, name)
    raise AttributeError(f"module 'parity' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
