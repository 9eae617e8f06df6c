"""Per-node agent: runs this node's ranks under PyTorch's elastic agent (``torch.distributed.run``).

``python -m dsfunc.launcher.node --world_info=B64 (--node_rank=N | --node_host=H) --master_addr=A
--master_port=P [--max_restarts=K] [--stop_on_stdin_eof] [--stop_on_parent_exit] -- [shim flags] TARGET
[ARGS ...]``

The multi-node runners start one of these per node (over ssh or pdsh); a single-node launch calls
:func:`run_node` in-process. Each rank runs :mod:`dsfunc.launcher.shim`, which adds ``--local_rank``. The
agent's exit clock (:mod:`dsfunc.launcher.exits`) orders the node's failures for the report
(:mod:`dsfunc.launcher.report`), and its hang watch (:mod:`dsfunc.launcher.hangs`) stops the ranks that
the others have waited for in a collective longer than ``DSFUNC_COLLECTIVE_TIMEOUT``.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time

from dsfunc.launcher.cores import THREADS_VARIABLE, threads_per_rank
from dsfunc.launcher.exits import CLOCK_VARIABLE, ExitClock
from dsfunc.launcher.hangs import HangWatch, collective_timeout
from dsfunc.launcher.report import exit_code_of, failure_report, first_failed
from dsfunc.launcher.resources import Resources, gpu_count
from dsfunc.launcher.shim import RANK_ARGS_VARIABLE, RankArgs, parse_rank_args
from dsfunc.launcher.supervise import say


def encode_world_info(resources: Resources) -> str:
    """``{host: [slots]}`` as URL-safe base64 JSON (DeepSpeed's ``--world_info`` encoding)."""
    return base64.urlsafe_b64encode(json.dumps(resources).encode()).decode()


def decode_world_info(text: str) -> Resources:
    """Inverse of :func:`encode_world_info`."""
    return {h: [int(s) for s in slots] for h, slots in json.loads(base64.urlsafe_b64decode(text)).items()}


def _stop_self_when(condition, poll: float | None) -> None:
    """Send SIGTERM to this process (the elastic agent then stops every rank) once ``condition()`` returns."""

    def watch() -> None:
        if poll is None:
            condition()
        else:
            while not condition():
                time.sleep(poll)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="dsfunc-node-watch").start()


def _stdin_closed() -> bool:
    while os.read(0, 4096):
        pass
    return True


class _StoreKeeper:
    """Keeps the rendezvous store of a multi-node job alive until every node's agent has left it.

    Node 0's elastic agent hosts the TCPStore and exits as soon as its own exit barrier returns, which can be
    before the last node's agent has read the barrier result ("Error waiting on exit barrier"). Node 0 creates
    the same store first (multi-tenant, so the agent shares it) and keeps it until every other node reports
    that its agent is done.
    """

    _KEY = "dsfunc/nodes_done"

    def __init__(self, addr: str, port: int, node_rank: int, n_nodes: int) -> None:
        from torch.distributed import TCPStore

        self._addr, self._port, self._node_rank, self._n_nodes = addr, port, node_rank, n_nodes
        self._store = None
        if node_rank == 0:
            self._store = TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True)

    def finish(self, timeout_s: float = 10.0) -> None:
        """Node 0: wait (bounded) for the other nodes; other nodes: report that this node is done."""
        from torch.distributed import TCPStore

        if self._store is None:
            try:
                TCPStore(
                    self._addr,
                    self._port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=timeout_s),
                    multi_tenant=True,
                ).add(self._KEY, 1)
            except (RuntimeError, TimeoutError):
                pass  # node 0 is gone already: nothing left to keep alive
            return
        deadline = time.monotonic() + timeout_s
        while self._store.add(self._KEY, 0) < self._n_nodes - 1 and time.monotonic() < deadline:
            time.sleep(0.05)


def run_node(
    world: Resources,
    node_rank: int,
    rank_args: list[str],
    master_addr: str,
    master_port: int,
    max_restarts: int = 0,
) -> int:
    """Run node ``node_rank``'s ranks of ``world`` until they finish; return the exit code (0 on success,
    the first failing rank's code on failure, 128+signal when stopped by a signal).

    ``rank_args`` is what :mod:`dsfunc.launcher.shim` gets: ``[shim flags] TARGET [ARGS ...]``.
    """
    from torch.distributed import DistNetworkError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    hosts = list(world)
    slots = world[hosts[node_rank]]
    rank = parse_rank_args(rank_args)
    missing = rank.missing_target()
    if missing is not None:  # before any rank starts
        print(f"dsfunc: error: on {hosts[node_rank]}, {missing}", file=sys.stderr, flush=True)
        return 2
    if gpu_count() > 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    _default_threads(len(slots), rank)
    # DeepSpeed's launcher also tells each rank its node's index, the node count and the node's rank count.
    os.environ.update(CROSS_RANK=str(node_rank), CROSS_SIZE=str(len(hosts)), LOCAL_SIZE=str(len(slots)))
    argv = [
        f"--nnodes={len(hosts)}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={len(slots)}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        "--rdzv_backend=static",
        f"--max_restarts={max_restarts}",
        "--monitor_interval=0.1",
        "--module",
        "dsfunc.launcher.shim",
    ]
    # The rank's own arguments travel in the environment: torchrun's parser would reject script flags that
    # abbreviate one of its options (e.g. `--log`, `--max`).
    os.environ[RANK_ARGS_VARIABLE] = json.dumps(list(rank_args))
    clock = ExitClock()
    os.environ[CLOCK_VARIABLE] = clock.path
    watch = HangWatch(clock, collective_timeout(os.environ), hosts[node_rank])
    for log in _AGENT_LOGS:
        log.addFilter(_drop_agent_news)
    try:
        keeper = _StoreKeeper(master_addr, master_port, node_rank, len(hosts)) if len(hosts) > 1 else None
        torchrun.run(torchrun.parse_args(argv))
        if keeper is not None:
            keeper.finish()
    except ChildFailedError as e:
        failures, states = e.failures, clock.ranks()
        first_rank = sum(len(world[h]) for h in hosts[:node_rank])
        print(failure_report(failures, hosts[node_rank], states, first_rank), file=sys.stderr, flush=True)
        return exit_code_of(failures, first_failed(failures, states)[0], states)
    except DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        print(f"dsfunc: error: the rendezvous port {master_port} is in use on {hosts[node_rank]} (another job, or "
              "one still stopping); pass another --master_port, or, for a job on this machine alone, leave "
              "--master_port out to use a free one", file=sys.stderr, flush=True)
        return 2
    except SignalException as e:
        say(f"interrupted by {signal.Signals(e.sigval).name}: every rank of {hosts[node_rank]} stopped", "warning")
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        say(f"interrupted: every rank of {hosts[node_rank]} stopped", "warning")
        return 128 + int(signal.SIGINT)
    finally:
        for log in _AGENT_LOGS:
            log.removeFilter(_drop_agent_news)
        os.environ.pop(CLOCK_VARIABLE, None)
        watch.close()
        clock.close()
    return 0


# torch elastic's agent logs which rank it believes failed first ("failed (exitcode: 1) local_rank: 0"),
# by its whole-second timestamps (failure_report says which one did: [Note: which rank failed first]), and
# each signal it sends or gets while stopping the ranks (the report, or the line on an interrupt, says so).
_AGENT_LOGS = [logging.getLogger("torch.distributed.elastic.multiprocessing.api"),
               logging.getLogger("torch.distributed.elastic.agent.server.api")]
_AGENT_NEWS = ("failed (exitcode:", "Sending process %s closing signal", "Received %s death signal")


def _drop_agent_news(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_AGENT_NEWS)


def _default_threads(local_size: int, rank: RankArgs) -> None:
    """OMP_NUM_THREADS for this node's ranks unless the user set it: cores shared out (:mod:`.cores`), in
    one line of ours instead of torch elastic's warning (which it prints when it sets 1 itself)."""
    if THREADS_VARIABLE in os.environ or (local_size == 1 and not rank.bind_cores):
        return
    threads = threads_per_rank(local_size, rank.bind_cores, rank.core_list)
    os.environ[THREADS_VARIABLE] = str(threads)
    say(f"{THREADS_VARIABLE}={threads} for each of {local_size} local rank(s) "
        f"({len(os.sched_getaffinity(0))} CPU cores here); set {THREADS_VARIABLE} to choose another value")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m dsfunc.launcher.node`` (started on each node by the multi-node runners)."""
    parser = argparse.ArgumentParser(prog="python -m dsfunc.launcher.node")
    parser.add_argument("--world_info", required=True)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--node_rank", type=int, help="this node's index in the world info")
    which.add_argument("--node_host", help="this node's host name as listed in the world info (pdsh's %%h)")
    parser.add_argument("--master_addr", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--max_restarts", type=int, default=0)
    parser.add_argument(
        "--stop_on_stdin_eof",
        action="store_true",
        help="stop every rank when stdin closes (the launcher's ssh went away or asked to stop)",
    )
    parser.add_argument(
        "--stop_on_parent_exit",
        action="store_true",
        help="stop every rank when the parent process (the remote shell's sshd) exits",
    )
    parser.add_argument("rank_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    rank_args = args.rank_args[1:] if args.rank_args[:1] == ["--"] else args.rank_args
    if args.stop_on_stdin_eof:
        _stop_self_when(_stdin_closed, poll=None)
    if args.stop_on_parent_exit:
        parent = os.getppid()
        _stop_self_when(lambda: os.getppid() != parent, poll=0.5)
    world = decode_world_info(args.world_info)
    if args.node_host is not None and args.node_host not in world:
        parser.error(f"--node_host {args.node_host!r} is not one of the job's hosts ({', '.join(world)})")
    node_rank = list(world).index(args.node_host) if args.node_host is not None else args.node_rank
    sys.exit(run_node(world, node_rank, rank_args, args.master_addr, args.master_port, args.max_restarts))


if __name__ == "__main__":
    main()
