"""Launched by the launcher tests: every rank builds a state from the same mistyped config."""

import torch

import dsfunc

model = torch.nn.Linear(2, 2)
dsfunc.init_state(model, {"train_batch_size": 3, "optimizer": {"type": "Adamx", "params": {"lr": 1e-3}}})
