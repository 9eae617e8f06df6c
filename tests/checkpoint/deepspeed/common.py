"""The model, data and configs of the DeepSpeed fixtures: ``make_fixtures.py`` trained them with DeepSpeed,
the tests resume them with dsfunc.

Every case is one DeepSpeed run: ``SAVE_AT`` steps from the same initial weights, saved with a client
state, then DeepSpeed's own resume of that checkpoint for ``RESUMED`` more steps, whose losses and fp32
master weights are the reference (``<case>/reference.pt``). The global batch of step ``s`` is
:func:`batch` ``(s)`` at every world size; rank r of W takes its r-th slice.
"""

from __future__ import annotations

import dataclasses
import tarfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

FIXTURES = Path(__file__).with_name("fixtures.tar.xz")
SAVE_AT, RESUMED, GLOBAL_BATCH, VOCAB = 3, 5, 8, 16
# a tiny random GPT-2 (no download): its DeepSpeed checkpoint is the Hugging Face export's fixture
GPT2 = {"vocab_size": 32, "n_positions": 8, "n_embd": 8, "n_layer": 2, "n_head": 2, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
GPT2_INPUT = torch.arange(12).reshape(2, 6) % 32
CLIENT = {"epoch": 3, "note": "saved at step 3", "order": [3, 1, 2], "tensor": torch.arange(4)}


class Net(nn.Module):
    """Tied embedding and head (one tensor, two names), four blocks (so five dsfunc units), a frozen
    parameter and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.frozen = nn.Parameter(torch.linspace(0.5, 1.5, 8), requires_grad=False)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 8))
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        nn.init.normal_(self.emb.weight, std=0.3)  # N(0, 1) would make the tied head's logits large

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)
        for block in self.blocks:
            h = h + block(h)
        h = h * self.frozen.to(h.dtype) + self.shift.to(h.dtype)  # DeepSpeed keeps both in fp32 under bf16
        return F.cross_entropy(self.head(h).float(), y)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step`` (0-based)."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, VOCAB, (GLOBAL_BATCH, 3), generator=g),
            torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=g))


def rank_slice(tensors: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    n = GLOBAL_BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in tensors)


@dataclasses.dataclass(frozen=True)
class Case:
    """One DeepSpeed run: its ZeRO stage, world size and precision (``grad_accum_fp32`` selects DeepSpeed's
    bf16 optimizer at stage 1)."""

    stage: int
    world: int
    precision: str
    grad_accum_fp32: bool = False
    scale_power: int = 12  # fp16: the initial loss scale is 2**scale_power

    @property
    def name(self) -> str:
        return (f"s{self.stage}_w{self.world}_{self.precision}" + ("_fp32accum" if self.grad_accum_fp32 else "")
                + (f"_scale{self.scale_power}" if self.scale_power != 12 else ""))

    def config(self, world: int | None = None, stage: int | None = None) -> dict:
        """The DeepSpeed config of the run; with ``world``/``stage``, the same for dsfunc at those."""
        world = self.world if world is None else world
        cfg = {
            "train_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR",
                          "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
            "zero_optimization": {"stage": self.stage if stage is None else stage},
        }
        if self.precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        if self.precision == "fp16":
            # DeepSpeed unscales a step's gradients by the scale *after* that step's update, so a step on
            # which the scale grows sees halved gradients (stage_1_and_2.py step(): _update_scale before
            # unscale_and_clip_grads); dsfunc does not copy that. The window is long enough that the scale
            # never grows in these runs. 2**18 makes the three steps before the save overflow: the checkpoint
            # has no Adam state yet, the hysteresis is used up and the scale halved twice.
            cfg["fp16"] = {"enabled": True, "initial_scale_power": self.scale_power, "loss_scale_window": 100,
                           "hysteresis": 2}
        if self.grad_accum_fp32:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        return cfg


MATRIX = tuple(Case(stage, world, precision) for precision in ("fp32", "bf16") for world in (1, 2)
               for stage in range(4))
EXTRA = (Case(2, 2, "fp16"), Case(0, 1, "fp16"), Case(2, 1, "fp16", scale_power=18),
         Case(1, 2, "bf16", grad_accum_fp32=True))
CASES = MATRIX + EXTRA


def extract(root: Path) -> Path:
    """Unpack the fixtures into ``root``; ``root/<case>/`` is a DeepSpeed ``save_dir``."""
    with tarfile.open(FIXTURES) as tar:
        tar.extractall(root, filter="data")
    return root
