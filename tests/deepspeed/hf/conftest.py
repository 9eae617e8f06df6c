"""The environment of a process that runs with ``DSFUNC_AS_DEEPSPEED=1``, as a user's would.

The switch is ``dsfunc_as_deepspeed.pth``, which an install of dsfunc puts in site-packages
(tests/deepspeed/hf/test_switch.py checks both kinds of install). When this interpreter's dsfunc was
installed before that file existed, the children get the repository's copy in a throwaway user
site-packages, which Python reads at start the same way.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PTH = "dsfunc_as_deepspeed.pth"
_PROBE = "import importlib.util as u; print(type(u.find_spec('deepspeed').loader).__module__)"


def base_env() -> dict[str, str]:
    """This environment without launcher variables, the switch or a GPU, with the repository importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "DSFUNC_AS_DEEPSPEED")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    return env


def switched(env: dict[str, str]) -> bool:
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**env, "DSFUNC_AS_DEEPSPEED": "1"},
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() == "dsfunc_as_deepspeed"


@pytest.fixture(scope="session")
def as_deepspeed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a process that imports dsfunc as deepspeed."""
    env = base_env()
    if not switched(env):
        base = tmp_path_factory.mktemp("userbase")
        env["PYTHONUSERBASE"] = str(base)
        target = subprocess.run([sys.executable, "-c", "import site; print(site.getusersitepackages())"], env=env,
                                capture_output=True, text=True, check=True).stdout.strip()
        os.makedirs(target)
        shutil.copy(os.path.join(ROOT, PTH), target)
        if not site.ENABLE_USER_SITE or not switched(env):
            pytest.skip("this dsfunc install predates dsfunc_as_deepspeed.pth and user site-packages are off")
    return {**env, "DSFUNC_AS_DEEPSPEED": "1"}
