"""Sequence tiling (dsfunc.tiling) against the same computation done whole: values and gradients, then a tiled
GPT trained by train_step at every ZeRO stage on two gloo ranks against the untiled model on one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dsfunc
from dsfunc.errors import InputError
from dsfunc.models import GPT, GPTConfig, init_weights
from dsfunc.tiling import tiled, tiled_loss, tiled_mlp, tiled_module
from tests.models import relative_diff
from tests.multiprocess import run_world


def grads_of(fn, tensors):
    for t in tensors:
        t.grad = None
    out = fn()
    (out.square().sum() if out.dim() else out * 3.0).backward()
    return out.detach(), [t.grad.clone() for t in tensors]


def close(a, b, tol=1e-5):
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("shards", [1, 3, 5, 40])  # even, uneven, more slices than tokens
def test_tiled_mlp_equals_the_whole_mlp_in_value_and_every_gradient(shards):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(3, 17, 8, requires_grad=True)
    tensors = [x, *mlp.parameters()]
    whole, whole_grads = grads_of(lambda: mlp(x), tensors)
    out, out_grads = grads_of(lambda: tiled_mlp(mlp, x, shards=shards), tensors)
    assert close(out, whole)
    for g, ref in zip(out_grads, whole_grads):
        assert close(g, ref)


def test_a_module_with_parameters_of_its_own_and_a_call_of_the_scripts():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)
    x = torch.randn(2, 9, 6, requires_grad=True)
    tensors = [x, lin.weight, lin.bias]
    whole, whole_grads = grads_of(lambda: torch.tanh(lin(x)), tensors)
    out, out_grads = grads_of(lambda: tiled_module(lin, x, 4, call=lambda m, h: torch.tanh(m(h))), tensors)
    assert close(out, whole)
    assert all(close(g, r) for g, r in zip(out_grads, whole_grads))


def test_weights_that_are_views_of_one_flat_buffer_get_their_gradient_through_it():
    """As ZeRO binds them: the gradient reaches the flat leaf through the views, once."""
    torch.manual_seed(0)
    flat = torch.randn(4 * 5 + 5, requires_grad=True)
    x = torch.randn(2, 7, 4, requires_grad=True)

    def fn(h, w, b):
        return torch.sigmoid(F.linear(h, w, b))

    def run(tile):
        w, b = flat[:20].view(5, 4), flat[20:]
        return tiled(fn, x, shards=3, weights=(w, b)) if tile else fn(x, w, b)

    whole, whole_grads = grads_of(lambda: run(False), [x, flat])
    out, out_grads = grads_of(lambda: run(True), [x, flat])
    assert close(out, whole) and all(close(g, r) for g, r in zip(out_grads, whole_grads))


def test_tiled_loss_sums_slices_and_gives_the_gradient_of_the_sum_times_the_incoming_one():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11)
    x = torch.randn(2, 13, 8, requires_grad=True)
    y = torch.randint(0, 11, (2, 13))

    def loss(h, t, w, b):
        return F.cross_entropy(F.linear(h, w, b).flatten(0, 1), t.flatten(), reduction="sum")

    tensors = [x, head.weight, head.bias]
    whole, whole_grads = grads_of(lambda: loss(x, y, head.weight, head.bias), tensors)
    out, out_grads = grads_of(lambda: tiled_loss(loss, x, y, shards=4, weights=(head.weight, head.bias)), tensors)
    assert close(out, whole)
    assert all(close(g, r) for g, r in zip(out_grads, whole_grads))  # grads_of scales the loss by 3


def test_tiled_loss_under_no_grad_takes_no_gradient():
    head = torch.nn.Linear(4, 5)
    x, y = torch.randn(1, 6, 4), torch.randint(0, 5, (1, 6))
    with torch.no_grad():
        out = tiled_loss(lambda h, t, w: F.cross_entropy(h @ w.T, t.flatten(), reduction="sum"),
                         x.flatten(0, 1), y.flatten(), shards=2, weights=(head.weight,), dim=0)
    assert not out.requires_grad and head.weight.grad is None


def test_bad_shards_and_inputs_of_different_lengths_are_refused():
    x = torch.randn(2, 6, 4)
    with pytest.raises(InputError, match="shards must be a positive int"):
        tiled(torch.tanh, x, shards=0)
    with pytest.raises(InputError, match="one length along dim 1"):
        tiled(torch.add, x, torch.randn(2, 5, 4), shards=2)
    with pytest.raises(InputError, match="scalar per slice"):
        tiled_loss(lambda h: h * 2, x.requires_grad_(), shards=2)


def gpt_config(stage: int, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2 // world,
        "train_batch_size": 4,
        # SGD with momentum is not scale-invariant, and the clip applies: a wrong gradient factor shows
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def train_gpt(rank: int, world: int, stage: int, mlp_shards: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=12, n_layer=2, n_head=2, d_model=8, mlp_shards=mlp_shards))
    model.apply(init_weights)
    state = dsfunc.init_state(model, gpt_config(stage, world))
    g = torch.Generator().manual_seed(1)
    n = 4 // world
    for _ in range(4):
        tokens = torch.randint(0, 32, (4, 13), generator=g)[rank * n:(rank + 1) * n]
        state = dsfunc.train_step(state, (tokens[:, :-1], tokens[:, 1:]))
    return dsfunc.full_params(state)


def test_a_tiled_gpt_trains_like_the_untiled_one_at_every_zero_stage_on_two_ranks():
    reference = train_gpt(0, 1, 0, 0)
    for stage in (0, 1, 2, 3):
        ranks = run_world(train_gpt, 2, stage, 5)
        for params in ranks:
            assert relative_diff(params, reference) < 1e-5, stage
    assert relative_diff(train_gpt(0, 1, 0, 5), reference) < 1e-5


def test_hf_llama_under_dsfunc_tiled_and_offloaded_has_the_untiled_models_loss_and_gradients(monkeypatch):
    """bench/long_hf.py's hf+dsfunc (ZeRO-3, optimizer offload, layers checkpointed to host memory, MLPs and the loss
    tiled) against the plain HF model's own loss and autograd gradients: one SGD step of lr 100 without clipping
    moves each parameter by 100 x its gradient."""
    transformers = pytest.importorskip("transformers")
    from bench import long_hf

    monkeypatch.setattr(long_hf, "LOSS_SLICE_BYTES", 8000)  # 100 tokens x vocab 97 x 4 B: 5 loss slices
    shape = dict(long_hf.SHAPES["llama-tiny"], vocab_size=97, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(long_hf.llama_config(shape, 100))
    tiled_model = copy.deepcopy(model)
    assert long_hf.tile_mlps(tiled_model) == 2  # 100 tokens, width 32: 4 slices each
    ids = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.masked_fill(torch.arange(100) < 7, -100)}  # a prompt without loss
    loss = model(**batch).loss
    loss.backward()
    lr = 100.0
    config = long_hf.dsfunc_config(set(), optimizer={"type": "SGD", "params": {"lr": lr}}, clip=0.0, bf16=False)
    state = dsfunc.init_state(tiled_model, config, loss_fn=long_hf.tiled_causal_lm_loss, device="cpu")
    state = dsfunc.train_step(state, batch)
    assert close(state.metrics.loss, loss.detach(), tol=1e-6)
    for name, value in dsfunc.full_params(state).items():
        p = model.get_parameter(name)
        assert close((p.detach() - value) / lr, p.grad, tol=1e-5), name


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements of any tensor an op makes while the mode is on."""

    def __init__(self):
        super().__init__()
        self.numel, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.shape = t.numel(), tuple(t.shape)
        return out


@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "padding mask"])
def test_no_sequence_squared_tensor_in_the_hf_llama_step(padded):
    """hf+dsfunc's model and loss (SDPA, no attention mask, HF's default position ids) make no tensor of more than
    seq x max(width, vocab) elements in forward and backward; a padding mask, which HF turns into a seq x seq one, is
    seen (what the check would catch)."""
    transformers = pytest.importorskip("transformers")
    from bench import long_hf

    seq, shape = 1024, long_hf.SHAPES["llama-tiny"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(long_hf.llama_config(shape, seq))
    long_hf.tile_mlps(model)
    batch = long_hf.tokens(shape["vocab_size"], seq, torch.device("cpu"))
    if padded:
        batch["attention_mask"] = torch.ones_like(batch["input_ids"]).index_fill_(1, torch.tensor([seq - 1]), 0)
    with LargestTensor() as largest:
        if padded:
            model(**batch).loss.backward()
        else:
            long_hf.tiled_causal_lm_loss(model, batch).backward()
    bound = seq * max(shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"])
    assert (largest.numel >= seq * seq) if padded else (largest.numel <= bound), largest.shape
