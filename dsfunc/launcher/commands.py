"""The commands each runner executes: per-node agents over ssh or pdsh, or all ranks through mpirun or srun.

These functions only build argv lists and environments; :mod:`dsfunc.launcher.run` executes them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys

from dsfunc.errors import Error
from dsfunc.launcher.node import encode_world_info
from dsfunc.launcher.resources import Resources


class LauncherError(Error, ValueError):
    """The requested launch cannot be carried out as asked (message says why and what to do)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """Everything a runner needs to start a job.

    ``rank_args`` is what :mod:`dsfunc.launcher.shim` receives: ``[--no_local_rank] [--module|--no_python]
    [--bind_cores_to_rank [--bind_core_list=L]] TARGET [ARGS ...]``; ``exports`` is the environment every
    rank gets on top of its node's own.
    """

    resources: Resources
    rank_args: list[str]
    master_addr: str
    master_port: int
    exports: dict[str, str]
    launcher_args: list[str] = dataclasses.field(default_factory=list)
    max_restarts: int = 0
    cwd: str = dataclasses.field(default_factory=os.getcwd)
    venv_script: str | None = None  # sourced by each node's shell before its agent starts (ssh, pdsh)
    python: str = dataclasses.field(default_factory=lambda: os.environ.get("PYTHON_EXEC", sys.executable))

    @property
    def hosts(self) -> list[str]:
        return list(self.resources)

    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.resources.values())


def node_agent_argv(launch: Launch, node: str, stop_flags: list[str]) -> list[str]:
    """``python -u -m dsfunc.launcher.node ...`` for one node; ``node`` is ``--node_rank=K`` or
    ``--node_host=H`` (H may be a runner placeholder)."""
    return [
        launch.python,
        "-u",
        "-m",
        "dsfunc.launcher.node",
        f"--world_info={encode_world_info(launch.resources)}",
        node,
        f"--master_addr={launch.master_addr}",
        f"--master_port={launch.master_port}",
        f"--max_restarts={launch.max_restarts}",
        *stop_flags,
        "--",
        *launch.rank_args,
    ]


def remote_shell_command(launch: Launch, agent_argv: list[str]) -> str:
    """A shell line for a remote node: same working directory, the exported environment, then the agent."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch.exports.items())
    prefix = f"export {exports}; " if exports else ""
    venv = f". {shlex.quote(launch.venv_script)} && " if launch.venv_script else ""
    return f"cd {shlex.quote(launch.cwd)} && {venv}{prefix}exec {shlex.join(agent_argv)}"


def ssh_commands(launch: Launch) -> list[list[str]]:
    """One ``ssh HOST <remote command>`` per node. The remote agent stops its ranks when ssh's stdin closes
    (which is how the launcher asks a node to stop) or when the ssh session dies."""
    commands = []
    for rank, host in enumerate(launch.hosts):
        agent = node_agent_argv(
            launch, f"--node_rank={rank}", ["--stop_on_stdin_eof", "--stop_on_parent_exit"]
        )
        commands.append(["ssh", *launch.launcher_args, host, remote_shell_command(launch, agent)])
    return commands


def pdsh_command(launch: Launch) -> tuple[list[str], dict[str, str]]:
    """``pdsh -S -f 1024 -w HOSTS ...`` running the agent on every node (each finds its rank from its host
    name, pdsh's ``%h``), and the variables pdsh itself needs (``PDSH_RCMD_TYPE=ssh``)."""
    agent = node_agent_argv(launch, "--node_host=%h", ["--stop_on_parent_exit"])
    argv = [
        "pdsh",
        "-S",
        "-f",
        "1024",
        "-w",
        ",".join(launch.hosts),
        *launch.launcher_args,
        remote_shell_command(launch, agent),
    ]
    return argv, {"PDSH_RCMD_TYPE": "ssh"}


def _uniform_prefix_slots(launch: Launch, runner: str) -> None:
    for host, slots in launch.resources.items():
        if slots != list(range(len(slots))):
            raise LauncherError(
                f"the {runner} launcher starts N ranks per node and cannot pick particular slots "
                f"({host}: {','.join(map(str, slots))}); select whole hosts or use --num_gpus, "
                "or use the ssh launcher"
            )


def rank_env(launch: Launch) -> dict[str, str]:
    """What MPI/slurm ranks must get besides their rank variables: the exports and the rendezvous address."""
    return {**launch.exports, "MASTER_ADDR": launch.master_addr, "MASTER_PORT": str(launch.master_port)}


def openmpi_command(launch: Launch, hostfile: str) -> list[str]:
    """``mpirun`` starting every rank directly (no per-node agent; ranks come from MPI). ``hostfile`` must
    list the active hosts with their slot counts (:func:`mpi_hostfile_text`)."""
    _uniform_prefix_slots(launch, "openmpi")
    exports = [a for k, v in rank_env(launch).items() for a in ("-x", f"{k}={v}")]
    return [
        "mpirun",
        "-n",
        str(launch.world_size),
        "--hostfile",
        hostfile,
        *exports,
        *launch.launcher_args,
        launch.python,
        "-u",
        "-m",
        "dsfunc.launcher.shim",
        *launch.rank_args,
    ]


def mpi_hostfile_text(resources: Resources) -> str:
    """An MPI hostfile for the active resources."""
    return "".join(f"{host} slots={len(slots)}\n" for host, slots in resources.items())


def slurm_command(launch: Launch, hosts_from_hostfile: bool) -> tuple[list[str], dict[str, str]]:
    """``srun`` starting every rank directly, and the variables to add to srun's environment (srun passes
    its whole environment to the ranks with ``--export=ALL``). A rank failing kills the step."""
    _uniform_prefix_slots(launch, "slurm")
    counts = {len(s) for s in launch.resources.values()}
    argv = ["srun", f"--nodes={len(launch.hosts)}", f"--ntasks={launch.world_size}"]
    if len(counts) == 1:
        argv.append(f"--ntasks-per-node={counts.pop()}")
    if hosts_from_hostfile:
        argv.append(f"--nodelist={','.join(launch.hosts)}")
    argv += [
        "--kill-on-bad-exit=1",
        "--export=ALL",
        *launch.launcher_args,
        launch.python,
        "-u",
        "-m",
        "dsfunc.launcher.shim",
        *launch.rank_args,
    ]
    return argv, rank_env(launch)
