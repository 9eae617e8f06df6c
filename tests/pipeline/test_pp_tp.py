"""Pipeline stages whose layers are split over tensor-parallel ranks (``pipeline.stages`` with
``tensor_parallel.autotp_size``: a ``pp x dp x tp`` mesh) train like one process on the same global batch: losses
within 1e-5 (relative) and every parameter within 1e-5 after 4 clipped steps, for 2 stages x tp 2 on 4 ranks through
``init_state``/``train_step`` (SGD with momentum, ZeRO 0; also 4 interleaved stages with activation checkpointing)
and through DeepSpeed's ``PipelineModule`` and ``engine.train_batch`` (AdamW, ZeRO 1), and for 2 stages x dp 2 x tp
2 on 8 ranks (AdamW, ZeRO 1 and 3). The layers are attention + MLP blocks AutoTP splits by their projection names,
between a tied embedding and output head (replicated over tp, held by both stages: counted once in the norm). The
clipping thresholds lie inside the runs' gradient norms (measured: SGD 3.8 to 6.7 under 6.0, AdamW 5.1 to 6.7 under
6.0, and at dp 2 4.4 to 5.7 under 5.0), so some steps clip and others not, and a norm that counted the tied module
or a tp part twice (or missed a stage) would change the result; the norms themselves are compared too. A checkpoint
saved half way at pp 2 x tp 2 is the whole model: it loads into one process and the rest of the run there gives the
pipelined run's losses. fp16 overflows skip the same steps on every rank. Also the errors for a bad shape, and sp
refused in a pipeline.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import dsfunc
import dsfunc.parallel
from dsfunc.pipeline import LayerSpec, StageModule, TiedLayerSpec
from tests.multiprocess import run_world

VOCAB, DIM, HEADS, HIDDEN, SEQ, MICRO, GAS, STEPS = 16, 8, 2, 12, 5, 2, 2, 4
PIPE = {"stages": 2, "partition_method": "uniform"}
# 4 stages on 2 pipeline ranks (each rank two of them), every layer recomputed in backward
INTERLEAVED = {"stages": 4, "stages_per_rank": 2, "schedule": "Interleaved1F1B", "partition_method": "uniform",
               "activation_checkpoint_interval": 1}
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.3, "momentum": 0.9}}, "gradient_clipping": 6.0}
ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}, "gradient_clipping": 6.0}
FP16 = {"enabled": True, "initial_scale_power": 17, "hysteresis": 1}
ADAMW_DP2 = ADAMW | {"gradient_clipping": 5.0}  # twice the batch: smaller norms


class Block(nn.Module):
    """Causal self-attention and an MLP, each with a residual; ``q/k/v/o_proj`` and ``up/down_proj`` are the names
    AutoTP splits (column, then row). Heads are read from the projections' (local) width, as Hugging Face's are."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.num_attention_heads, self.head_dim = heads, dim // heads
        # no bias on the attention projections: a key's bias has no gradient (the softmax ignores it), so Adam would
        # turn its rounding noise into updates of either sign
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.up_proj, self.down_proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = (p(h).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        h = h + self.o_proj(attention)
        return h + self.down_proj(torch.tanh(self.up_proj(h)))


def head(embedding: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h @ embedding.weight.t()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def layers(*block: int) -> list[Any]:
    """Embedding, three blocks, the tied head: uniform over 2 stages, stage 0 holds two blocks, stage 1 one."""
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), *(LayerSpec(Block, *block) for _ in range(3)),
            TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head)]


def config(optimizer: dict[str, Any], *, tp: int = 1, zero: int = 0, gas: int = GAS, **extra: Any) -> dict[str, Any]:
    out = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": zero}, "steps_per_print": None, **optimizer} | extra
    return out | ({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {})


def micro_batches(step: int, replicas: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Step ``step``'s GAS micro-batches of each replica: ``[replica][micro] = (tokens, labels)``; two batches
    alternate, so that training lowers the loss."""
    g = torch.Generator().manual_seed(100 + step % 2)
    tokens = torch.randint(0, VOCAB, (replicas, GAS, MICRO, SEQ), generator=g)
    return [[(t, torch.roll(t, -1, dims=1)) for t in tokens[r]] for r in range(replicas)]


def _metrics(state: Any) -> tuple[float, float, tuple[int, float]]:
    """A step's loss, gradient norm, and whether it skipped the update with the loss scale after it."""
    m = state.metrics
    return float(m.loss), float(m.grad_norm), (int(m.skipped), float(m.loss_scale))


def _run(state: Any, replicas: int, train: Any, folder: str | None = None) -> dict[str, Any]:
    """STEPS steps of ``train(state, step)``; with ``folder``, a checkpoint there half way."""
    init, seen, saved = dsfunc.full_params(state), [], None
    for step in range(STEPS):
        if folder is not None and step == STEPS // 2:
            dsfunc.save_checkpoint(state, folder, tag="half")
            saved = dsfunc.full_params(state)
        state = train(state, step)
        seen.append(_metrics(state))
    losses, norms, skipped = (list(m) for m in zip(*seen))
    mesh = state.program.mesh
    where = dsfunc.parallel.placements(state)
    return {"init": init, "losses": losses, "norms": norms, "skipped": skipped, "final": dsfunc.full_params(state),
            "saved": saved,
            "groups": (dict(mesh.sizes), mesh.group("pp").ranks, mesh.group("dp").ranks, mesh.group("tp").ranks),
            "placements": {k: where.get(k) for k in ("tied_modules.embed.weight", "1.q_proj.weight",
                                                     "1.o_proj.weight")}}


def _functional(optimizer: dict[str, Any], zero: int, folder: str | None = None, mesh: Any = None,
                pipeline: dict[str, Any] = PIPE, **extra: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    state = dsfunc.init_state(layers(), config(optimizer, tp=2, zero=zero, **extra), loss_fn=loss_fn,
                              pipeline=pipeline, mesh=mesh)
    replicas, replica = state.program.mesh.size("dp"), state.program.mesh.group("dp").rank
    return _run(state, replicas, lambda s, step: dsfunc.train_step(s, micro_batches(step, replicas)[replica]), folder)


def _engine() -> dict[str, Any]:
    """DeepSpeed's spelling: a PipelineModule, the tp size in the config, ``engine.train_batch(iterator)``."""
    pipe = importlib.import_module("dsfunc.pipe")
    torch.manual_seed(0)
    model = pipe.PipelineModule(layers(), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    engine, *_ = dsfunc.initialize(model=model, config=config(ADAMW, tp=2, zero=1))

    def train(state: Any, step: int) -> Any:
        engine.train_batch(iter(micro_batches(step, 1)[0]))
        return engine.state

    out = _run(engine.state, 1, train)
    out["evaluated"] = float(engine.eval_batch(iter(micro_batches(0, 1)[0])))
    return out


def _error(build: Any) -> str:
    try:
        build()
    except (dsfunc.InputError, dsfunc.NotSupportedError) as e:
        return str(e)
    finally:
        torch.distributed.barrier()
    return "no error"


def _four_ranks(rank: int, world: int, folder: str) -> dict[str, Any]:
    out = {"sgd": _functional(SGD, 0, folder), "engine": _engine(),
           "interleaved": _functional(SGD, 0, pipeline=INTERLEAVED), "fp16": _functional(SGD, 0, fp16=FP16)}
    # the same mesh, given as torch's DeviceMesh
    out["given_mesh"] = _functional(SGD, 0, mesh=init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp")))
    build = functools.partial(dsfunc.init_state, loss_fn=loss_fn, pipeline=PIPE)
    tp_outermost = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))
    out["mesh_order"] = _error(lambda: build(layers(), config(SGD, tp=2), mesh=tp_outermost))
    out["heads"] = _error(lambda: build(layers(12, 3), config(SGD, tp=2)))  # 3 heads of 4 over tp 2
    out["features"] = _error(lambda: build(layers(DIM, HEADS, 5), config(SGD, tp=2)))  # 5 hidden features
    out["world"] = _error(lambda: build(layers(), config(SGD, tp=4)))  # pp 2 x tp 4 on 4 ranks
    out["sp"] = _error(lambda: build(layers(), config(SGD, sequence_parallel_size=2)))
    return out


def _eight_ranks(rank: int, world: int) -> dict[int, Any]:
    return {zero: _functional(ADAMW_DP2, zero) for zero in (1, 3)}


def one_process(init: dict[str, torch.Tensor], optimizer: dict[str, Any], replicas: int, **extra: Any) -> dict[str, Any]:
    """The reference: the same layers in one process, each step every replica's micro-batch i joined as one."""
    model = StageModule(layers(), partition_method="uniform")
    model.load_state_dict(init)
    state = dsfunc.init_state(model, config(optimizer, train_micro_batch_size_per_gpu=MICRO * replicas, **extra),
                              loss_fn=lambda m, b: loss_fn(m(b[0]), b[1]))
    seen = []
    for step in range(STEPS):
        parts = micro_batches(step, replicas)
        joined = [tuple(torch.cat([parts[r][i][j] for r in range(replicas)]) for j in (0, 1)) for i in range(GAS)]
        state = dsfunc.train_step(state, joined)
        seen.append(_metrics(state))
    losses, norms, skipped = (list(m) for m in zip(*seen))
    return {"losses": losses, "norms": norms, "skipped": skipped, "final": dsfunc.full_params(state)}


def assert_like_one_process(results: list[dict[str, Any]], optimizer: dict[str, Any], replicas: int) -> None:
    run = results[0]
    want = one_process(run["init"], optimizer, replicas)
    clip = optimizer["gradient_clipping"]
    assert min(want["norms"]) < clip < max(want["norms"]), want["norms"]  # some steps clip, others not
    assert want["losses"][-1] < want["losses"][0]
    for other in results:
        assert max(abs(a - b) / b for a, b in zip(other["losses"], want["losses"])) < 1e-5, (other["losses"], want)
        assert max(abs(a - b) / b for a, b in zip(other["norms"], want["norms"])) < 1e-5, (other["norms"], want)
        assert other["final"].keys() == want["final"].keys()
        for name, value in want["final"].items():
            assert other["final"][name].shape == value.shape, name
            assert (other["final"][name] - value).abs().max() < 1e-5, name
            assert torch.equal(other["init"][name], run["init"][name]), name  # every rank trains one model


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    folder = str(tmp_path_factory.mktemp("pp_tp") / "ckpt")
    return run_world(_four_ranks, 4, folder, timeout=900), folder


def test_two_stages_by_tp2_train_like_one_process(four_ranks):
    results, _ = four_ranks
    assert_like_one_process([r["sgd"] for r in results], SGD, 1)
    # pp outermost, tp innermost: stage 0 on ranks 0, 1 (its tp pair), each tp rank's pipeline its own
    assert [r["sgd"]["groups"] for r in results] == [
        ({"pp": 2, "dp": 1, "sp": 1, "tp": 2}, pipe, (rank,), tp)
        for rank, pipe, tp in ((0, (0, 2), (0, 1)), (1, (1, 3), (0, 1)), (2, (0, 2), (2, 3)), (3, (1, 3), (2, 3)))]
    where = results[0]["sgd"]["placements"]
    assert where["tied_modules.embed.weight"]["tp"] == "Replicate()"
    assert (where["1.q_proj.weight"]["tp"], where["1.o_proj.weight"]["tp"]) == ("Shard(dim=0)", "Shard(dim=1)")


def test_fp16_overflows_skip_the_same_steps_on_every_rank_as_in_one_process(four_ranks):
    """fp16 from a loss scale of 2**17: the first steps overflow and every rank skips them, as one process does, with
    the same loss scales; then the runs train alike (within fp16's rounding, 2e-2)."""
    results = [r["fp16"] for r in four_ranks[0]]
    want = one_process(results[0]["init"], SGD, 1, fp16=FP16)
    assert 0 < sum(skipped for skipped, _ in want["skipped"]) < STEPS, want["skipped"]  # some steps skip, not all
    for run in results:
        assert run["skipped"] == want["skipped"]
        assert max(abs(a - b) / b for a, b in zip(run["losses"], want["losses"])) < 2e-2, (run["losses"], want)
        assert all((run["final"][k] - v).abs().max() < 2e-2 for k, v in want["final"].items())
        assert any((run["final"][k] != run["init"][k]).any() for k in run["init"])


def test_interleaved_stages_with_activation_checkpointing_by_tp2_train_like_one_process(four_ranks):
    assert_like_one_process([r["interleaved"] for r in four_ranks[0]], SGD, 1)


def test_pipeline_module_with_autotp_trains_like_one_process_through_train_batch(four_ranks):
    results = [r["engine"] for r in four_ranks[0]]
    assert_like_one_process(results, ADAMW, 1)
    model = StageModule(layers(), partition_method="uniform")  # eval_batch: the mean loss of the trained model
    model.load_state_dict(results[0]["final"])
    with torch.no_grad():
        want = sum(float(loss_fn(model(x), y)) for x, y in micro_batches(0, 1)[0]) / GAS
    assert all(abs(r["evaluated"] - want) < 1e-5 * want for r in results), ([r["evaluated"] for r in results], want)


def test_a_mesh_given_as_a_device_mesh_trains_the_same(four_ranks):
    for r in four_ranks[0]:
        assert r["given_mesh"]["losses"] == r["sgd"]["losses"] and r["given_mesh"]["groups"] == r["sgd"]["groups"]
        assert all(torch.equal(v, r["sgd"]["final"][k]) for k, v in r["given_mesh"]["final"].items())
        assert "a pipeline's mesh has pp outermost" in r["mesh_order"], r["mesh_order"]


def test_a_pp_tp_checkpoint_is_the_whole_model_and_resumes_in_one_process(four_ranks):
    results, folder = four_ranks
    run = results[0]["sgd"]
    model = StageModule(layers(), partition_method="uniform")
    state = dsfunc.init_state(model, config(SGD), loss_fn=lambda m, b: loss_fn(m(b[0]), b[1]))
    state, _ = dsfunc.load_checkpoint(folder, state, tag="half")
    loaded = dsfunc.full_params(state)
    assert loaded.keys() == run["saved"].keys() and all(torch.equal(loaded[k], v) for k, v in run["saved"].items())
    for step in range(STEPS // 2, STEPS):  # the momentum came along: the rest of the run is the pipelined one's
        state = dsfunc.train_step(state, micro_batches(step, 1)[0])
        assert abs(float(state.metrics.loss) - run["losses"][step]) < 1e-5 * run["losses"][step]


def test_two_stages_by_dp2_by_tp2_at_zero_1_and_3_train_like_one_process():
    results = run_world(_eight_ranks, 8, timeout=1200)
    for zero in (1, 3):
        assert_like_one_process([r[zero] for r in results], ADAMW_DP2, 2)
    assert [r[1]["groups"][1:] for r in results[:4]] == [((0, 4), (0, 2), (0, 1)), ((1, 5), (1, 3), (0, 1)),
                                                      ((2, 6), (0, 2), (2, 3)), ((3, 7), (1, 3), (2, 3))]


def test_bad_shapes_are_named(four_ranks):
    for r in four_ranks[0]:
        assert "num_attention_heads (3) is not divisible by the 2 tensor-parallel ranks" in r["heads"], r["heads"]
        assert "has 5 rows along dim 0, not divisible by the 2 tensor-parallel ranks" in r["features"], r["features"]
        assert "world size 4 is not divisible by the mesh's tp 4 x sp 1 x pp 2 = 8" in r["world"], r["world"]
        assert "pipeline stages with sequence parallelism" in r["sp"] and "split each micro-batch" in r["sp"], r["sp"]
