"""The per-step time of ``dsfunc.train_step`` on the tiny MLP, for two checkouts of dsfunc in one session.

    python bench/compare_step_overhead.py /path/to/before /path/to/after [--rounds 4]

Each round runs every checkout in its own process (alternating, so drifting load hits them alike): 30
warm-up steps, then 7 repeats of 200 steps; it prints the min and median milliseconds per step.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

_CHILD = r"""
import statistics, sys, time, torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/bench"]
import dsfunc
from bench_step_overhead import Tiny
torch.manual_seed(0)
config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
state = dsfunc.init_state(Tiny(), config)
batch = (torch.randn(8, 32), torch.randint(0, 10, (8,)))
for _ in range(30):
    state = dsfunc.train_step(state, batch)
times = []
for _ in range(7):
    start = time.perf_counter()
    for _ in range(200):
        state = dsfunc.train_step(state, batch)
    times.append((time.perf_counter() - start) / 200 * 1e3)
print(f"{min(times):.3f} / {statistics.median(times):.3f}")
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs="+", help="checkouts of dsfunc (their root folders)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    print("| round | " + " | ".join(f"{t}: min / median ms per step" for t in args.trees) + " |")
    print("|---|" + "---|" * len(args.trees))
    for r in range(1, args.rounds + 1):
        cells = [subprocess.run([sys.executable, "-c", _CHILD, tree], capture_output=True, text=True,
                                check=True).stdout.strip() for tree in args.trees]
        print(f"| {r} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
