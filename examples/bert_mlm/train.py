"""Masked-language-model training of a tiny Hugging Face BERT with ZeRO-3 and parameter groups, in the style of
DeepSpeed's BERT examples (``import dsfunc as deepspeed`` is the only change a DeepSpeed user would see).

    dsfunc --num_gpus 2 examples/bert_mlm/train.py --deepspeed_config examples/bert_mlm/ds_config.json

The text is the docstrings of Python's own standard library (no download): a word-level vocabulary, windows
of ``--seq_len`` words, 15% of the words masked (BERT's 80/10/10 rule). Biases and LayerNorm weights get no
weight decay, as every Hugging Face script arranges with two parameter groups. It reports the masked-word
accuracy on held-out windows before and after training, evaluated with the model itself (which the engine
trains in place; at ZeRO-3 each layer is gathered for its forward), and saves the 16-bit weights.
"""

import argparse
import collections
import importlib
import os
import re

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForMaskedLM

import dsfunc as deepspeed

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, UNK, CLS, SEP, MASK = range(len(SPECIAL))
MODULES = ["argparse", "collections", "functools", "itertools", "json", "logging", "pathlib", "re", "typing",
           "unittest", "subprocess", "threading", "asyncio", "dataclasses", "inspect", "os", "string", "textwrap"]


def get_args():
    parser = argparse.ArgumentParser(description="tiny BERT masked-LM training")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=600, help="words in the vocabulary (the rest is [UNK])")
    parser.add_argument("--output_dir", default=None, help="where save_16bit_model writes the weights")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def stdlib_words():
    """Every word of the standard library's docstrings listed in MODULES, lower-cased, in order."""
    words = []
    for name in MODULES:
        module = importlib.import_module(name)
        for obj in [module, *vars(module).values()]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str):
                words += re.findall(r"[a-z]+", doc.lower())
    return words


class Windows(Dataset):
    """Fixed-length windows of token ids, each framed by [CLS] ... [SEP]."""

    def __init__(self, ids, seq_len):
        n = (len(ids) // (seq_len - 2)) * (seq_len - 2)
        body = torch.tensor(ids[:n]).view(-1, seq_len - 2)
        self.windows = torch.cat([torch.full((len(body), 1), CLS), body, torch.full((len(body), 1), SEP)], dim=1)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return self.windows[i]


def mask_tokens(input_ids, vocab_size, generator=None):
    """BERT's masking: 15% of the words are predicted; of those 80% become [MASK], 10% a random word."""
    labels = input_ids.clone()
    words = input_ids >= len(SPECIAL)
    chosen = (torch.rand(input_ids.shape, generator=generator) < 0.15) & words
    labels[~chosen] = -100
    masked = input_ids.clone()
    roll = torch.rand(input_ids.shape, generator=generator)
    masked[chosen & (roll < 0.8)] = MASK
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    masked[swap] = torch.randint(len(SPECIAL), vocab_size, input_ids.shape, generator=generator)[swap]
    return {"input_ids": masked, "attention_mask": torch.ones_like(masked), "labels": labels}


def collate(samples, vocab_size):
    return mask_tokens(torch.stack(samples), vocab_size)


def masked_accuracy(model, batches, device):
    """Masked-word accuracy of ``model`` (every rank runs it: at ZeRO-3 the forward gathers each layer)."""
    hits = total = 0
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            predicted = logits.argmax(-1)
            chosen = batch["labels"] != -100
            hits += (predicted[chosen] == batch["labels"][chosen]).sum().item()
            total += chosen.sum().item()
    return 100.0 * hits / max(total, 1)


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend=deepspeed.accelerator.get_accelerator().communication_backend_name())
    torch.manual_seed(1234)
    words = stdlib_words()
    common = [w for w, _ in collections.Counter(words).most_common(args.vocab - len(SPECIAL))]
    index = {w: i for i, w in enumerate(SPECIAL + common)}
    ids = [index.get(w, UNK) for w in words]
    split = int(len(ids) * 0.9)
    train, held_out = Windows(ids[:split], args.seq_len), Windows(ids[split:], args.seq_len)
    vocab_size = len(index)
    g = torch.Generator().manual_seed(0)
    val_batches = [mask_tokens(held_out.windows[i:i + 32], vocab_size, g) for i in range(0, len(held_out), 32)]

    config = BertConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=args.seq_len, pad_token_id=PAD)
    model = BertForMaskedLM(config)
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    model_engine, optimizer, train_loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=optimizer_grouped_parameters, training_data=train,
        collate_fn=lambda samples: collate(samples, vocab_size))
    device = model_engine.device
    before = masked_accuracy(model, val_batches, device)

    model_engine.train()
    for epoch in range(args.epochs):
        for batch in train_loader:
            outputs = model_engine(**{k: v.to(device) for k, v in batch.items()})
            model_engine.backward(outputs.loss)
            model_engine.step()
        if model_engine.global_rank == 0:
            print(f"epoch {epoch + 1}: loss {outputs.loss.item():.3f}, lr {optimizer.param_groups[0]['lr']:.2e}, "
                  f"weight decay per group {[g['weight_decay'] for g in optimizer.param_groups]}", flush=True)
    model_engine.eval()
    after = masked_accuracy(model, val_batches, device)
    if model_engine.global_rank == 0:
        print(f"masked-word accuracy on {len(held_out)} held-out windows: {before:.1f} % -> {after:.1f} %")
    if args.output_dir is not None:
        model_engine.save_16bit_model(args.output_dir)
        if model_engine.global_rank == 0:
            fresh = BertForMaskedLM(config).eval()
            fresh.load_state_dict(torch.load(os.path.join(args.output_dir, "pytorch_model.bin")))
            print(f"reloaded from {args.output_dir}: masked-word accuracy {masked_accuracy(fresh, val_batches, 'cpu'):.1f} %")


if __name__ == "__main__":
    main()
