"""A GPT-2 style decoder: the benchmark workload of BENCH.md, and the model of the examples.

Pre-LayerNorm blocks, fused QKV projection, GELU(tanh) MLP of width 4d, causal
``scaled_dot_product_attention``, learned position embeddings and a tied input/output embedding.
Only standard modules own parameters, so the model can be built on ``meta`` and materialised by
dsfunc one module at a time (``init_weights`` is the N(0, 0.02) initialisation of the benchmark).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from dsfunc.kernels.cross_entropy import linear_cross_entropy
from dsfunc.tiling import tiled


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    seq_len: int = 1024
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    dropout: float = 0.0
    # the loss through dsfunc.kernels.linear_cross_entropy (output projection and cross-entropy in chunks, no
    # fp32 logits) instead of F.cross_entropy over the logits (nanoGPT's way, the benchmark's baseline)
    fused_loss: bool = False
    # the MLP a slice of the sequence at a time (dsfunc.tiling: ALST's TiledMLP), so its 4d-wide activations are
    # one slice's; 0 computes it whole
    mlp_shards: int = 0

    @classmethod
    def preset(cls, name: str, **changes) -> GPTConfig:
        """The benchmark sizes: "124m", "1.3b", "6.7b"."""
        sizes = {"124m": (12, 12, 768), "1.3b": (24, 16, 2048), "6.7b": (32, 32, 4096)}
        n_layer, n_head, d_model = sizes[name]
        return cls(n_layer=n_layer, n_head=n_head, d_model=d_model, **changes)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.mlp_shards = cfg.mlp_shards
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        weights = (self.fc.weight, self.fc.bias, self.out.weight, self.out.bias)
        if self.mlp_shards:
            return x + self.drop(tiled(_mlp, self.ln2(x), shards=self.mlp_shards, weights=weights))
        return x + self.drop(_mlp(self.ln2(x), *weights))


def _mlp(x: torch.Tensor, fc_w: torch.Tensor, fc_b: torch.Tensor, out_w: torch.Tensor,
         out_b: torch.Tensor) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, fc_w, fc_b), approximate="tanh"), out_w, out_b)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied input/output embedding

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when ``targets`` are given."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None and self.cfg.fused_loss:
            return linear_cross_entropy(x, self.head.weight, targets)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def flops_per_token(self) -> float:
        """Training FLOPs per token, BENCH.md's count (nanoGPT's and PaLM's): ``6 N + 12 L d T``, where N is
        every parameter but the position embedding, the tied token embedding once (it is also the output
        projection, whose matmul is real work)."""
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return 6 * n + 12 * self.cfg.n_layer * self.cfg.d_model * self.cfg.seq_len

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() - self.wte.weight.numel() if non_embedding else n


def init_weights(module: nn.Module) -> None:
    """The benchmark's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
