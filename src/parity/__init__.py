"""Parity: RL fine-tuning of language models in which the policy that is trained is the policy that samples."""

__version__ = "0.1.0"
