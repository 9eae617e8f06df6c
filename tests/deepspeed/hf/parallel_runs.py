"""Hugging Face Trainer runs of a tiny Llama reaching dsfunc's mesh through the DeepSpeed config and accelerate's
ParallelismConfig (dsfunc behind ``DSFUNC_AS_DEEPSPEED=1``); the last line printed is ``RESULT <json>`` (rank 0).

``python parallel_runs.py reference OUT`` (one process, no DeepSpeed); under ``torch.distributed.run`` on 2 ranks,
``python parallel_runs.py tp OUT`` (``"tensor_parallel": {"autotp_size": 2}``) and ``python parallel_runs.py sp OUT``
(``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))``, ZeRO-1; ``sp-zero3``:
the same at ZeRO-3).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import LlamaForCausalLM

from tests.deepspeed.hf.runs import LLAMA, ds_config, samples, train
from tests.multiprocess import leave_together


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LLAMA)


def logged(losses: list[float], history: list[dict]) -> dict:
    """The losses and the gradient norms Trainer logged (the norm shows a gradient off by a constant factor, which
    Adam's update and clipping hide from the losses)."""
    return {"losses": losses, "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h]}


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    history: list = []
    if kind == "reference":
        res = logged(train(f"{out}/ref", None, llama, history=history), history)
    elif kind == "tp":
        made = []
        res = logged(train(f"{out}/tp", {**ds_config(1, optimizer=True), "tensor_parallel": {"autotp_size": 2}},
                           lambda: made.append(llama()) or made[0], history=history), history)
        # the engine trains the model in place: its split layers hold this rank's rows
        res["q_proj_rows"] = made[0].model.layers[0].self_attn.q_proj.weight.shape[0]
    elif kind in ("sp", "sp-zero3"):
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa", sp_seq_length=16,
                                                  sp_seq_length_is_variable=False)
        pc = ParallelismConfig(sp_size=2, sp_backend="deepspeed", sp_handler=handler)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # the real DeepSpeed's register_with_transformers needs it
        # the real DeepSpeed's UlyssesSPDataLoaderAdapter wants each token's position in the batch
        positioned = [{**s, "position_ids": torch.arange(len(s["input_ids"]))} for s in samples()]
        stage = 3 if kind == "sp-zero3" else 1
        res = logged(train(f"{out}/{kind}", ds_config(stage, optimizer=True), llama, history=history,
                           dataset=positioned, parallelism_config=pc), history)
    else:
        raise SystemExit(f"unknown run {kind!r}")
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(res), flush=True)
    if torch.distributed.is_initialized():
        leave_together()


if __name__ == "__main__":
    main()
