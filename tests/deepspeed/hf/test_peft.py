"""HF Trainer fine-tuning a PEFT LoRA model on dsfunc as its DeepSpeed (``DSFUNC_AS_DEEPSPEED=1``): Trainer saves
its checkpoints with ``exclude_frozen_parameters=True`` and resumes with ``load_module_strict=False``. The saved
checkpoint holds no base-model weight, and the run, saved and resumed, logs the losses of the same run without
DeepSpeed, at ZeRO-2 and ZeRO-3. ``python test_peft.py OUT`` is the run; its last line is ``RESULT <json>``."""

from __future__ import annotations

import json
import os
import sys

import pytest

if __name__ != "__main__":
    from tests.deepspeed.hf.conftest import ROOT
    from tests.deepspeed.hf.test_hf import assert_close, run

    pytest.importorskip("transformers")
    pytest.importorskip("peft")

    def test_trainer_saves_and_resumes_a_lora_model(as_deepspeed, tmp_path):
        res = run([sys.executable, os.path.abspath(__file__), str(tmp_path)],
                  {**as_deepspeed, "PYTHONPATH": ROOT}, str(tmp_path))
        for stage in (2, 3):  # the base model's weights are frozen: the checkpoints hold the LoRA weights only
            saved = res[f"z{stage}_saved"]
            assert saved["frozen"] == [] and saved["params"] and all("lora_" in n for n in saved["params"])
        for case in ("z2", "z2_resumed", "z3", "z3_resumed"):
            assert_close(res[case], res["reference"])


def lora_gpt2():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    from tests.deepspeed.hf.runs import CONFIG

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
    return get_peft_model(GPT2LMHeadModel(CONFIG), config)


def main(out: str) -> None:
    from tests.deepspeed.hf.runs import ds_config, train

    res = {"reference": train(f"{out}/ref", None, lora_gpt2)}
    for stage in (2, 3):
        res[f"z{stage}"] = train(f"{out}/z{stage}", ds_config(stage), lora_gpt2, save=True)
        with open(f"{out}/z{stage}/checkpoint-2/global_step2/dsfunc_checkpoint.json") as f:
            meta = json.load(f)
        res[f"z{stage}_saved"] = {"frozen": [n for n, b in meta["buffers"].items() if b["frozen"]],
                                  "params": [p["name"] for u in meta["units"] for p in u["params"]]}
        res[f"z{stage}_resumed"] = train(f"{out}/z{stage}r", ds_config(stage), lora_gpt2,
                                         resume=f"{out}/z{stage}/checkpoint-2")
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    main(sys.argv[1])
