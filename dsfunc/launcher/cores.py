"""CPU cores per rank: DeepSpeed's ``--bind_cores_to_rank`` / ``--bind_core_list``, and OMP_NUM_THREADS.

A node's cores are split evenly over its ranks in order, as DeepSpeed does (``deepspeed/utils/numa.py``):
with ``P`` cores and ``N`` local ranks each gets ``P // N`` consecutive ones of the list, local rank ``i``
the ``i``-th block. The list is ``--bind_core_list`` (DeepSpeed's grammar, ``0,2-4,6``), or else every core
this process may run on (``os.sched_getaffinity``, so a container's or job's cpuset is respected, where
DeepSpeed counts physical cores from 0). The rank's shim binds itself with ``os.sched_setaffinity`` before
the user's program starts; unlike DeepSpeed's ``numactl -C ... -m ...`` memory is not bound (pages are
placed where first touched, which is the rank's own NUMA node once it is bound).

Threads: without OMP_NUM_THREADS set by the user, each rank gets ``cores // local ranks`` (its bound cores
when binding), at least 1, instead of torch elastic's fixed 1 and its 4-line warning. A process no launcher
started gets the cores other processes leave free (:func:`dsfunc.init_state`): on a busy host, one thread per
core makes torch's threads wait on each other behind the other work, several times slower than fewer.
"""

from __future__ import annotations

import os

from dsfunc.errors import InputError

THREADS_VARIABLE = "OMP_NUM_THREADS"


def parse_core_list(text: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``: numbers and inclusive ranges, ascending, not overlapping."""
    cores: list[int] = []
    for item in text.split(","):
        first, dash, last = item.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise InputError(
                f"--bind_core_list {text!r}: {item!r} is not a core number or a range such as 2-5"
            ) from None
        if low < 0 or low > high or (cores and low <= cores[-1]):
            raise InputError(
                f"--bind_core_list {text!r}: ranges must be ascending and must not overlap ({item!r})"
            )
        cores.extend(range(low, high + 1))
    return cores


def available_cores(core_list: str | None) -> list[int]:
    """The cores a node's ranks share: ``core_list`` parsed, or every core this process may run on."""
    return parse_core_list(core_list) if core_list else sorted(os.sched_getaffinity(0))


def check_cores_here(core_list: str | None) -> None:
    """Refuse a ``core_list`` naming cores this machine does not let this process use (binding a rank to
    them would fail inside it)."""
    allowed = sorted(os.sched_getaffinity(0))
    missing = sorted(set(available_cores(core_list)) - set(allowed))
    if missing:
        raise InputError(
            f"--bind_core_list {core_list!r}: core(s) {_ranges(missing)} are not available here (this node's "
            f"ranks may run on {_ranges(allowed)}); list only those"
        )


def rank_cores(core_list: str | None, local_rank: int, local_size: int) -> list[int]:
    """The consecutive block of cores that local rank ``local_rank`` of ``local_size`` is bound to."""
    cores = available_cores(core_list)
    per_rank = len(cores) // local_size
    if per_rank < 1:
        raise InputError(
            f"--bind_cores_to_rank: {len(cores)} core(s) ({_ranges(cores)}) cannot give each of {local_size} "
            "local ranks one; start fewer ranks per node or list more cores with --bind_core_list"
        )
    return cores[local_rank * per_rank : (local_rank + 1) * per_rank]


def threads_per_rank(local_size: int, bind: bool, core_list: str | None, busy: float = 0.0) -> int:
    """OMP_NUM_THREADS for each of ``local_size`` ranks: its bound cores, or this node's cores shared out, less
    the ``busy`` ones other processes keep working (:func:`busy_cores`); at least 1."""
    if bind:
        return len(rank_cores(core_list, 0, local_size))
    return max(1, int((len(os.sched_getaffinity(0)) - busy) // local_size))


def busy_cores() -> float:
    """How many cores other processes kept busy lately: the 1-minute load average less this process's own
    average use since it started (0 where the system does not tell)."""
    try:
        load = os.getloadavg()[0]
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22
        with open("/proc/uptime") as f:
            age = max(float(f.read().split()[0]) - started, 1.0)
    except (OSError, ValueError, IndexError):
        return 0.0
    times = os.times()
    return max(0.0, load - (times.user + times.system) / age)


def _ranges(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts: list[str] = []
    for core in cores:
        if parts and core == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{core}"
        else:
            parts.append(str(core))
    return ",".join(parts)
