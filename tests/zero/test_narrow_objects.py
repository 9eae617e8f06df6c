"""The core's long-lived objects stay narrow: the host offload, the workspace and the micro-batch runtime (the
functional step's and the engine's) each keep at most 12 attributes. Each one more is state a reader of the step
has to follow; a class that needs more is two concepts, to be split.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

import dsfunc
from dsfunc.deepspeed.engine_runtime import EngineRuntime
from dsfunc.zero.gather import Workspace
from dsfunc.zero.offload.host import HostOffload
from dsfunc.zero.runtime import MicroBatchRuntime
from tests.models import mlp_batches
from tests.zero.test_offload import host_of, make_state

MOST = 12


def assigned(cls: type) -> set[str]:
    """Every ``self.<name>`` that a method of ``cls``, or of a dsfunc class it derives from, assigns to."""
    names = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("dsfunc."):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            else:
                continue
            names.update(e.attr for t in targets for e in ast.walk(t)
                         if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self")
    return names


@pytest.mark.parametrize("cls", [HostOffload, Workspace, MicroBatchRuntime, EngineRuntime])
def test_at_most_12_attributes(cls):
    names = assigned(cls)
    assert 0 < len(names) <= MOST, sorted(names)


def test_the_live_objects_hold_only_the_attributes_their_code_assigns():
    """After steps with everything offloaded at stage 3, nothing was added from outside (``setattr``, a
    ``__dict__`` write) that the count above would miss."""
    state = make_state(1, 3, "param", bf16={"enabled": True})
    for batch in mlp_batches(2, 4):
        state = dsfunc.train_step(state, batch)
    state.program.run.wait()
    for obj in (host_of(state), state.program.run.workspace):
        assert set(vars(obj)) <= assigned(type(obj)), type(obj).__name__
