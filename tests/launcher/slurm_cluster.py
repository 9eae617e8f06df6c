"""A private single-node slurm cluster for the slurm launcher tests: its own munge key and munged, and a
slurmctld and slurmd on free ports, everything under one directory; ``SLURM_CONF`` points the client
commands (srun, sinfo) at it.

The plugins are the ones that work in a container (no cgroups, no accounting): slurm only has to start
tasks here, not confine them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.launcher.scripts.harness import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("munge", "srun", "sinfo", "scontrol")
SBIN = ("/usr/sbin", "/usr/local/sbin")
START_WITHIN_S = 120  # generous: a loaded machine; nothing asserts how fast slurm starts


def _tool(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def slurm_missing_reason() -> str | None:
    """Why a slurm cluster cannot be started here (None when it can)."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if _tool(name) is None]
    if missing:
        return (
            f"slurm is not installed ({', '.join(missing)} not found): .ci/setup_test_tools.sh installs it "
            "(apt-get install slurmctld slurmd slurm-client munge)"
        )
    if os.geteuid() != 0:
        return "the private slurm cluster runs its daemons as root (slurmd starts the tasks); run as root"
    return None


def _conf(root: Path, host: str, ctld_port: int, slurmd_port: int) -> str:
    cpus = max(2, os.cpu_count() or 1)  # the tests run 2 tasks; config_overrides trusts this over the hardware
    return f"""\
ClusterName=dsfunctest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
PropagateResourceLimits=NONE
SlurmdParameters=config_overrides
MailProg=/bin/true
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def processes_using(conf: Path) -> list[tuple[int, str]]:
    """(pid, command line) of every live process started under this cluster: the daemons, their
    slurmstepd and the tasks all have ``SLURM_CONF`` (or the config path) in their environment."""
    token = str(conf).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (token in environ or token in cmdline) and state != "Z":
            found.append((int(entry), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


class SlurmCluster:
    """munged, slurmctld and slurmd in the foreground as child processes, one node named as slurmd sees
    this host, ready (``sinfo`` says idle) when the constructor returns; :meth:`stop` ends them all."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self._procs: list[tuple[str, subprocess.Popen]] = []
        for name in ("munge", "state", "spool", "log"):
            (root / name).mkdir(mode=0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(_conf(root, self.host, free_port(), free_port()))
        socket_path = root / "munge" / "munge.socket"
        try:
            # --force: munged wants every directory above its socket open to all, and pytest's temporary
            # directories are private; every client here is root, so the socket is reachable all the same.
            self._start("munged", "-F", "--force", f"--socket={socket_path}", f"--key-file={key}",
                        f"--pid-file={root}/munge/munged.pid", f"--seed-file={root}/munge/munged.seed",
                        f"--log-file={root}/log/munged.file.log")
            self._wait_for("munged", lambda: self._ok(["munge", "-n", "-S", str(socket_path)]))
            self._start("slurmctld", "-D", "-f", str(self.conf))
            self._start("slurmd", "-D", "-f", str(self.conf), "-N", self.host)
            self._wait_for("the node to be idle", lambda: self.node_state() == "idle")
        except BaseException:
            self.stop()
            raise

    def node_state(self) -> str:
        """The node's state as ``sinfo`` reports it (``idle``, ``alloc``, ``down*``...; empty if unknown)."""
        res = subprocess.run([_tool("sinfo"), "-h", "-N", "-o", "%T"], env=self.client_env(), capture_output=True,
                             text=True, timeout=60, check=False)
        return res.stdout.strip() if res.returncode == 0 else ""

    def client_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with ``SLURM_CONF`` pointing at this cluster."""
        return {**(os.environ if base is None else base), **self.env}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.root / "log").glob("*.log")))

    def _ok(self, argv: list[str]) -> bool:
        argv = [_tool(argv[0]), *argv[1:]]
        return subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 0

    def _start(self, name: str, *args: str) -> None:
        with open(self.root / "log" / f"{name}.log", "w") as log:
            proc = subprocess.Popen([_tool(name), *args], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=self.client_env(), start_new_session=True)
        self._procs.append((name, proc))

    def _wait_for(self, what: str, ready) -> None:
        deadline = time.monotonic() + START_WITHIN_S
        while not ready():
            dead = [(n, p.returncode) for n, p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{dead[0][0]} exited with code {dead[0][1]}" if dead else f"not within {START_WITHIN_S} s"
                raise RuntimeError(f"the test slurm cluster did not start: waiting for {what}, {why}\n{self.logs()}")
            time.sleep(0.2)

    def stop(self) -> list[tuple[int, str]]:
        """Stop the daemons (slurmd, slurmctld, then munged) and return what is left of the cluster's
        processes once they are gone (empty: nothing left behind)."""
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs = []
        deadline = time.monotonic() + 30
        while (left := processes_using(self.conf)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left
