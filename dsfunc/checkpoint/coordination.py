"""How the ranks of a save or load meet, agree and fail together.

**Every rank must call** :func:`save_checkpoint` and :func:`load_checkpoint` (a save with a different tag on
some rank is saved under rank 0's, with a warning, as the config's ``checkpoint.tag_validation`` says). Ranks meet
through the process group's store before anything else (:func:`arrive`): one that does not arrive within
``timeout`` seconds is named in a :class:`CheckpointTimeoutError` on every rank that did, instead of a hang.
After that, checkpoint traffic runs on a gloo side group, never on the training group, and a step that
fails on one rank raises on all of them (:func:`collective`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh

from dsfunc.checkpoint.errors import BY_NAME, CheckpointError, CheckpointTagError, CheckpointTimeoutError
from dsfunc.distributed import comm

T = TypeVar("T")
logger = logging.getLogger("dsfunc")


@dataclasses.dataclass
class _Side:
    """The gloo side group of one default process group, and DeviceMeshes over it by device type."""

    world: Any
    group: dist.ProcessGroup
    meshes: dict[str, DeviceMesh]


_SIDE: _Side | None = None
_CALLS: tuple[Any, Iterator[int]] | None = None  # (default group, count of checkpoint calls made in it)


def _side() -> _Side:
    global _SIDE
    world = dist.group.WORLD
    if _SIDE is None or _SIDE.world is not world:
        if _SIDE is None:
            atexit.register(_release)  # after init_distributed's: runs before it destroys the default group
        _SIDE = _Side(world, dist.new_group(backend="gloo"), {})
    return _SIDE


def _release() -> None:
    """At exit, destroy the side group and let go of the process groups held here, while the interpreter
    is alive: a gloo group still referenced when the interpreter finalizes is freed during finalization,
    which aborts the process ("terminate called without an active exception") after a run that saved."""
    global _SIDE, _CALLS
    side, _SIDE, _CALLS = _SIDE, None, None
    if side is not None and dist.is_initialized() and side.world is dist.group.WORLD:
        dist.destroy_process_group(side.group)


def side_group() -> dist.ProcessGroup:
    """The gloo group that checkpoint collectives (and DCP's) run on, made once per default group."""
    return _side().group


def mesh(device_type: str, over: comm.Group) -> DeviceMesh:
    """A DeviceMesh for DTensors of ``device_type`` over ``over`` (the ranks a unit is sharded over): over
    :func:`side_group` when that is the world (its collectives then stay off the training group), else over
    ``over``'s own group (a pipeline stage's data-parallel ranks)."""
    side = _side()
    group = None if over.process_group is None or over.size == comm.world_size() else over.process_group
    key = device_type if group is None else f"{device_type}/{id(group)}"
    if key not in side.meshes:
        side.meshes[key] = DeviceMesh.from_group(side.group if group is None else group, device_type)
    return side.meshes[key]


def _next_call() -> int:
    """This process's number for the current checkpoint call (the same on every rank that makes it)."""
    global _CALLS
    if _CALLS is None or _CALLS[0] is not dist.group.WORLD:
        _CALLS = (dist.group.WORLD, itertools.count())
    return next(_CALLS[1])


def arrive(op: str, tag: str | None, timeout: float, tag_validation: str = "FAIL") -> str | None:
    """Wait until every rank has called ``op``; raise on every rank that arrived if not. Returns the tag to use:
    rank 0's. Ranks that gave other tags raise :class:`CheckpointTagError` under ``tag_validation`` "FAIL",
    are named in a warning under "WARN", and pass silently under "IGNORE" (DeepSpeed's
    ``checkpoint.tag_validation``).

    [Note: meeting before the first collective]
    A collective that one rank never joins hangs the others (DeepSpeed's hang when only rank 0 saves), so
    the ranks meet first through the store, which has a timeout. Each rank posts its call under this call's
    number (the count of checkpoint calls it made) and waits for the others' posts. Whoever finishes waiting
    first records the outcome (``ok``, or who gave up on which ranks) with an atomic compare-and-set, so a
    rank that arrives after the others gave up raises too instead of waiting for ranks that left. Only once
    every rank has arrived with the same call does any collective run.
    """
    if not comm.is_distributed():
        return tag
    world, rank = comm.world_size(), comm.rank()
    # the default group's store (no public accessor): reachable even by ranks that never call this
    store = dist.PrefixStore("dsfunc/checkpoint", dist.distributed_c10d._get_default_store())
    call = _next_call()
    keys = [f"{call}/rank{r}" for r in range(world)]
    store.set(keys[rank], json.dumps([op, tag]))
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
        outcome = "ok"
    except dist.DistStoreError:
        missing = [r for r in range(world) if not store.check([keys[r]])]
        outcome = json.dumps({"rank": rank, "timeout": timeout, "missing": missing})
    decided = store.compare_set(f"{call}/outcome", "", outcome).decode()
    if decided != "ok":
        raise CheckpointTimeoutError(_timeout_text(store, keys, json.loads(decided), op, tag, timeout))
    calls = [json.loads(store.get(k)) for k in keys]
    _read_by_all(store, call, world, rank, timeout)
    described = "; ".join(f"rank {r}: {o}(tag={t!r})" for r, (o, t) in enumerate(calls))
    if any(o != calls[0][0] for o, _ in calls):
        raise CheckpointError(f"the ranks made different checkpoint calls ({described}); every rank must "
                              "make the same call with the same tag")
    if any(t != calls[0][1] for _, t in calls):
        if tag_validation == "FAIL":
            raise CheckpointTagError(f"the ranks gave different checkpoint tags ({described}); give every rank "
                                     "the same tag (a tag with the rank in it cannot be loaded at another "
                                     "world size)")
        if tag_validation == "WARN" and rank == 0:
            logger.warning("the ranks gave different checkpoint tags (%s): saving under rank 0's, %r. Give every "
                           'rank the same tag, or set "checkpoint": {"tag_validation": "Ignore"} to be quiet.',
                           described, calls[0][1])
    return calls[0][1]


def _read_by_all(store: dist.Store, call: int, world: int, rank: int, timeout: float) -> None:
    """Rank 0 goes on only once every rank has read the posts. Rank 0 may host the store: when the call then
    raises (different tags) and rank 0's process ends first, a rank still reading got a connection reset instead
    of the error. A rank that does not say it read within ``timeout`` died after the meeting; what it runs next
    fails on its own, so rank 0 goes on."""
    store.set(f"{call}/read{rank}", "")
    if rank == 0:
        with contextlib.suppress(dist.DistStoreError):
            store.wait([f"{call}/read{r}" for r in range(world)], datetime.timedelta(seconds=timeout))


def _timeout_text(store: dist.Store, keys: list[str], gave_up: dict[str, Any], op: str, tag: str | None,
                  timeout: float) -> str:
    """Why this rank's call failed: it waited for ranks that did not come, or it came after one gave up."""
    world, missing = len(keys), ", ".join(map(str, gave_up["missing"]))
    if comm.rank() in gave_up["missing"]:
        their_op, their_tag = json.loads(store.get(keys[gave_up["rank"]]))
        told = (f"rank {gave_up['rank']} called {their_op}(tag={their_tag!r}) and gave up after "
                f"{gave_up['timeout']:g} s waiting for rank(s) {missing} of {world}; this rank's "
                f"{op}(tag={tag!r}) came too late")
    else:
        told = (f"{op}(tag={tag!r}) waited {timeout:g} s for rank(s) {missing} of {world}, which did "
                "not call it")
    return (f"{told}. Every rank must make the same checkpoint calls in the same order (a call under "
            f"`if rank == 0:` leaves the others behind); if a rank is just slow, pass a larger timeout=.")


def collective(fn: Callable[[], T], *, src: int | None = None, gather: bool = False) -> Any:
    """Run ``fn`` on every rank; if it raised anywhere, raise on every rank (the failing rank's error class,
    or the public class it derives from).

    Returns this rank's result, rank ``src``'s (``src=``), or every rank's in a list (``gather=True``).
    """
    error: Exception | None = None
    try:
        result, failure = fn(), None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank learns of it below and raises
        error, result = e, None
        failure = (next(c.__name__ for c in type(e).__mro__ if c.__name__ in BY_NAME), str(e)) \
            if isinstance(e, CheckpointError) else ("CheckpointError", f"{type(e).__name__}: {e}")
    if comm.is_distributed():
        replies: list[Any] = [None] * comm.world_size()
        shared = result if src is not None or gather else None
        dist.all_gather_object(replies, (shared, failure), group=side_group())
    else:
        replies = [(result, failure)]
    failed = {r: f for r, (_, f) in enumerate(replies) if f is not None}
    if failed:
        messages = {m for _, m in failed.values()}
        text = (messages.pop() if len(messages) == 1
                else "; ".join(f"rank {r}: {m}" for r, (_, m) in failed.items()))
        raise BY_NAME[next(iter(failed.values()))[0]](text) from error
    if gather:
        return [r for r, _ in replies]
    return replies[src][0] if src is not None else result
