"""DeepSpeed's namespace under dsfunc: what scripts import at top level exists; what dsfunc implements works,
what it does not raises at the call naming the feature; accelerator and comm as scripts use them."""

from __future__ import annotations

import importlib

import pytest
import torch

import dsfunc
import dsfunc as deepspeed
from dsfunc.errors import NotSupportedError
from tests.multiprocess import run_world

# what DeepSpeed's examples, DeepSpeed-Chat, HelloDeepSpeed and Hugging Face scripts import at top level
IMPORTS = [
    ("accelerator", "get_accelerator"),
    ("accelerator.real_accelerator", "get_accelerator"),
    ("comm", "get_rank"),
    ("comm.comm", "init_distributed"),
    ("ops.adam", "FusedAdam"),
    ("ops.adam", "DeepSpeedCPUAdam"),
    ("ops.lamb", "FusedLamb"),
    ("utils", "RepeatingLoader"),
    ("utils", "safe_get_full_fp32_param"),
    ("utils", "log_dist"),
    ("utils", "logger"),
    ("utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint"),
    ("runtime.utils", "set_random_seed"),
    ("runtime.utils", "see_memory_usage"),
    ("runtime.dataloader", "RepeatingLoader"),
    ("runtime.engine", "DeepSpeedEngine"),
    ("runtime.zero.partition_parameters", "ZeroParamStatus"),
    ("runtime.zero.partition_parameters", "GatheredParameters"),
    ("runtime.zero.stage3", "estimate_zero3_model_states_mem_needs_all_live"),
    ("runtime.lr_schedules", "WarmupLR"),
    ("runtime.pipe.topology", "PipeModelDataParallelTopology"),
    ("runtime.activation_checkpointing.checkpointing", "checkpoint"),
    ("moe.utils", "split_params_into_different_moe_groups_for_optimizer"),
    ("moe.layer", "MoE"),
    ("compression.helper", "recursive_getattr"),
    ("compression.compress", "init_compression"),
    ("pipe", "PipelineModule"),
    ("pipe", "LayerSpec"),
    ("profiling.flops_profiler", "get_model_profile"),
    ("module_inject", "replace_transformer_layer"),
    ("inference.config", "DeepSpeedInferenceConfig"),
    ("checkpointing", "checkpoint"),
    ("checkpoint.utils", "get_model_ckpt_name_for_rank"),
]
UNSUPPORTED = {"estimate_zero3_model_states_mem_needs_all_live",
               "PipeModelDataParallelTopology", "init_compression",
               "replace_transformer_layer",
               "DeepSpeedInferenceConfig", "get_model_ckpt_name_for_rank"}


@pytest.mark.parametrize("module, name", IMPORTS)
def test_what_scripts_import_from_deepspeed_imports(module, name):
    obj = getattr(importlib.import_module(f"dsfunc.{module}"), name)
    top = module.partition(".")[0]
    assert getattr(deepspeed, top) is importlib.import_module(f"dsfunc.{top}")  # deepspeed.<package> works too
    if name in UNSUPPORTED:
        with pytest.raises(NotSupportedError, match=f"{name} .*is not implemented by dsfunc"):
            obj()
        assert not isinstance(object(), obj)  # stand-ins are classes: isinstance checks are False


def test_top_level_names_of_deepspeed():
    assert deepspeed.DeepSpeedEngine is deepspeed.Engine and deepspeed.get_accelerator().device_name() == "cpu"
    assert deepspeed.zero.Init is dsfunc.zero.Init and deepspeed.comm is importlib.import_module("dsfunc.comm")
    with pytest.raises(NotSupportedError, match="DeepSpeed inference"):
        deepspeed.init_inference(torch.nn.Linear(2, 2))
    with pytest.raises(AttributeError, match="has no attribute 'not_a_deepspeed_module'"):
        deepspeed.not_a_deepspeed_module  # noqa: B018


def test_the_cpu_accelerator():
    acc = deepspeed.accelerator.get_accelerator()
    assert (acc.device_name(), acc.device_name(0), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.is_available() and acc.device_count() >= 1 and acc.communication_backend_name() == "gloo"
    acc.set_device(0)
    acc.synchronize()
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    assert 0 < acc.memory_allocated() <= acc.max_memory_allocated()
    acc.manual_seed(3)
    first = torch.rand(2)
    acc.manual_seed(3)
    assert torch.equal(torch.rand(2), first)
    assert acc.is_bf16_supported() and acc.on_accelerator(torch.zeros(1))
    with acc.stream(acc.Stream()):
        event = acc.Event(enable_timing=True)
        event.record()
    assert event.query() and acc.FloatTensor([1.0]).dtype == torch.float32
    with pytest.raises(NotSupportedError, match="op builders"):
        acc.create_op_builder("FusedAdamBuilder")


def test_comm_in_a_lone_process_and_the_utils():
    dist = deepspeed.comm
    assert (dist.get_rank(), dist.get_world_size(), dist.is_initialized()) == (0, 1, False)
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    out = [torch.zeros(2)]
    dist.all_gather(out, t)
    dist.barrier()
    assert t.tolist() == [1.0, 1.0] and out[0].tolist() == [1.0, 1.0]
    loader = deepspeed.utils.RepeatingLoader([1, 2])
    assert [next(loader) for _ in range(5)] == [1, 2, 1, 2, 1]
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    deepspeed.compression.helper.recursive_setattr(net, "0", torch.nn.Identity())
    assert isinstance(deepspeed.compression.helper.recursive_getattr(net, "0"), torch.nn.Identity)
    groups = [{"params": list(net.parameters())}]
    assert deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(groups) == groups
    with deepspeed.utils.OnDevice(dtype=torch.float16, device="meta"):
        built = torch.nn.Linear(2, 2)
    assert built.weight.is_meta and built.weight.dtype == torch.float16 and torch.get_default_dtype() == torch.float32


def _comm_ranks(rank: int, world: int) -> dict:
    dist = deepspeed.comm
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1)
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank * 10)]))
    group = dist.new_group([0, 1])
    m = torch.tensor([float(rank)])
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    i = torch.tensor([float(rank + 1)], dtype=torch.bfloat16)
    dist.inference_all_reduce(i)
    dist.barrier()
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "local": dist.get_local_rank(),
            "sum": t.item(), "bcast": b.item(), "gathered": [g.item() for g in gathered], "max": m.item(),
            "inference sum": i.item()}


def test_comm_over_two_ranks():
    results = run_world(_comm_ranks, 2)
    for rank, r in enumerate(results):
        assert r == {"rank": rank, "world": 2, "local": rank, "sum": 3.0, "bcast": 1.0, "gathered": [0.0, 10.0],
                     "max": 1.0, "inference sum": 3.0}


def test_deepspeed_optimizer_classes_are_client_optimizers():
    from dsfunc.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from dsfunc.ops.lamb import FusedLamb

    from tests.models import MLP, config

    net = MLP()
    engine, optimizer, *_ = deepspeed.initialize(
        model=net, config=config(micro=2), optimizer=FusedAdam(net.parameters(), lr=3e-3, weight_decay=0.1))
    assert engine.state.program.config.optimizer.params["weight_decay"] == 0.1 and engine.get_lr() == [3e-3]
    cpu = DeepSpeedCPUAdam(net.parameters(), adamw_mode=False)
    assert deepspeed.initialize(model=net, config=config(micro=2), optimizer=cpu)[0].config.optimizer.params[
        "adam_w_mode"] is False
    assert deepspeed.initialize(model=net, config=config(micro=2), optimizer=FusedLamb(net.parameters()))[
        0].config.optimizer.type == "lamb"
    with pytest.raises(ValueError, match=r"FusedLamb\(max_grad_norm=1.0\) has no dsfunc equivalent.*gradient_clipping"):
        FusedLamb(net.parameters(), max_grad_norm=1.0)
    with pytest.raises(RuntimeError, match="stepped by the engine"):
        FusedAdam(net.parameters()).step()
    assert optimizer.param_groups[0]["weight_decay"] == 0.1


def test_which_native_ops_dsfunc_answers():
    from dsfunc.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder, FusedAdamBuilder

    assert deepspeed.ops.__compatible_ops__[FusedAdamBuilder.NAME] and CPUAdamBuilder().is_compatible()
    assert not deepspeed.ops.__compatible_ops__["transformer_inference"] and not AsyncIOBuilder().is_compatible()
    with pytest.raises(NotSupportedError, match="use deepspeed.ops.adam.FusedAdam"):
        FusedAdamBuilder().load()


def test_build_information_as_deepspeed_gives_it():
    """``deepspeed.git_version_info`` (DeepSpeed's test helpers read ``torch_info`` to skip bf16 tests): DeepSpeed's
    names and keys, versions as "major.minor" ("0.0" where there is none, as DeepSpeed writes it)."""
    from dsfunc.git_version_info import accelerator_name, git_hash, installed_ops, torch_info, version

    assert version == dsfunc.__version__ and git_hash == dsfunc.__git_hash__ and accelerator_name == "cpu"
    assert installed_ops["fused_adam"] and not installed_ops["async_io"]
    assert torch_info == {"version": ".".join(torch.__version__.split(".")[:2]), "bf16_support": False,
                          "cuda_version": "0.0", "nccl_version": "0.0", "hip_version": "0.0"}
    real = pytest.importorskip("deepspeed.git_version_info", reason="real DeepSpeed lists the keys")
    assert set(torch_info) == set(real.torch_info)
