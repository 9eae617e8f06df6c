"""Ulysses' pieces: the sequence split, DeepSpeed's DistributedAttention and data-loader adapter on 2 ranks against
one process's attention, and the errors for heads, key/value heads and sequences that do not split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dsfunc
from dsfunc.errors import InputError
from dsfunc.parallel.sequence import shift_labels, split_sequence
from tests.multiprocess import run_world
from tests.parallel.ulysses_setup import ADAMW, config, llama

pytest.importorskip("transformers")


def test_labels_are_shifted_before_the_split():
    batch = {"input_ids": torch.tensor([[1, 10, 10, 10, 2, 2]]), "labels": torch.tensor([[1, 10, 10, 10, 2, 2]])}
    first, second = (split_sequence(batch, r, 2) for r in (0, 1))
    assert first["input_ids"].tolist() == [[1, 10, 10]] and second["input_ids"].tolist() == [[10, 2, 2]]
    assert first["shift_labels"].tolist() == [[10, 10, 10]] and second["shift_labels"].tolist() == [[2, 2, -100]]
    assert first["position_ids"].tolist() == [[0, 1, 2]] and second["position_ids"].tolist() == [[3, 4, 5]]
    assert "labels" not in first
    assert shift_labels(torch.tensor([[5, 6, -100]])).tolist() == [[6, -100, -100]]


def test_a_sequence_that_does_not_split_is_refused():
    batch = {"input_ids": torch.zeros(1, 5, dtype=torch.long), "labels": torch.zeros(1, 5, dtype=torch.long)}
    with pytest.raises(InputError, match="5 tokens does not split over sequence_parallel_size 2"):
        split_sequence(batch, 0, 2)
    with pytest.raises(InputError, match="ignores attention_mask"):
        split_sequence({**batch, "input_ids": torch.zeros(1, 4, dtype=torch.long),
                        "labels": torch.zeros(1, 4, dtype=torch.long),
                        "attention_mask": torch.tensor([[1, 1, 1, 0]])}, 0, 2)


def _attention(q, k, v):
    """[batch, seq, heads, d] -> the same, causal."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def _distributed_attention(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from dsfunc.sequence.layer import DistributedAttention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 4, 3, requires_grad=True) for _ in range(3))
    weight = torch.randn(2, 8, 4, 3)
    want = _attention(q, k, v)
    (want * weight).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    mine = [t.detach()[:, rank * 4:(rank + 1) * 4].clone().requires_grad_() for t in (q, k, v)]
    layer = DistributedAttention(_attention, dist.group.WORLD)
    out = layer(*mine, batch_dim_idx=0)
    (out * weight[:, rank * 4:(rank + 1) * 4]).sum().backward()
    seq_first = [t.detach().transpose(0, 1).contiguous() for t in mine]  # [seq, batch, heads, d]
    out_seq_first = DistributedAttention(lambda *a: _attention(*(t.transpose(0, 1) for t in a)).transpose(0, 1),
                                         dist.group.WORLD)(*seq_first, batch_dim_idx=1)
    return {"out": (out - want[:, rank * 4:(rank + 1) * 4]).abs().max().item(),
            "seq_first": (out_seq_first.transpose(0, 1) - out).abs().max().item(),
            "grads": max((t.grad - g[:, rank * 4:(rank + 1) * 4]).abs().max().item() for t, g in zip(mine, grads))}


def _adapter(rank: int, world: int) -> list:
    import torch.distributed as dist
    from dsfunc.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    ids = torch.tensor([[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]])[rank:rank + 1]
    loader = [{"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(6)[None]}]
    return [{k: v.tolist() for k, v in shard.items()}
            for shard in UlyssesSPDataLoaderAdapter(loader, rank, dist.group.WORLD, world, "cpu")]


def _errors(rank: int, world: int) -> dict[str, str]:
    def message(fn) -> str:
        try:
            fn()
        except InputError as e:
            return str(e)
        return "no error"

    out = {"heads": message(lambda: dsfunc.init_state(llama(heads=3, kv_heads=1, hidden=36), config(ADAMW, sp=2))),
           "kv_heads": message(lambda: dsfunc.init_state(llama(heads=6, kv_heads=3, hidden=36), config(ADAMW, sp=2)))}
    eager = llama()
    eager.config._attn_implementation = "eager"
    out["eager"] = message(lambda: dsfunc.init_state(eager, config(ADAMW, sp=2)))
    state = dsfunc.init_state(llama(), config(ADAMW, sp=2, gas=1))
    ids = torch.zeros(2, 15, dtype=torch.long)
    out["sequence"] = message(lambda: dsfunc.train_step(state, {"input_ids": ids, "labels": ids}, donate=False))
    return out


def test_distributed_attention_is_one_process_attention():
    for result in run_world(_distributed_attention, 2):
        assert result["out"] < 1e-6 and result["seq_first"] < 1e-6 and result["grads"] < 1e-6, result


def test_data_loader_adapter_gives_each_rank_its_shard_of_every_batch():
    first, second = run_world(_adapter, 2)
    assert first == [{"input_ids": [[1, 10, 10]], "position_ids": [[0, 1, 2]], "shift_labels": [[10, 10, 10]]},
                     {"input_ids": [[1, 20, 20]], "position_ids": [[0, 1, 2]], "shift_labels": [[20, 20, 20]]}]
    assert second == [{"input_ids": [[10, 2, 2]], "position_ids": [[3, 4, 5]], "shift_labels": [[2, 2, -100]]},
                      {"input_ids": [[20, 2, 2]], "position_ids": [[3, 4, 5]], "shift_labels": [[2, 2, -100]]}]


def test_heads_kv_heads_and_sequences_that_do_not_split_are_clear_errors():
    for errors in run_world(_errors, 2):
        assert "3 attention heads do not divide by 2" in errors["heads"], errors
        assert "3 key/value heads and sequence_parallel_size 2" in errors["kv_heads"], errors
        assert 'attn_implementation "eager"' in errors["eager"], errors
        assert "15 tokens does not split over sequence_parallel_size 2" in errors["sequence"], errors
