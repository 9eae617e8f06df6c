"""Small reference models used by the examples, benchmarks and tests."""

from dsfunc.models.gpt import GPT, GPTConfig, init_weights

__all__ = ["GPT", "GPTConfig", "init_weights"]
