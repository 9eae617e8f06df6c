"""Everything is in pyproject.toml; this only ships ``dsfunc_as_deepspeed.pth`` beside the packages.

A ``.pth`` file in site-packages runs at every interpreter start, before any script: that is how
``DSFUNC_AS_DEEPSPEED=1`` takes effect for a plain ``python train.py`` and for every process that
``torchrun`` or ``accelerate launch`` starts. setuptools has no option for a top-level ``.pth`` file, so
``build_py`` writes it where the wheel's top level is: the build folder of a regular wheel, or the
unpacked editable wheel (the install folder editable_wheel sets) for ``pip install -e``.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "dsfunc_as_deepspeed.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        top = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        Path(top).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(__file__).parent / PTH, Path(top) / PTH)


setup(cmdclass={"build_py": BuildPyWithPth})
