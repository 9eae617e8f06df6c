"""Small reference models used by the examples, benchmarks and tests, and the fused loss of Hugging Face causal LMs."""

from dsfunc.models.gpt import GPT, GPTConfig, init_weights
from dsfunc.models.hf import causal_lm_loss

__all__ = ["GPT", "GPTConfig", "causal_lm_loss", "init_weights"]
