"""``save_dir/zero_to_fp32.py``: DeepSpeed's recovery script, which its ZeRO saves leave beside the checkpoints.

Users of DeepSpeed run ``python save_dir/zero_to_fp32.py save_dir out_dir`` to get plain fp32 weights; a dsfunc
save at ZeRO stages 1-3 writes a script of that name and command line that runs dsfunc's
(:mod:`dsfunc.deepspeed.zero_to_fp32`, over :func:`dsfunc.checkpoint.export.weights`).
"""

from __future__ import annotations

import os
from pathlib import Path

SCRIPT_NAME = "zero_to_fp32.py"
SCRIPT = '''#!/usr/bin/env python
"""DeepSpeed's zero_to_fp32.py, written by dsfunc: the fp32 weights of this folder's checkpoints (see --help)."""
from dsfunc.deepspeed.zero_to_fp32 import main

if __name__ == "__main__":
    main()
'''


def write_recovery_script(save_dir: Path) -> None:
    """Write ``save_dir/zero_to_fp32.py`` (executable), unless it is there already."""
    path = save_dir / SCRIPT_NAME
    if path.is_file() and path.read_text() == SCRIPT:
        return
    tmp = save_dir / f".{SCRIPT_NAME}.tmp-{os.getpid()}"
    tmp.write_text(SCRIPT)
    tmp.chmod(0o755)
    os.replace(tmp, path)
