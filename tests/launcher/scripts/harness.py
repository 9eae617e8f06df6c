"""Helpers the launcher tests share: run the `dsfunc` CLI, read rank reports, inspect the process table, and
start a private sshd on a loopback port whose two host aliases stand for two nodes."""

from __future__ import annotations

import getpass
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.multiprocess import free_port

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).resolve().parent
# fail.py's other ranks sleep 300 s: a launch that ends within this many seconds stopped them. Generous, so
# that a loaded machine cannot break it; how fast a launch stops is not asserted anywhere.
STOPPED_WITHIN_S = 240


_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """Environment for a launcher run: the repo importable, a private HOME, no inherited rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    env.update(PYTHONPATH=str(REPO), HOME=str(home), OMP_NUM_THREADS="1", **extra)
    return env


def dsfunc_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dsfunc.cli", *args]


def run_dsfunc(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        dsfunc_cmd(*args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def run_dsfunc_here(args: list[str], cwd: Path, home: Path, monkeypatch, capsys) -> tuple[int, str]:
    """The CLI's entry point run in this process, for launches refused before any rank starts (an interpreter
    start costs more than the check): its exit code and stderr. A refusal must leave this process as it was
    (environment, working directory, signal handlers, logging), which is asserted here."""
    from dsfunc.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    for key in _RANK_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    before = (dict(os.environ), [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)],
              list(logging.getLogger().handlers))
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    after = (dict(os.environ), [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)],
             list(logging.getLogger().handlers))
    assert after == before and Path.cwd() == cwd.resolve(), "a refused launch changed the test process"
    return code, capsys.readouterr().err


def start_dsfunc(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """The CLI started in the background (for the tests that signal or wait on it), output captured as text."""
    return subprocess.Popen(
        dsfunc_cmd(*args), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def reports(out_dir: Path) -> dict[int, dict]:
    """The rank reports written by report.py, by rank."""
    found = {}
    for path in out_dir.glob("rank*.json"):
        data = json.loads(path.read_text())
        found[data["rank"]] = data
    return found


def processes_with(token: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose command line contains ``token`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = (
                Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token in cmdline and state != "Z":
            found.append((int(entry), cmdline))
    return found


def wait_gone(token: str, timeout: float = 60) -> list[tuple[int, str]]:
    """Wait until no process mentions ``token``; return the survivors (empty when all are gone)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = processes_with(token)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def wait_for_files(paths: list[Path], proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early with {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks did not start: missing {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.1)


def interrupt_and_wait(
    proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 60
) -> tuple[int, str]:
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


class Sshd:
    """A private sshd on 127.0.0.1 with a fresh host key and client key, and an ssh config in which each of
    ``aliases`` reaches it: several "nodes" on one machine, over real ssh."""

    def __init__(self, workdir: Path, aliases: tuple[str, ...] = ("node-a", "node-b")) -> None:
        self.dir = workdir
        self.aliases = aliases
        self.port = free_port()
        for name in ("host_key", "id"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(workdir / name)], check=True
            )
        shutil.copy(workdir / "id.pub", workdir / "authorized_keys")
        (workdir / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {workdir / 'host_key'}\n"
            f"AuthorizedKeysFile {workdir / 'authorized_keys'}\nPidFile {workdir / 'sshd.pid'}\n"
            "StrictModes no\nUsePAM no\nPasswordAuthentication no\nPermitRootLogin prohibit-password\n"
        )
        self.config = workdir / "ssh_config"
        self.config.write_text(
            f"Host {' '.join(aliases)}\n  HostName 127.0.0.1\n  Port {self.port}\n"
            f"  User {getpass.getuser()}\n"
            f"  IdentityFile {workdir / 'id'}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
        )
        self._log = open(workdir / "sshd.log", "w")  # noqa: SIM115 - sshd writes to it until stop()
        self.proc = subprocess.Popen(
            [shutil.which("sshd") or "/usr/sbin/sshd", "-D", "-e", "-f", str(workdir / "sshd_config")],
            stderr=self._log,
        )
        deadline = time.monotonic() + 20
        while (
            subprocess.run(
                ["ssh", "-F", str(self.config), aliases[0], "true"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                check=False,
            ).returncode
            != 0
        ):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sshd did not start: {(workdir / 'sshd.log').read_text()}")
            time.sleep(0.2)

    def hostfile(self, slots: int = 2) -> Path:
        path = self.dir / "hostfile"
        path.write_text("".join(f"{a} slots={slots}\n" for a in self.aliases))
        return path

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self._log.close()


def sshd_missing_reason() -> str | None:
    """Why the ssh tests cannot run here (None when they can)."""
    sbin = ["/usr/sbin", "/usr/local/sbin"]
    if not (shutil.which("sshd") or any(os.path.exists(f"{d}/sshd") for d in sbin)):
        return "sshd is not installed (apt-get install openssh-server; .ci/setup_test_tools.sh does it)"
    for tool in ("ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt-get install openssh-client)"
    if not os.path.isdir("/run/sshd"):
        if os.geteuid() != 0:
            return "sshd needs its privilege separation directory /run/sshd (create it as root)"
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    return None
