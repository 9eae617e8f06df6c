"""The training data loader: sharding over ranks, epochs that reshuffle, resuming at a step, per-step batches."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DistributedSampler, IterableDataset, TensorDataset

import dsfunc
from dsfunc.data import DistributedLoader, batches
from tests.models import MLP, config


def indexed(n: int) -> TensorDataset:
    """Sample i is (i, [i, i]) so batches show which indices they hold."""
    ids = torch.arange(n)
    return TensorDataset(ids, torch.stack([ids, ids], dim=1))


def flat(batches: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(batches))


def ids_of(loader, epochs: int = 1) -> list[list[int]]:
    out = []
    for _ in range(epochs):
        out.extend(b[0].tolist() for b in loader)
    return out


def test_ranks_split_each_epoch_like_the_distributed_sampler():
    data = indexed(22)
    loaders = [DistributedLoader(data, 3, rank=r, world_size=2) for r in range(2)]
    assert [len(x) for x in loaders] == [4, 4]  # 11 samples per rank -> 3+3+3+2
    for epoch in range(2):
        seen = []
        for r, loader in enumerate(loaders):
            got = ids_of(loader)
            sampler = DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            assert flat(got) == list(sampler)
            assert [len(b) for b in got] == [3, 3, 3, 2]
            seen += flat(got)
        assert sorted(seen) == list(range(22))
        assert loaders[0].epoch == epoch + 1


def test_the_epoch_advances_so_the_order_changes():
    loader = DistributedLoader(indexed(16), 4, rank=0, world_size=1)
    first, second = ids_of(loader), ids_of(loader)
    assert sorted(flat(first)) == sorted(flat(second)) == list(range(16))
    assert first != second
    unshuffled = DistributedLoader(indexed(16), 4, rank=0, world_size=1, shuffle=False)
    assert flat(ids_of(unshuffled)) == list(range(16))


def test_drop_last_and_collate_fn():
    loader = DistributedLoader(indexed(10), 4, rank=0, world_size=1, drop_last=True,
                               collate_fn=lambda samples: [int(s[0]) for s in samples])
    assert len(loader) == 2
    got = list(loader)
    assert [len(b) for b in got] == [4, 4] and all(isinstance(i, int) for i in got[0])


@pytest.mark.parametrize("position", [0, 3, 5, 11])
def test_skip_to_resumes_with_exactly_the_same_batches(position):
    data = indexed(20)
    reference = DistributedLoader(data, 3, rank=1, world_size=2)  # 4 batches per epoch
    stream = [b[0].tolist() for b in itertools.islice(reference.stream(), 14)]
    resumed = DistributedLoader(data, 3, rank=1, world_size=2)
    resumed.skip_to(position)
    assert resumed.position == position
    rest = [b[0].tolist() for b in itertools.islice(resumed.stream(), 14 - position)]
    assert rest == stream[position:]


def test_breaking_out_keeps_the_position():
    loader = DistributedLoader(indexed(12), 2, rank=0, world_size=1)
    all_batches = [b[0].tolist() for b in DistributedLoader(indexed(12), 2, rank=0, world_size=1)]
    for i, b in enumerate(loader):
        if i == 1:
            break
    assert loader.position == 2
    assert [b[0].tolist() for b in loader] == all_batches[2:]
    assert loader.epoch == 1 and loader.offset == 0


def test_bad_inputs_say_what_to_do():
    with pytest.raises(TypeError, match="Training data must be a torch Dataset.*TensorDataset"):
        DistributedLoader([1, 2, 3], 2, rank=0, world_size=1)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(TypeError, match="IterableDataset.*map-style"):
        DistributedLoader(Stream(), 2, rank=0, world_size=1)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        DistributedLoader(indexed(4), 0, rank=0, world_size=1)
    loader = DistributedLoader(indexed(4), 2, rank=0, world_size=1)
    with pytest.raises(ValueError, match="skip_to needs a number of micro-batches >= 0"):
        loader.skip_to(-1)
    empty = DistributedLoader(indexed(1), 2, rank=0, world_size=1, drop_last=True)
    with pytest.raises(ValueError, match="no complete micro-batch"):
        next(empty.stream())


def test_batches_concatenate_the_engine_stream_and_resume_at_the_state_step():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 6), torch.randint(0, 4, (40,)))
    state = dsfunc.init_state(MLP(), config(micro=3, gas=2))
    micro = DistributedLoader(data, 3, rank=0, world_size=1, drop_last=True)
    stream = list(itertools.islice(micro.stream(), 12))
    got = list(batches(data, state, steps=6))
    for k, (x, y) in enumerate(got):
        assert x.shape == (6, 6)
        torch.testing.assert_close(x, torch.cat([stream[2 * k][0], stream[2 * k + 1][0]]), rtol=0, atol=0)
        torch.testing.assert_close(y, torch.cat([stream[2 * k][1], stream[2 * k + 1][1]]), rtol=0, atol=0)
    for batch in got[:2]:
        state = dsfunc.train_step(state, batch)
    x, _ = next(batches(data, state))  # starts at state.step = 2
    torch.testing.assert_close(x, got[2][0], rtol=0, atol=0)
    x, _ = next(batches(data, state, start_step=5))
    torch.testing.assert_close(x, got[5][0], rtol=0, atol=0)


def test_batches_with_non_tensor_samples_explain_the_collate_fn():
    state = dsfunc.init_state(MLP(), config(micro=2, gas=2))
    data = indexed(8)
    with pytest.raises(TypeError, match="make collate_fn return tensors only"):
        next(batches(data, state, collate_fn=lambda s: [int(x[0]) for x in s]))
