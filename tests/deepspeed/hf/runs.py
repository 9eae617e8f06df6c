"""Hugging Face Trainer and accelerate runs of a tiny GPT-2, with DeepSpeed (dsfunc behind
``DSFUNC_AS_DEEPSPEED=1``, or the real DeepSpeed) and without; the last line printed is ``RESULT <json>``
(rank 0). Several runs share one process: importing transformers costs seconds.

``python runs.py trainer OUT [DEEPSPEED_CHECKPOINT]`` (1 rank, or under torch.distributed.run),
``python runs.py real OUT`` (the real DeepSpeed), ``python runs.py accelerate OUT``, and, under
``accelerate launch --use_deepspeed``, ``python runs.py launched``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Trainer,
    TrainingArguments,
)

CONFIG = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
LLAMA = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)  # RoPE buffers
MIXTRAL = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                        bos_token_id=0, eos_token_id=0)  # a mixture of experts: its blocks become ZeRO-3 leaves
MOE_BLOCK = "MixtralSparseMoeBlock"
MICRO, STEPS = 4, 4
DS_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                            "torch_adam": True}}


def samples() -> list[dict[str, torch.Tensor]]:
    rows = torch.randint(0, CONFIG.vocab_size, (32, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": r, "labels": r} for r in rows]


def ds_config(stage: int, optimizer: bool = False) -> dict:
    """A Trainer DeepSpeed config, "auto" where Trainer fills it in; without an optimizer section Trainer's
    own torch AdamW and lr scheduler drive the engine."""
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": stage}}
    return {**cfg, "optimizer": DS_OPTIMIZER} if optimizer else cfg


def train(out: str, ds: dict | None, model=None, resume: str | None = None, save: bool = False,
          history: list | None = None, dataset: list | None = None, **more_args) -> list[float]:
    """Trainer's logged losses: 4 optimizer steps of 2 micro-batches, linear warmup/decay (saving at step 2);
    ``history`` gets Trainer's log history; ``dataset`` replaces :func:`samples`; ``more_args``: more
    TrainingArguments."""
    args = TrainingArguments(**more_args, output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=2,
                             max_steps=STEPS, learning_rate=1e-3, warmup_steps=2, logging_steps=1, seed=0,
                             save_strategy="steps" if save else "no", save_steps=2, report_to=[], use_cpu=True,
                             deepspeed=ds, dataloader_num_workers=0, disable_tqdm=True)
    torch.manual_seed(0)
    model = model() if callable(model) else GPT2LMHeadModel(CONFIG)  # after the args: ZeRO-3's zero.Init
    trainer = Trainer(model=model, args=args, train_dataset=samples() if dataset is None else dataset)
    trainer.train(resume_from_checkpoint=resume)
    AcceleratorState._reset_state(True)
    if history is not None:
        history += trainer.state.log_history
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def pretrained(out: str) -> str:
    """A tiny saved model (seed 0) for from_pretrained."""
    torch.manual_seed(0)
    GPT2LMHeadModel(CONFIG).save_pretrained(out)
    return out


def trainer_runs(out: str, deepspeed_checkpoint: str | None) -> dict:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    tiny = pretrained(f"{out}/tiny{rank}")
    res = {"reference": train(f"{out}/ref", None),
           "z2_trainer_optimizer": train(f"{out}/z2", ds_config(2), save=True),
           "z3_config_optimizer": train(f"{out}/z3", ds_config(3, optimizer=True), save=True),
           "z3_from_pretrained": train(f"{out}/z3p", ds_config(3), lambda: GPT2LMHeadModel.from_pretrained(tiny))}
    res["z2_resumed"] = train(f"{out}/z2r", ds_config(2), resume=f"{out}/z2/checkpoint-2")
    res["z3_resumed"] = train(f"{out}/z3r", ds_config(3, optimizer=True), resume=f"{out}/z3/checkpoint-2")
    if world == 1:
        res["z2_config_optimizer"] = train(f"{out}/z2o", ds_config(2, optimizer=True))
        res["z3_trainer_optimizer"] = train(f"{out}/z3t", ds_config(3))
        res["z3_from_config"] = train(f"{out}/z3c", ds_config(3), lambda: AutoModelForCausalLM.from_config(CONFIG))
        torch.manual_seed(0)
        LlamaForCausalLM(LLAMA).save_pretrained(f"{out}/llama")
        llama = lambda: LlamaForCausalLM.from_pretrained(f"{out}/llama")
        res["llama_reference"] = train(f"{out}/l0", None, llama)
        res["z3_llama_from_pretrained"] = train(f"{out}/l3", ds_config(3), llama)
        torch.manual_seed(0)
        MixtralForCausalLM(MIXTRAL).save_pretrained(f"{out}/mixtral")
        mixtral = lambda: MixtralForCausalLM.from_pretrained(f"{out}/mixtral")
        res["mixtral_reference"] = train(f"{out}/m0", None, mixtral)
        os.environ["ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"] = MOE_BLOCK  # accelerate marks them as leaves
        res["z3_mixtral_from_pretrained"] = train(f"{out}/m3", ds_config(3), mixtral)
        del os.environ["ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"]
    if deepspeed_checkpoint is not None:  # written by the real DeepSpeed: its Trainer's AdamW has 2 groups
        res["resumed_from_deepspeed"] = train(f"{out}/dsr", ds_config(2, optimizer=True), resume=deepspeed_checkpoint)
    return res


def real_runs(out: str) -> dict:
    """The real DeepSpeed: ZeRO-3 from_config (its init is ZeRO-3's own), and a ZeRO-2 checkpoint to import."""
    return {"z3_from_config": train(f"{out}/z3c", ds_config(3), lambda: AutoModelForCausalLM.from_config(CONFIG)),
            "z2_config_optimizer": train(f"{out}/z2o", ds_config(2, optimizer=True), save=True)}


def accelerate_loop(plugin: DeepSpeedPlugin | None, launched: bool = False, state_dir: str | None = None,
                    make=lambda: GPT2LMHeadModel(CONFIG)) -> list[float]:
    """accelerate's loop: torch AdamW and LambdaLR, 2 accumulated micro-batches, clipping; each micro-batch's
    loss averaged over the ranks. With ``state_dir``: ``save_state`` halfway, and at the end ``load_state`` and
    the second half once more (its losses appended). A mixture of experts' blocks must be leaves."""
    handlers = [InitProcessGroupKwargs(backend="gloo")] if launched else []
    acc = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=2, kwargs_handlers=handlers)
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    loader = torch.utils.data.DataLoader(samples(), batch_size=MICRO)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    assert (type(model).__name__ == "Engine") == (plugin is not None or launched), type(model)
    if plugin is not None and plugin.transformer_moe_cls_names:
        from deepspeed.utils import get_z3_leaf_modules

        assert len(get_z3_leaf_modules(model.module)) == MIXTRAL.num_hidden_layers
    losses = []

    def run(batches: list) -> None:
        for batch in batches:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
                losses.append(acc.gather(loss.detach()).mean().item())

    batches = list(loader)
    half = len(batches) // 2
    run(batches[:half])
    if state_dir is not None:
        acc.save_state(state_dir)
    run(batches[half:])
    if state_dir is not None:
        acc.load_state(state_dir)
        run(batches[half:])
    acc.free_memory()
    AcceleratorState._reset_state(True)
    return losses


def launch_reference(ranks: int = 2) -> list[float]:
    """What 2 ranks of :func:`accelerate_loop` compute, in one process without DeepSpeed: rank r gets batches
    r, r + 2, ..., so an optimizer step averages the gradients of 4 consecutive batches."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    batches = list(torch.utils.data.DataLoader(samples(), batch_size=MICRO))
    per_step = 2 * ranks
    losses = []
    for k in range(len(batches) // per_step):
        step = [model(**b).loss for b in batches[k * per_step:(k + 1) * per_step]]
        losses += [sum(step[j * ranks:(j + 1) * ranks]).item() / ranks for j in range(2)]
        (sum(step) / per_step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for _ in range(ranks):  # accelerate steps the scheduler once per rank
            sched.step()
        opt.zero_grad()
    return losses


def main() -> None:
    kind = sys.argv[1]
    if kind == "trainer":
        res = trainer_runs(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    elif kind == "real":
        res = real_runs(sys.argv[2])
    elif kind == "accelerate":
        mixtral = lambda: MixtralForCausalLM(MIXTRAL)
        res = {"reference": accelerate_loop(None), "launch_reference": launch_reference(),
               "mixtral_reference": accelerate_loop(None, make=mixtral)}  # before any plugin sets accelerate's env
        for stage in (2, 3):
            res[f"z{stage}"] = accelerate_loop(DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=2,
                                                                gradient_clipping=1.0), state_dir=f"{sys.argv[2]}/z{stage}")
        res["z3_mixtral"] = accelerate_loop(DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=2, gradient_clipping=1.0,
                                                            transformer_moe_cls_names=MOE_BLOCK), make=mixtral)
    else:
        res = {"launched": accelerate_loop(None, launched=True)}
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
