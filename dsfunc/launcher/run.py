"""The launcher proper: decide where ranks run and start them with the chosen runner.

A single-node job runs PyTorch's elastic agent in this process. A multi-node job starts one agent per node
over ssh (or pdsh), or every rank through mpirun or srun, and :mod:`dsfunc.launcher.supervise` watches
them: one node failing stops the others; SIGINT/SIGTERM stop every node; the exit code is the failing
rank's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from dsfunc.errors import InputError
from dsfunc.launcher import commands
from dsfunc.launcher.commands import Launch, LauncherError
from dsfunc.launcher.cores import check_cores_here, parse_core_list, rank_cores
from dsfunc.launcher.environment import exported_env
from dsfunc.launcher.flags import DEFAULT_MASTER_PORT
from dsfunc.launcher.hangs import TIMEOUT_VARIABLE, collective_timeout
from dsfunc.launcher.node import run_node
from dsfunc.launcher.resources import Resources, gpu_count, resolve
from dsfunc.launcher.supervise import (
    LOG_LEVEL_VARIABLE,
    close_stdin,
    say,
    supervise_nodes,
    supervise_pdsh,
    supervise_srun,
    terminate,
)


def _rank_args(args: argparse.Namespace) -> list[str]:
    """What each rank's shim gets (:func:`dsfunc.launcher.shim.parse_rank_args` reads it back)."""
    flags = ["--no_local_rank"] if args.no_local_rank else []
    flags += ["--module"] if args.module else ["--no_python"] if args.no_python else []
    flags += ["--bind_cores_to_rank"] if args.bind_cores_to_rank else []
    flags += [f"--bind_core_list={args.bind_core_list}"] if args.bind_core_list is not None else []
    return [*flags, args.user_script, *args.user_args]


def _check_flags(args: argparse.Namespace, runner: str, resources: Resources) -> None:
    """DeepSpeed's flags that dsfunc refuses, or that cannot work as given, before anything starts."""
    if args.autotuning:
        raise LauncherError("--autotuning: DeepSpeed's autotuner is not supported by dsfunc; remove the flag")
    if args.venv_script is not None and runner not in ("ssh", "pdsh"):
        raise LauncherError(
            f"--venv_script applies to the ssh and pdsh launchers, whose nodes start a shell (this job runs via "
            f"{runner}); activate the environment before starting dsfunc instead"
        )
    if args.bind_core_list is not None and not args.bind_cores_to_rank:
        raise LauncherError("--bind_core_list lists the cores for --bind_cores_to_rank; pass that flag too")
    if args.bind_cores_to_rank:
        try:  # the cores of this machine are the job's only when it runs here; each node checks its own
            if runner == "local":
                check_cores_here(args.bind_core_list)
                rank_cores(args.bind_core_list, 0, max(len(s) for s in resources.values()))
            elif args.bind_core_list is not None:
                parse_core_list(args.bind_core_list)
        except InputError as e:
            raise LauncherError(str(e)) from None
    if runner == "openmpi":
        _check_mpirun_as_root(shlex.split(args.launcher_args))


def _check_mpirun_as_root(launcher_args: list[str]) -> None:
    """Open MPI's mpirun refuses to start as root unless told it may: say how before it fails."""
    allowed = "--allow-run-as-root" in launcher_args or (
        os.environ.get("OMPI_ALLOW_RUN_AS_ROOT") == "1" and os.environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM") == "1"
    )
    if os.geteuid() != 0 or allowed or shutil.which("mpirun") is None:
        return
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=60, check=False)
    if "Open MPI" in version.stdout + version.stderr:
        raise LauncherError(
            "you are root, and Open MPI's mpirun refuses to run as root unless told it may: pass "
            "--launcher_args=--allow-run-as-root (or set OMPI_ALLOW_RUN_AS_ROOT=1 and "
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1), or launch as another user"
        )


def _ssh_reachable(ssh_args: list[str], hosts: list[str]) -> None:
    def probe(host: str) -> tuple[str, subprocess.CompletedProcess]:
        cmd = ["ssh", "-o", "PasswordAuthentication=no", "-o", "ConnectTimeout=10", *ssh_args, host, "true"]
        return host, subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False
        )

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        failed = [(h, r) for h, r in pool.map(probe, hosts) if r.returncode != 0]
    if failed:
        details = "; ".join(f"{h}: {r.stderr.strip() or f'exit code {r.returncode}'}" for h, r in failed)
        raise LauncherError(
            f"cannot reach {', '.join(h for h, _ in failed)} with passwordless ssh ({details}). "
            "Set up ssh keys, "
            "pass ssh options with --launcher_args (pdsh: PDSH_SSH_ARGS_APPEND), or skip this check with "
            "--no_ssh_check"
        )


def infer_master_addr(ssh_args: list[str], host: str) -> str:
    """The first address ``hostname -I`` reports on ``host`` (reached over ssh), as DeepSpeed does."""
    result = subprocess.run(
        ["ssh", *ssh_args, host, "hostname -I"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0 or not result.stdout.split():
        raise LauncherError(
            f"could not find the address of the first node {host!r} (ssh {host} hostname -I: "
            f"{result.stderr.strip() or 'no output'}); pass --master_addr"
        )
    return result.stdout.split()[0]


def _slurm_first_host() -> str | None:
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    result = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False
    )
    names = result.stdout.split()
    return names[0] if result.returncode == 0 and names else None


def _run_single(runner: str, proc_env: dict[str, str], cmd: list[str]) -> int:
    if shutil.which(cmd[0]) is None:
        raise LauncherError(f"launcher {runner!r} is not installed: {cmd[0]} is not on PATH")
    say(shlex.join(cmd))
    if runner == "pdsh":
        proc = subprocess.Popen(cmd, env=proc_env, start_new_session=True, stderr=subprocess.PIPE, text=True)
        return supervise_pdsh(proc)
    if runner == "slurm":
        return supervise_srun(subprocess.Popen(cmd, env=proc_env, start_new_session=True, stderr=subprocess.PIPE))
    proc = subprocess.Popen(cmd, env=proc_env, start_new_session=True)
    return supervise_nodes([proc], [cmd[0]], terminate)


def _collective_timeout(args: argparse.Namespace) -> float:
    """--collective_timeout, else the variable's value, else the default ([Note: naming a hung rank])."""
    if args.collective_timeout is not None:
        return args.collective_timeout
    try:
        return collective_timeout(os.environ)
    except ValueError as e:
        raise LauncherError(f"{TIMEOUT_VARIABLE}: {e}; set it to one, or unset it for the default") from None


def _choose_runner(args: argparse.Namespace, n_hosts: int) -> str:
    if args.no_ssh:
        return "local"
    if args.launcher in ("openmpi", "slurm"):
        return args.launcher
    if n_hosts > 1 or args.force_multi:
        return args.launcher or "ssh"
    return "local"


def _ssh_args(args: argparse.Namespace, runner: str) -> list[str]:
    """The job's ssh options (for the reachability probe and the nodes' ssh): ``-p`` from --ssh_port, then
    --launcher_args for the ssh runner; for pdsh, PDSH_SSH_ARGS_APPEND (there --launcher_args go to pdsh)."""
    port_args = ["-p", str(args.ssh_port)] if args.ssh_port is not None else []
    if runner == "pdsh":
        return [*shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", "")), *port_args]
    return [*port_args, *shlex.split(args.launcher_args)] if runner == "ssh" else []


def _default_master_addr(runner: str, resources: Resources, from_hostfile: bool, ssh_args: list[str]) -> str:
    """The rendezvous address when --master_addr is not given: loopback for a job on this machine, the first
    host under slurm, else the first node's ``hostname -I`` address (DeepSpeed's rule)."""
    if runner in ("local", "openmpi") and len(resources) == 1:
        return "127.0.0.1"
    if runner == "slurm":
        return next(iter(resources)) if from_hostfile else (_slurm_first_host() or "127.0.0.1")
    return infer_master_addr(ssh_args, next(iter(resources)))


def _default_master_port(runner: str, resources: Resources, no_ssh: bool) -> int:
    """DeepSpeed's port; for a job on this machine alone, a free one when that is in use (the other nodes of a
    multi-node job could not know which)."""
    if runner != "local" or len(resources) > 1 or no_ssh or _port_free(DEFAULT_MASTER_PORT):
        return DEFAULT_MASTER_PORT
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    say(f"port {DEFAULT_MASTER_PORT} is in use; the rendezvous takes the free port {port}")
    return port


def _port_free(port: int) -> bool:
    """Whether a listening socket could bind ``port`` on every address, as the rendezvous store does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def launch(args: argparse.Namespace) -> int:
    """Run the job described by the parsed launcher arguments; return its exit code."""
    if args.module and args.no_python:
        raise LauncherError("--module and --no_python cannot be used together")
    resources, from_hostfile = resolve(
        args.hostfile,
        args.hostfile_given,
        args.include,
        args.exclude,
        args.num_nodes,
        args.num_gpus,
        gpu_count(),
    )
    runner = _choose_runner(args, len(resources))
    _check_flags(args, runner, resources)
    if args.max_restarts > 0 and (len(resources) > 1 or runner in ("openmpi", "slurm")):
        raise LauncherError(
            "--max_restarts needs PyTorch's elastic agent to restart every rank together; it works for "
            "single-node jobs, not with several nodes or the openmpi/slurm launchers"
        )
    cwd = os.getcwd()
    os.environ[LOG_LEVEL_VARIABLE] = args.log_level
    exports = exported_env(os.environ, cwd, os.path.expanduser("~"))
    exports[LOG_LEVEL_VARIABLE] = args.log_level
    exports[TIMEOUT_VARIABLE] = f"{_collective_timeout(args):g}"
    if args.enable_each_rank_log != "None":
        exports["DSFUNC_RANK_LOG_DIR"] = os.path.abspath(args.enable_each_rank_log)
        exports["DSFUNC_LAUNCH_STAMP"] = time.strftime("%Y%m%d%H%M%S")
    ssh_args = _ssh_args(args, runner)
    for tool in {"ssh": ["ssh"], "pdsh": ["pdsh", "ssh"]}.get(runner, []):
        if shutil.which(tool) is None:
            raise LauncherError(f"launcher {runner!r} is not installed: {tool} is not on PATH")
    if runner in ("ssh", "pdsh") and not args.no_ssh_check:
        _ssh_reachable(ssh_args, list(resources))
    master_addr = args.master_addr or _default_master_addr(runner, resources, from_hostfile, ssh_args)
    master_port = args.master_port or _default_master_port(runner, resources, args.no_ssh)
    job = Launch(
        resources=resources,
        rank_args=_rank_args(args),
        master_addr=master_addr,
        master_port=master_port,
        exports=exports,
        launcher_args=ssh_args if runner == "ssh" else shlex.split(args.launcher_args),
        max_restarts=args.max_restarts,
        cwd=cwd,
        venv_script=args.venv_script,
    )
    hosts = list(resources)
    layout = "; ".join(f"{h}: slots {','.join(map(str, s))}" for h, s in resources.items())
    say(
        f"{job.world_size} rank(s) on {len(hosts)} node(s) ({layout}) via {runner}, "
        f"master {master_addr}:{master_port}"
    )
    pid_file = f"/tmp/{os.getpid()}.dsfunc" if args.save_pid else None
    if pid_file:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    try:
        return _dispatch(runner, job, args, ssh_args)
    finally:
        if pid_file and os.path.exists(pid_file):
            os.remove(pid_file)


def _dispatch(runner: str, job: Launch, args: argparse.Namespace, ssh_args: list[str]) -> int:
    hosts = job.hosts
    if runner == "local":
        if args.no_ssh and args.node_rank < 0:
            raise LauncherError("--no_ssh runs one node of the job; pass its --node_rank")
        if args.no_ssh and args.node_rank >= len(hosts):
            raise LauncherError(
                f"--node_rank {args.node_rank} names no node: the job has {len(hosts)} "
                f"({', '.join(hosts)}); give 0 to {len(hosts) - 1}, the node's line in the hostfile"
            )
        node_rank = args.node_rank if args.no_ssh else 0  # without --no_ssh, a local job is one node
        os.environ.update(job.exports)
        return run_node(
            job.resources, node_rank, job.rank_args, job.master_addr, job.master_port, job.max_restarts
        )
    if runner == "ssh":
        cmds = commands.ssh_commands(job)
        procs = [subprocess.Popen(c, stdin=subprocess.PIPE, start_new_session=True) for c in cmds]
        return supervise_nodes(procs, [f"node {i} ({h})" for i, h in enumerate(hosts)], close_stdin)
    if runner == "pdsh":
        cmd, extra = commands.pdsh_command(job)
        return _run_single(runner, {**os.environ, **extra, "PDSH_SSH_ARGS_APPEND": shlex.join(ssh_args)}, cmd)
    if runner == "openmpi":
        with tempfile.NamedTemporaryFile("w", prefix="dsfunc_mpi_hostfile_", suffix=".txt") as hostfile:
            hostfile.write(commands.mpi_hostfile_text(job.resources))
            hostfile.flush()
            return _run_single(runner, dict(os.environ), commands.openmpi_command(job, hostfile.name))
    cmd, extra = commands.slurm_command(
        job, hosts_from_hostfile=args.hostfile_given or os.path.isfile(args.hostfile)
    )
    return _run_single(runner, {**os.environ, **extra}, cmd)
