"""The ``dsfunc`` launcher's flags: DeepSpeed's ``deepspeed`` command-line names and defaults."""

from __future__ import annotations

import argparse
import ipaddress
import re

from dsfunc.launcher.hangs import seconds

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_PORT = 29500  # DeepSpeed's (and torchrun's)
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")

_DESCRIPTION = """\
Launch a (multi-node) training job the way the `deepspeed` command does:
  dsfunc [launcher flags] script.py [script args]     every rank runs `python -u script.py --local_rank=N ...`
  dsfunc [launcher flags] --module pkg.mod [args]     python -m pkg.mod
  dsfunc [launcher flags] --no_python prog [args]     a program that is not Python
  dsfunc export ...                                    export a checkpoint (see `dsfunc export --help`)

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (and
CUDA_VISIBLE_DEVICES set to its node's selected GPUs). Without a hostfile the job runs on this machine: on its
GPUs, or, without GPUs, as --num_gpus N CPU processes (gloo). Each node runs PyTorch's elastic agent
(torch.distributed.run); one rank failing stops every rank and `dsfunc` exits with its code, naming the rank
that failed, left or hung first. A rank that waits in a collective for --collective_timeout seconds (600)
has the ranks it waits for named, with where they are, and stopped.
Variables named NCCL*, PYTHON*, UCX*, MLFLOW*, MV2* and the KEY=VALUE lines of .deepspeed_env and .dsfunc_env
(from the home and working directories) reach every rank."""


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser (DeepSpeed's flag names and defaults)."""
    p = argparse.ArgumentParser(
        prog="dsfunc", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_resource_flags(p)
    _add_runner_flags(p)
    _add_program_flags(p)
    return p


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _port(text: str) -> int:
    """A TCP port, 1-65535 (checked here: torch's rendezvous would fail with a traceback)."""
    port = _int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port; give one in 1-65535")
    return port


def _seconds(text: str) -> float:
    try:
        return seconds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Version(argparse.Action):
    """``--version``: dsfunc's version and the torch and Python it runs on, then exit."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print dsfunc's version (and torch's) and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        import platform

        import torch

        from dsfunc.version import package_version

        print(f"dsfunc {package_version()} (torch {torch.__version__}, Python {platform.python_version()})")
        parser.exit()


def _all_or_count(text: str) -> int:
    """DeepSpeed's counts: -1 for all, else at least 1 (0 would start nothing)."""
    count = _int(text)
    if count != -1 and count < 1:
        raise argparse.ArgumentTypeError(f"{count} starts nothing; give a count >= 1, or -1 (the default) for all")
    return count


def _address(text: str) -> str:
    """A host name or an IP address for the rendezvous (empty: dsfunc chooses)."""
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        if text and not _HOSTNAME.match(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is neither a host name nor an IP address (e.g. 10.0.0.1 or worker-0)"
            ) from None
    return text


def _add_resource_flags(p: argparse.ArgumentParser) -> None:
    """Where the ranks run: the hostfile and the filters on its hosts and slots."""
    p.add_argument(
        "-H",
        "--hostfile",
        default=None,
        help=f"MPI-style hostfile, lines 'HOST slots=N' (default {DEFAULT_HOSTFILE}; when that "
        "does not exist, this machine only)",
    )
    p.add_argument(
        "-i",
        "--include",
        default="",
        help="hosts/slots to use: NAME[:SLOT[,SLOT...]][@NAME...], e.g. 'worker-2:0,1@worker-3' "
        "or 'localhost:1'",
    )
    p.add_argument("-e", "--exclude", default="", help="hosts/slots to leave out (same grammar as --include)")
    p.add_argument("--num_nodes", type=_all_or_count, default=-1, help="use the first N hosts of the hostfile")
    p.add_argument(
        "--num_gpus",
        "--num_accelerators",
        type=_all_or_count,
        default=-1,
        help="use slots [0, N) of each node; without GPUs, run N CPU processes (gloo)",
    )


def _add_runner_flags(p: argparse.ArgumentParser) -> None:
    """How the nodes are reached and meet: rendezvous address, runner, ssh."""
    p.add_argument(
        "--master_addr",
        type=_address,
        default="",
        help="rendezvous address (default: 127.0.0.1 on one node, else the first node's "
        "`hostname -I` address)",
    )
    p.add_argument(
        "--master_port",
        type=_port,
        default=None,
        help=f"rendezvous port (default {DEFAULT_MASTER_PORT}; for a job on this machine alone, a free port when "
        f"{DEFAULT_MASTER_PORT} is in use)",
    )
    p.add_argument(
        "--launcher",
        type=str.lower,
        default=None,
        choices=["ssh", "pdsh", "openmpi", "slurm"],
        help="multi-node runner (default: ssh when the job spans several nodes or --force_multi). "
        "ssh/pdsh start PyTorch's elastic agent on each node; openmpi/slurm start every rank "
        "through mpirun/srun (ranks read by dsfunc.init_distributed)",
    )
    p.add_argument(
        "--launcher_args",
        default="",
        help="extra arguments for ssh/pdsh/mpirun/srun, one quoted string; write "
        "--launcher_args='--opt' when it starts with a dash (e.g. '--launcher_args=-F cfg')",
    )
    p.add_argument("--ssh_port", type=_port, default=None, help="ssh port of the nodes")
    p.add_argument(
        "--no_ssh_check", action="store_true", help="do not check that every node answers ssh first"
    )
    p.add_argument(
        "--no_ssh",
        action="store_true",
        help="run only this node's ranks (start `dsfunc --no_ssh --node_rank=K` on every node)",
    )
    p.add_argument(
        "--node_rank", type=int, default=-1, help="this node's index in the hostfile (with --no_ssh)"
    )
    p.add_argument("--force_multi", action="store_true", help="use the multi-node runner even for one node")
    p.add_argument(
        "--venv_script",
        default=None,
        help="a script each node sources before starting its ranks, e.g. a virtualenv's bin/activate "
        "(ssh and pdsh launchers)",
    )


def _add_program_flags(p: argparse.ArgumentParser) -> None:
    """What every rank runs and how: the target, its arguments, logs, restarts."""
    p.add_argument("--module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("--no_python", action="store_true", help="run the target directly, not through python")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    p.add_argument(
        "--save_pid",
        action="store_true",
        help="write this launcher's pid to /tmp/<pid>.dsfunc while the job runs",
    )
    p.add_argument(
        "--enable_each_rank_log",
        default="None",
        metavar="DIR",
        help="write each rank's stdout/stderr to DIR/<YYYYmmddHHMMSS>_rank<N>.log",
    )
    p.add_argument(
        "--bind_cores_to_rank",
        action="store_true",
        help="bind each rank to its own share of its node's CPU cores (and set OMP_NUM_THREADS to it)",
    )
    p.add_argument(
        "--bind_core_list",
        default=None,
        help="the cores to share out with --bind_cores_to_rank, e.g. 0,2-5 (default: every core this "
        "process may use)",
    )
    p.add_argument(
        "--log_level",
        type=str.lower,
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="the launcher's own messages shown: info (default) shows progress lines, warning or above only "
        "problems; failures are always reported",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="as --log_level error")
    p.add_argument(
        "--autotuning", default="", choices=["tune", "run"], help="DeepSpeed's autotuner: not supported by dsfunc"
    )
    p.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="restart the ranks up to N times after a failure (PyTorch elastic; single node)",
    )
    p.add_argument(
        "--collective_timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="when a rank has waited this long in a collective, stop the ranks it waits for (named, with "
        "where they are) and so the job; 0: never (default: DSFUNC_COLLECTIVE_TIMEOUT, else 600; "
        "torch.distributed's own timeout is 30 minutes)",
    )
    p.add_argument("--version", action=_Version)
    p.add_argument("user_script", help="the script (or module/program) every rank runs")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="its arguments")


def parse_launcher_args(argv: list[str]) -> argparse.Namespace:
    """Parse launcher flags; ``hostfile_given`` records whether --hostfile was passed explicitly."""
    args = build_parser().parse_args(argv)
    args.hostfile_given = args.hostfile is not None
    args.hostfile = args.hostfile or DEFAULT_HOSTFILE
    if args.max_restarts < 0:
        raise SystemExit("dsfunc: --max_restarts must be >= 0")
    if args.quiet:
        args.log_level = "error"
    return args
