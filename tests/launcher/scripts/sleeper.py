"""Launched by the launcher tests: each rank records its pid in OUTDIR/ready<RANK> and then sleeps."""

import os
import sys
import time

out_dir = sys.argv[-1]
with open(os.path.join(out_dir, f"ready{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
