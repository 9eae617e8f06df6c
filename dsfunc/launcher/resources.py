"""Which hosts and slots a job runs on: the hostfile, the local pool, and --include/--exclude/--num_* filters.

A *resource map* is an ordered ``{host: [slot, ...]}``; its order is the node order, so it fixes the global
rank order (ranks are numbered host by host, slot by slot).
"""

from __future__ import annotations

import os
import re

from dsfunc.errors import Error

Resources = dict[str, list[int]]

_ENTRY = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)(?P<rest>(\s+\S+=\S+)*)$")


class ResourceError(Error, ValueError):
    """The hostfile, or a host/slot selection, is invalid."""


def gpu_count() -> int:
    """GPUs this machine has (0 without CUDA): its slots when there is no hostfile."""
    import torch

    return torch.cuda.device_count()


def parse_hostfile(text: str, path: str = "<hostfile>") -> Resources:
    """Parse MPI-style hostfile text: ``host slots=N`` lines (more ``key=value`` options allowed and ignored),
    ``#`` comments and blank lines. Host order is kept. Errors name the file and line."""
    resources: Resources = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _ENTRY.match(line)
        if match is None:
            raise ResourceError(
                f"{path}:{lineno}: bad hostfile entry {raw.strip()!r}; expected 'HOSTNAME slots=N' "
                "(e.g. 'worker-1 slots=8')"
            )
        host, slots = match["host"], int(match["slots"])
        if slots < 1:
            raise ResourceError(f"{path}:{lineno}: host {host!r} has slots={slots}; slots must be at least 1")
        if host in resources:
            raise ResourceError(
                f"{path}:{lineno}: host {host!r} is listed twice (first on line {first_line[host]}); "
                "give each host one line"
            )
        resources[host] = list(range(slots))
        first_line[host] = lineno
    if not resources:
        raise ResourceError(f"{path}: the hostfile has no 'HOSTNAME slots=N' entries")
    return resources


def read_hostfile(path: str) -> Resources:
    """Read and parse the hostfile at ``path``."""
    with open(path) as f:
        return parse_hostfile(f.read(), path)


def local_pool(num_gpus: int, gpu_count: int, visible_devices: str | None) -> Resources:
    """Slots of this machine when there is no hostfile: its GPUs, or ``num_gpus`` CPU processes without GPUs.

    ``visible_devices`` is ``CUDA_VISIBLE_DEVICES`` (its ids become the slots when it lists integers).
    """
    if gpu_count == 0:
        if num_gpus < 1:
            raise ResourceError(
                "no GPU found and no hostfile: pass --num_gpus N to run N processes on the CPU (gloo)"
            )
        return {"localhost": list(range(num_gpus))}
    slots = list(range(gpu_count))
    if visible_devices:
        ids = [v.strip() for v in visible_devices.split(",") if v.strip()]
        if len(ids) == gpu_count and all(v.isdigit() for v in ids):
            slots = [int(v) for v in ids]
    if num_gpus > len(slots):
        raise ResourceError(f"--num_gpus {num_gpus} asks for more GPUs than this machine has ({len(slots)})")
    return {"localhost": slots}


def parse_node_specs(spec: str, flag: str) -> dict[str, list[int] | None]:
    """Parse ``NAME[:SLOT[,SLOT...]][@NAME...]`` into ``{host: slots or None (= whole host)}``."""
    result: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        part = part.strip()
        if not part:
            continue
        host, sep, slot_text = part.partition(":")
        if not host:
            raise ResourceError(f"{flag} {spec!r}: {part!r} has no host name; use HOST[:SLOT,SLOT]")
        if not sep:
            result[host] = None
            continue
        slots = []
        for s in slot_text.split(","):
            s = s.strip()
            if not s.isdigit():
                raise ResourceError(
                    f"{flag} {spec!r}: slot {s!r} of host {host!r} is not a non-negative integer"
                )
            slots.append(int(s))
        if host in result and result[host] is None:
            continue
        result[host] = sorted(set((result.get(host) or []) + slots))
    if not result:
        raise ResourceError(f"{flag} {spec!r} names no host; use HOST[:SLOT,SLOT][@HOST...]")
    return result


def _check_known(pool: Resources, selection: dict[str, list[int] | None], flag: str) -> None:
    for host, slots in selection.items():
        if host not in pool:
            raise ResourceError(
                f"{flag}: host {host!r} is not in the hostfile (known hosts: {', '.join(pool)})"
            )
        for slot in slots or []:
            if slot not in pool[host]:
                raise ResourceError(
                    f"{flag}: host {host!r} has no slot {slot} (its slots: {', '.join(map(str, pool[host]))})"
                )


def select(
    pool: Resources, include: str = "", exclude: str = "", num_nodes: int = -1, num_gpus: int = -1
) -> Resources:
    """Apply DeepSpeed's filters to ``pool``: ``include`` keeps only the named hosts/slots, ``exclude`` drops
    them (the two are mutually exclusive), ``num_nodes`` keeps the first N hosts, ``num_gpus`` uses slots
    ``[0, N)`` of each host. Host order is kept; hosts left with no slot are dropped."""
    if include and exclude:
        raise ResourceError("--include and --exclude are mutually exclusive; use one of them")
    if (include or exclude) and (num_nodes > 0 or num_gpus > 0):
        raise ResourceError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    if include:
        chosen = parse_node_specs(include, "--include")
        _check_known(pool, chosen, "--include")
        active = {h: list(pool[h]) if chosen[h] is None else chosen[h] for h in pool if h in chosen}
    elif exclude:
        dropped = parse_node_specs(exclude, "--exclude")
        _check_known(pool, dropped, "--exclude")
        active = {}
        for host, slots in pool.items():
            if host in dropped:
                if dropped[host] is None:
                    continue
                slots = [s for s in slots if s not in dropped[host]]
            active[host] = list(slots)
    else:
        active = {h: list(s) for h, s in pool.items()}
        if num_nodes > 0:
            if num_nodes > len(active):
                raise ResourceError(
                    f"--num_nodes {num_nodes} but only {len(active)} host(s) are available"
                    + ("" if len(active) > 1 else "; list the nodes in a hostfile (--hostfile)")
                )
            active = dict(list(active.items())[:num_nodes])
        if num_gpus > 0:
            for host, slots in active.items():
                if num_gpus > len(slots):
                    raise ResourceError(
                        f"--num_gpus {num_gpus} but host {host!r} has only {len(slots)} slot(s)"
                    )
                active[host] = slots[:num_gpus]
    active = {h: s for h, s in active.items() if s}
    if not active:
        raise ResourceError("no slot is left to run on after --include/--exclude")
    return active


def resolve(
    hostfile: str,
    hostfile_given: bool,
    include: str,
    exclude: str,
    num_nodes: int,
    num_gpus: int,
    gpu_count: int,
) -> tuple[Resources, bool]:
    """The active resources for a launch and whether they came from a hostfile.

    A missing default hostfile means "this machine only"; a missing hostfile named by --hostfile is an error.
    """
    if os.path.isfile(hostfile):
        pool = read_hostfile(hostfile)
        return select(pool, include, exclude, num_nodes, num_gpus), True
    if hostfile_given:
        raise ResourceError(f"--hostfile {hostfile}: no such file")
    if num_nodes > 1:
        raise ResourceError(
            f"--num_nodes {num_nodes} needs other nodes, but there is no hostfile at {hostfile}; "
            "list them in a hostfile (--hostfile)"
        )
    if gpu_count == 0 and (include or exclude):
        raise ResourceError(
            "no GPU found and no hostfile: --include/--exclude select GPUs; "
            "use --num_gpus N for N CPU processes"
        )
    pool = local_pool(num_gpus, gpu_count, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return select(pool, include, exclude, num_nodes, num_gpus if gpu_count > 0 else -1), False
