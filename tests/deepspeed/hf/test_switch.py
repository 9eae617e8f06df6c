"""``DSFUNC_AS_DEEPSPEED=1``: ``import deepspeed``, its submodules and its metadata answer with dsfunc, in a
process started with the variable; without it nothing changes (the real DeepSpeed imports). The switch
ships with both kinds of install (a wheel, ``pip install -e``), each installed for real into a throwaway
user site-packages."""

from __future__ import annotations

import importlib.util
import os
import shutil
import site as site_module
import subprocess
import sys

import pytest

from tests.deepspeed.hf.conftest import PTH, ROOT, base_env

_CHECK = """
import importlib, importlib.metadata, importlib.util, sys
import deepspeed, dsfunc
assert deepspeed is dsfunc and importlib.util.find_spec("deepspeed") is not None
assert importlib.metadata.version("deepspeed") == "0.19.8+dsfunc", importlib.metadata.version("deepspeed")
assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"
import deepspeed.comm, deepspeed.runtime.zero.partition_parameters as pp
from deepspeed.runtime.zero import partition_parameters
assert deepspeed.comm is importlib.import_module("dsfunc.comm") and partition_parameters is pp
assert pp is importlib.import_module("dsfunc.runtime.zero.partition_parameters")
assert pp.zero_wrapper_for_fp_tensor_constructor(pp._orig_torch_arange, None) is pp._orig_torch_arange
import deepspeed.runtime.lr_schedules as lr
assert "WarmupLR" in lr.VALID_LR_SCHEDULES and deepspeed.runtime.engine.DeepSpeedEngine is dsfunc.Engine
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
import torch
big = torch.arange(6.0)
out = clone_tensors_for_torch_save({"a": [big[:2]], "b": 1})
assert out["a"][0].untyped_storage().nbytes() == 8 and out["b"] == 1 and DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
assert dsfunc.__spec__.name == "dsfunc" and dsfunc.zero.__spec__.name == "dsfunc.zero"  # aliases keep their own
print("DSFUNC", dsfunc.__file__)
"""


def _python(code: str, env: dict[str, str], cwd: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_with_the_variable_deepspeed_is_dsfunc(as_deepspeed, tmp_path):
    assert "DSFUNC /" in _python(_CHECK, as_deepspeed, str(tmp_path))


def test_without_it_nothing_changes(as_deepspeed, tmp_path):
    env = {k: v for k, v in as_deepspeed.items() if k != "DSFUNC_AS_DEEPSPEED"}
    code = "import importlib.util, sys; print(importlib.util.find_spec('deepspeed')); print('dsfunc' in sys.modules)"
    out = _python(code, env, str(tmp_path)).split()
    assert out[-1] == "False"  # nothing of dsfunc loaded at start
    if importlib.util.find_spec("deepspeed") is not None:
        code = "import importlib.metadata as m, deepspeed; print(deepspeed.__name__, m.version('deepspeed'))"
        name, version = _python(code, {**env, "DS_ACCELERATOR": "cpu"}, str(tmp_path)).split()[-2:]
        assert name == "deepspeed" and "dsfunc" not in version
    with_bad_value = _python("import sys; print('dsfunc' in sys.modules)", {**env, "DSFUNC_AS_DEEPSPEED": "yes"},
                             str(tmp_path))
    assert with_bad_value.strip() == "False"


def test_the_switch_costs_a_start_one_small_module(as_deepspeed, tmp_path):
    """The launcher sets the variable for every rank and everything it starts: an interpreter that never
    imports deepspeed loads nothing more than the switch's own module (no dsfunc, torch or importlib.metadata)."""
    env = {k: v for k, v in as_deepspeed.items() if k != "DSFUNC_AS_DEEPSPEED"}
    code = "import sys; print(' '.join(sorted(sys.modules)))"
    without = set(_python(code, env, str(tmp_path)).split())
    with_it = set(_python(code, as_deepspeed, str(tmp_path)).split())
    assert with_it - without == {"dsfunc_as_deepspeed"}, with_it - without
    late = "import sys; n = len(sys.modules); import deepspeed, dsfunc; print(deepspeed is dsfunc, len(sys.modules) > n)"
    assert _python(late, as_deepspeed, str(tmp_path)).split() == ["True", "True"]


def _copy_source(dest: str) -> str:
    """What a fresh clone holds of the package (its tracked files, plus the working tree's changes)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    top = ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in")
    for name in names:
        wanted = name.startswith(("dsfunc/", "dsfunc_as_deepspeed")) or name in top
        if wanted and os.path.exists(os.path.join(ROOT, name)):
            os.makedirs(os.path.dirname(os.path.join(dest, name)) or dest, exist_ok=True)
            shutil.copy(os.path.join(ROOT, name), os.path.join(dest, name))
    return dest


@pytest.mark.parametrize("editable", [False, True], ids=["wheel", "editable"])
def test_an_install_carries_the_switch(editable, tmp_path):
    pytest.importorskip("setuptools")
    if sys.prefix != sys.base_prefix or not site_module.ENABLE_USER_SITE:
        pytest.skip("installs into a throwaway user site-packages, which a virtualenv does not read")
    source = _copy_source(str(tmp_path / "src"))
    env = {**base_env(), "PYTHONUSERBASE": str(tmp_path / "user"), "PYTHONPATH": "", "PIP_NO_INDEX": "1"}
    target = ["-e", source] if editable else [source]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--user", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", *target], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    site = _python("import site; print(site.getusersitepackages())", env, str(tmp_path)).strip()
    assert PTH in os.listdir(site)
    out = _python(_CHECK, {**env, "DSFUNC_AS_DEEPSPEED": "1"}, str(tmp_path))
    where = source if editable else site  # this install's dsfunc answers
    assert f"DSFUNC {where}/dsfunc/__init__.py" in out, out
