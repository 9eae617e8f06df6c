"""Build an engine with real DeepSpeed or dsfunc (``--backend``, the ``import deepspeed`` the environment gives)
for a few configs, one process, and write
JSON: its public names (class and instance) and every zero-argument config accessor's value."""

from __future__ import annotations

import argparse
import inspect
import json
import os

import torch
from torch import nn

CONFIGS = {
    "zero0_fp32": {"train_batch_size": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
                   "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}},
    "zero2_bf16": {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5, "steps_per_print": 5,
                   "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.9], "torch_adam": True}},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}},
    "zero3_fp16": {"train_batch_size": 2, "wall_clock_breakdown": True, "dataloader_drop_last": True,
                   "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50, "hysteresis": 3},
                   "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                         "stage3_prefetch_bucket_size": 123, "stage3_max_live_parameters": 456,
                                         "stage3_param_persistence_threshold": 7, "overlap_comm": True},
                   "zero_allow_untested_optimizer": True,
                   "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}},
}


def values(engine: object) -> dict[str, object]:
    """Every zero-argument accessor DeepSpeed's engine defines, called (or the error type it raised)."""
    from deepspeed.runtime.engine import DeepSpeedEngine  # dsfunc's when --backend dsfunc

    out = {}
    for name in dir(DeepSpeedEngine):
        attr = inspect.getattr_static(DeepSpeedEngine, name)
        if name.startswith("_") or name in dir(nn.Module) or not inspect.isfunction(attr):
            continue
        params = list(inspect.signature(attr).parameters.values())[1:]
        if any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            continue
        try:
            value = getattr(engine, name)()
        except Exception as e:  # noqa: BLE001 (recorded: the test reads which error)
            value = f"raises {type(e).__name__}"
        out[name] = plain(value)
    return out


def plain(value: object) -> object:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return f"<{type(value).__name__}>"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["deepspeed", "dsfunc"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import deepspeed  # dsfunc under DSFUNC_AS_DEEPSPEED=1 (the test sets it for --backend dsfunc)

    assert (deepspeed.__name__ == "dsfunc") == (args.backend == "dsfunc"), deepspeed.__file__
    accelerator = deepspeed.accelerator.get_accelerator()
    if args.backend == "deepspeed" and not accelerator.is_fp16_supported():
        # DeepSpeed's CPU accelerator answers from oneDNN's fp16 support, which some CPUs lack (an AMD EPYC of
        # CI's), and its engine then refuses an fp16 config. The engines here are only built and asked for their
        # accessors: no fp16 arithmetic runs.
        accelerator.is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo")
    result = {}
    for label, config in CONFIGS.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        names = {n for n in dir(engine) if not n.startswith("_")} - set(dir(nn.Module))
        result[label] = {"names": sorted(names), "values": values(engine)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
