"""The launcher proper: decide where ranks run, start them with the chosen runner, and supervise the job.

A single-node job runs PyTorch's elastic agent in this process. A multi-node job starts one agent per node
over ssh (or pdsh), or every rank through mpirun or srun. One node failing stops the others; SIGINT/SIGTERM
stop every node; the exit code is the failing rank's.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from dsfunc.launcher import commands
from dsfunc.launcher.commands import Launch, LauncherError
from dsfunc.launcher.environment import exported_env
from dsfunc.launcher.node import run_node
from dsfunc.launcher.resources import resolve

#: How long a node may take to stop its ranks after being asked (the elastic agent waits 30 s before SIGKILL).
STOP_GRACE_S = 40.0


def _say(message: str) -> None:
    print(f"dsfunc: {message}", file=sys.stderr, flush=True)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _rank_args(args: argparse.Namespace) -> list[str]:
    flags = ["--no_local_rank"] if args.no_local_rank else []
    flags += ["--module"] if args.module else ["--no_python"] if args.no_python else []
    return [*flags, args.user_script, *args.user_args]


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


class _Signals:
    """Turns SIGINT/SIGTERM into a flag the supervision loop polls (restored on exit)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Signals:  # noqa: PYI034 - a private class, never subclassed
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> None:
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def supervise_nodes(
    procs: list[subprocess.Popen],
    labels: list[str],
    ask_stop,
    node_failure: Callable[[], tuple[str, int] | None] = lambda: None,
) -> int:
    """Wait for the runner processes (one per node, or one mpirun/srun/pdsh); when one fails,
    ``node_failure()`` reports a failed node (label, code), or a signal arrives, ``ask_stop(proc)`` the others
    and wait for them to
    finish (killing them after :data:`STOP_GRACE_S`). Returns the job's exit code."""
    with _Signals() as signals:
        code = 0
        while True:
            failed = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            remote = node_failure()
            if remote is not None and not failed:
                code = remote[1]
                _say(f"{remote[0]} exited with code {code}; stopping every node")
                break
            if failed:
                i, code = failed[0]
                others = "; stopping the other nodes" if any(p.poll() is None for p in procs) else ""
                _say(f"{labels[i]} exited with code {code}{others}")
                break
            if signals.received is not None:
                code = 128 + signals.received
                _say(f"got {signal.Signals(signals.received).name}; stopping every rank")
                break
            if all(p.poll() == 0 for p in procs):
                return 0
            time.sleep(0.1)
        running = [p for p in procs if p.poll() is None]
        for p in running:
            ask_stop(p)
        _wait_all(running, time.monotonic() + STOP_GRACE_S)
        return code


def _close_stdin(proc: subprocess.Popen) -> None:
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()


def _terminate(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def _interrupt_pdsh(proc: subprocess.Popen) -> None:
    """Two SIGINTs within a second make pdsh SIGTERM its ssh sessions; each node's agent then sees its
    parent (the remote sshd session) exit and stops its ranks."""
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)


_PDSH_NODE_EXIT = re.compile(r"^pdsh@\S+: (\S+): ssh exited with exit code (\d+)")


def _relay_pdsh_errors(stream, failures: list[tuple[str, int]]) -> None:
    """Copy pdsh's stderr to ours, noting each node whose command failed (pdsh waits for all nodes)."""
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        match = _PDSH_NODE_EXIT.match(line)
        if match and int(match[2]) != 0:
            failures.append((f"node {match[1]}", int(match[2])))


def _run_single(runner: str, proc_env: dict[str, str], cmd: list[str]) -> int:
    if shutil.which(cmd[0]) is None:
        raise LauncherError(f"launcher {runner!r} is not installed: {cmd[0]} is not on PATH")
    _say(shlex.join(cmd))
    if runner != "pdsh":
        proc = subprocess.Popen(cmd, env=proc_env, start_new_session=True)
        return supervise_nodes([proc], [cmd[0]], _terminate)
    failures: list[tuple[str, int]] = []
    proc = subprocess.Popen(cmd, env=proc_env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    relay = threading.Thread(target=_relay_pdsh_errors, args=(proc.stderr, failures), daemon=True)
    relay.start()
    code = supervise_nodes([proc], [cmd[0]], _interrupt_pdsh, lambda: failures[0] if failures else None)
    relay.join(timeout=5)
    return code


def _choose_runner(args: argparse.Namespace, n_hosts: int) -> str:
    if args.no_ssh:
        return "local"
    if args.launcher in ("openmpi", "slurm"):
        return args.launcher
    if n_hosts > 1 or args.force_multi:
        return args.launcher or "ssh"
    return "local"


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
        _gpu_count(),
    )
    runner = _choose_runner(args, len(resources))
    if args.max_restarts > 0 and (len(resources) > 1 or runner in ("openmpi", "slurm")):
        raise LauncherError(
            "--max_restarts needs PyTorch's elastic agent to restart every rank together; it works for "
            "single-node jobs, not with several nodes or the openmpi/slurm launchers"
        )
    cwd = os.getcwd()
    exports = exported_env(os.environ, cwd, os.path.expanduser("~"))
    if args.enable_each_rank_log != "None":
        exports["DSFUNC_RANK_LOG_DIR"] = os.path.abspath(args.enable_each_rank_log)
        exports["DSFUNC_LAUNCH_STAMP"] = time.strftime("%Y%m%d%H%M%S")
    # ssh options: --launcher_args for the ssh runner; pdsh passes PDSH_SSH_ARGS_APPEND to its ssh instead.
    port_args = ["-p", str(args.ssh_port)] if args.ssh_port is not None else []
    if runner == "pdsh":
        ssh_args = [*shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", "")), *port_args]
    else:
        ssh_args = [*port_args, *shlex.split(args.launcher_args)] if runner == "ssh" else []
    for tool in {"ssh": ["ssh"], "pdsh": ["pdsh", "ssh"]}.get(runner, []):
        if shutil.which(tool) is None:
            raise LauncherError(f"launcher {runner!r} is not installed: {tool} is not on PATH")
    if runner in ("ssh", "pdsh") and not args.no_ssh_check:
        _ssh_reachable(ssh_args, list(resources))
    master_addr = args.master_addr
    if not master_addr:
        if runner in ("local", "openmpi") and len(resources) == 1:
            master_addr = "127.0.0.1"
        elif runner == "slurm":
            master_addr = next(iter(resources)) if from_hostfile else (_slurm_first_host() or "127.0.0.1")
        else:
            master_addr = infer_master_addr(ssh_args, next(iter(resources)))
    job = Launch(
        resources=resources,
        rank_args=_rank_args(args),
        master_addr=master_addr,
        master_port=args.master_port,
        exports=exports,
        launcher_args=ssh_args if runner == "ssh" else shlex.split(args.launcher_args),
        max_restarts=args.max_restarts,
        cwd=cwd,
    )
    hosts = list(resources)
    layout = "; ".join(f"{h}: slots {','.join(map(str, s))}" for h, s in resources.items())
    _say(
        f"{job.world_size} rank(s) on {len(hosts)} node(s) ({layout}) via {runner}, "
        f"master {master_addr}:{args.master_port}"
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
        node_rank = max(args.node_rank, 0) if args.no_ssh else 0
        if args.no_ssh and args.node_rank < 0:
            raise LauncherError("--no_ssh runs one node of the job; pass its --node_rank")
        if not args.no_ssh and len(hosts) > 1:
            raise LauncherError("internal: several nodes need a multi-node runner")
        os.environ.update(job.exports)
        return run_node(
            job.resources, node_rank, job.rank_args, job.master_addr, job.master_port, job.max_restarts
        )
    if runner == "ssh":
        cmds = commands.ssh_commands(job)
        procs = [subprocess.Popen(c, stdin=subprocess.PIPE, start_new_session=True) for c in cmds]
        return supervise_nodes(procs, [f"node {i} ({h})" for i, h in enumerate(hosts)], _close_stdin)
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
