"""Per-rank entry point: completes the rank variables, adds ``--local_rank=N`` and runs the user's program.

``python -m dsfunc.launcher.shim [--no_local_rank] [--module | --no_python] [--bind_cores_to_rank
[--bind_core_list=LIST]] TARGET [ARGS ...]``

Under PyTorch's elastic agent the rank variables are already set. Under ``mpirun`` or ``srun`` they are
derived from ``OMPI_COMM_WORLD_*`` or ``SLURM_*`` (:mod:`dsfunc.distributed.env`), so every rank sees RANK,
LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE whatever launched it. With ``--bind_cores_to_rank`` the rank
binds itself to its share of the node's cores (:mod:`dsfunc.launcher.cores`) before the program starts.
Every rank runs with ``DSFUNC_AS_DEEPSPEED=1`` (``import deepspeed`` is dsfunc, :mod:`dsfunc_as_deepspeed`).
With ``DSFUNC_RANK_LOG_DIR`` set, the rank's stdout and stderr go to
``<dir>/<DSFUNC_LAUNCH_STAMP>_rank<RANK>.log`` (DeepSpeed's ``--enable_each_rank_log`` layout).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import io
import json
import os
import runpy
import sys
import threading
import time
import traceback
from typing import NoReturn

import dsfunc_as_deepspeed
from dsfunc.distributed.env import rank_env_from_launcher
from dsfunc.errors import Error
from dsfunc.launcher.cores import check_cores_here, rank_cores
from dsfunc.launcher.exits import exit_code, report_exit, report_start
from dsfunc.launcher.hangs import raised_in_collective, sample_waits


def _redirect_output(log_dir: str, stamp: str, rank: str) -> None:
    os.makedirs(log_dir, exist_ok=True)
    fd = os.open(
        os.path.join(log_dir, f"{stamp}_rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


_LAUNCHER_FILES = (__file__, runpy.__file__, "<frozen runpy>")  # the frames a traceback or stack leaves out
_DSFUNC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_traceback(error: BaseException) -> str:
    """``error``'s traceback without the leading frames of this shim and of runpy, so that it starts in user
    code; for one of dsfunc's own errors (which say what is wrong and what to do), without dsfunc's frames
    below the user's call either."""
    tb = error.__traceback__
    while tb.tb_next is not None and tb.tb_frame.f_code.co_filename in _LAUNCHER_FILES:
        tb = tb.tb_next
    chained = error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__)
    if not isinstance(error, Error) or chained:
        return "".join(traceback.format_exception(type(error), error, tb))
    entries = traceback.extract_tb(tb)
    while len(entries) > 1 and entries[-1].filename.startswith(_DSFUNC_DIR):
        entries.pop()
    return "".join(["Traceback (most recent call last):\n", *traceback.format_list(entries),
                    *traceback.format_exception_only(type(error), error)])


def _record_and_exit(error: Exception, show: bool) -> None:
    """Print the user's traceback (``show``) and exit 1, as Python would; when PyTorch's elastic agent started
    this rank, also write the error file (``TORCHELASTIC_ERROR_FILE``) from which the agent reports the
    failing rank."""
    text = _user_traceback(error)
    if show:
        sys.stderr.write(text)
        sys.stderr.flush()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        data = {
            "message": {
                "message": f"{type(error).__name__}: {error}",
                "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
            }
        }
        with open(path, "w") as f:
            json.dump(data, f)
    sys.exit(1)


def _run(mode: str, target: str, argv: list[str], agent_reports: bool) -> None:
    """Run the program; with ``agent_reports`` (dsfunc's node agent prints the failure report), an uncaught
    error's traceback is left to that report, which prints it once for all ranks, and Ctrl-C ends the rank
    with code 130 and no traceback."""
    if mode == "no_python":
        os.execvp(target, argv)
    sys.argv = argv
    try:
        if mode == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except Exception as error:  # noqa: BLE001 - reported like an uncaught exception
        report_exit(exit_code(error), raised_in_collective(error))
        _record_and_exit(error, show=not agent_reports)
    except BaseException as error:  # sys.exit, KeyboardInterrupt: the program ends here, before the interpreter
        report_exit(exit_code(error))
        if agent_reports and isinstance(error, KeyboardInterrupt):
            sys.exit(exit_code(error))
        raise
    report_exit(0)
    _leave_together()
    end_process()


def _leave_together() -> None:
    """After a program that ended well, end the process group the program left open, every rank together, so
    that no rank's collective is left waiting on a peer that has gone."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.barrier()
        dist.destroy_process_group()
    except RuntimeError:  # a peer failed meanwhile: the launcher reports that rank and stops this one
        return


def end_process() -> NoReturn:
    """End a process whose program ended well (exit code 0) as the interpreter would, less its finalization.

    [Note: ending without finalization] A process group that is still referenced (an engine keeps its
    DeviceMesh, whose registry holds the groups) keeps gloo's worker threads alive to the end, and each drops its
    last collective's work some time after the collective returned. The drop releases Python tensors, so the
    thread takes the GIL; if the interpreter has begun finalizing by then, CPython 3.11-3.13 ends that thread
    with ``pthread_exit``, whose unwinding through gloo's ``noexcept`` loop calls ``std::terminate``: "terminate
    called without an active exception" and SIGABRT after all the work (seen in a core dump of a rank under
    load). So the rank does here what the interpreter's exit would do (join the program's non-daemon threads,
    run the ``atexit`` handlers, flush every open file) and leaves with ``os._exit`` while those threads are
    harmless. Objects' ``__del__`` does not run, which Python never promises at exit."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the handlers the interpreter's exit would run, in its order
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            with contextlib.suppress(Exception):  # closed, detached or read-only: nothing to write
                if not obj.closed:
                    obj.flush()
    os._exit(0)


RANK_ARGS_VARIABLE = "DSFUNC_RANK_ARGS"  # how the per-node agent passes this rank's arguments


@dataclasses.dataclass(frozen=True)
class RankArgs:
    """What every rank runs and how (the shim's flags, then the target and its arguments)."""

    target: str
    user_args: list[str]
    mode: str = "script"  # or "module", "no_python"
    local_rank_flag: bool = True
    bind_cores: bool = False
    core_list: str | None = None

    def missing_target(self) -> str | None:
        """Why the target cannot run here (a script that is not there), or None; modules and programs are
        found only when the rank starts them."""
        if self.mode != "script" or os.path.isfile(self.target):
            return None
        return (f"the script {self.target!r} does not exist (working directory {os.getcwd()}); for a module "
                "pass --module, for a program that is not Python --no_python")


def parse_rank_args(args: list[str]) -> RankArgs:
    """``[shim flags] TARGET [ARGS ...]`` (see the module docstring)."""
    args = list(args)
    options: dict[str, object] = {}
    while args and (args[0] in ("--no_local_rank", "--module", "--no_python", "--bind_cores_to_rank")
                    or args[0].startswith("--bind_core_list=")):
        flag = args.pop(0)
        if flag == "--no_local_rank":
            options["local_rank_flag"] = False
        elif flag == "--bind_cores_to_rank":
            options["bind_cores"] = True
        elif flag.startswith("--bind_core_list="):
            options["core_list"] = flag.split("=", 1)[1]
        else:
            options["mode"] = flag[2:]
    if not args:
        raise SystemExit("dsfunc.launcher.shim: no program to run")
    return RankArgs(args[0], args[1:], **options)


def main(args: list[str] | None = None) -> None:
    """Run the rank described by ``args`` (see the module docstring)."""
    if args is None:
        args = json.loads(os.environ.pop(RANK_ARGS_VARIABLE)) if len(sys.argv) == 1 else sys.argv[1:]
    rank = parse_rank_args(args)
    os.environ.update(rank_env_from_launcher(dict(os.environ)))
    os.environ[dsfunc_as_deepspeed.VARIABLE] = "1"  # every rank, and what it starts, imports dsfunc as deepspeed
    dsfunc_as_deepspeed.install()
    # [Note: which rank failed first] (dsfunc.launcher.exits), [Note: naming a hung rank] (dsfunc.launcher.hangs)
    connection = report_start(os.environ["RANK"])
    sample_waits(connection, _LAUNCHER_FILES)
    if rank.bind_cores:
        check_cores_here(rank.core_list)
        os.sched_setaffinity(0, rank_cores(rank.core_list, int(os.environ["LOCAL_RANK"]),
                                           int(os.environ["LOCAL_WORLD_SIZE"])))
    if os.environ.get("DSFUNC_RANK_LOG_DIR"):
        _redirect_output(
            os.environ["DSFUNC_RANK_LOG_DIR"],
            os.environ.get("DSFUNC_LAUNCH_STAMP", "run"),
            os.environ["RANK"],
        )
    missing = rank.missing_target()
    if missing is not None:
        raise SystemExit(f"dsfunc: {missing}")
    local_rank = [f"--local_rank={os.environ['LOCAL_RANK']}"] if rank.local_rank_flag else []
    agent_reports = (connection is not None and bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))
                     and not os.environ.get("DSFUNC_RANK_LOG_DIR"))
    _run(rank.mode, rank.target, [rank.target, *local_rank, *rank.user_args], agent_reports)


if __name__ == "__main__":
    main()
