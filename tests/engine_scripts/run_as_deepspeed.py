"""Run a DeepSpeed-style script (``import dsfunc as deepspeed``) with the engine's names on ``dsfunc``.

Until dsfunc/__init__.py re-exports ``initialize`` and ``add_config_arguments`` (from dsfunc.engine),
this adds them to the imported package (only in the test processes), then runs the script as __main__:

    python tests/engine_scripts/run_as_deepspeed.py SCRIPT [ARGS...]
    dsfunc --num_gpus 2 tests/engine_scripts/run_as_deepspeed.py SCRIPT [ARGS...]
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

# a launcher puts --local_rank=N before the script's own arguments: keep it for the script
args = sys.argv[1:]
flags = [a for a in args if a.startswith(("--local_rank=", "--local-rank="))]
script, *rest = [a for a in args if a not in flags]
sys.argv = [script, *flags, *rest]
runpy.run_path(script, run_name="__main__")
