"""Small reference models used by the examples, benchmarks and tests."""

from dsfunc.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
