"""Run a DeepSpeed-style script (``import dsfunc as deepspeed``) with the engine's names on ``dsfunc``.

Until dsfunc/__init__.py re-exports ``initialize``, ``add_config_arguments`` and ``init_distributed``,
this adds them to the imported package (only in the test processes), then runs the script as __main__:

    python tests/engine_scripts/run_as_deepspeed.py SCRIPT [ARGS...]
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsfunc
import dsfunc.engine

for name in ("initialize", "add_config_arguments"):
    if not hasattr(dsfunc, name):
        setattr(dsfunc, name, getattr(dsfunc.engine, name))
if not hasattr(dsfunc, "init_distributed"):
    dsfunc.init_distributed = lambda *args, **kwargs: dsfunc.engine._join_world(29500)

script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
