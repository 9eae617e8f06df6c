"""A full disk is reported as "no space left on device while writing FILE" on every rank: checked before
writing, and mapped from the errno (or from the free space left) when a write fails part-way."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsfunc.checkpoint import disk
from dsfunc.checkpoint.errors import CheckpointError
from dsfunc.checkpoint.publish import _write_durably
from tests.checkpoint import disk_limits
from tests.multiprocess import run_world

ROOT = Path(__file__).resolve().parents[2]


def test_the_errno_of_a_full_disk_a_quota_or_a_size_limit_is_named_with_the_file(tmp_path):
    file = tmp_path / "__1_0.distcp"
    cases = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
             errno.EFBIG: "file too large for this process's file-size limit (ulimit -f)",
             errno.EROFS: "read-only file system"}
    for code, reason in cases.items():
        text = disk.disk_text(OSError(code, "os says"), file)
        assert text.startswith(f"{reason} while writing {file} (") and text.endswith(")")
    try:  # as DCP and torch.save raise it: another error caused by the OSError
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("writing failed") from e
    except RuntimeError as e:
        assert disk.disk_text(e, file).startswith(f"no space left on device while writing {file} (free some")
    assert disk.disk_text(ValueError("unrelated"), file) is None  # tmp_path has room


def test_a_write_error_without_errno_on_a_full_disk_says_so(tmp_path, monkeypatch):
    """torch.save's zip writer reports a full disk as "unexpected pos"; the free space left tells."""
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(disk, "free_bytes", lambda path: 4096)
    assert disk.disk_text(error, tmp_path / "f") == (
        f"no space left on device while writing {tmp_path / 'f'} (4,096 bytes free; RuntimeError: {error}; "
        "free some space or save to another directory)")


def test_check_space_refuses_what_cannot_fit(tmp_path):
    free = disk.free_bytes(tmp_path)
    disk.check_space(tmp_path, tmp_path / "x", free // 2)
    with pytest.raises(CheckpointError, match=rf"no space left on device while writing {tmp_path / 'x'}: it needs"):
        disk.check_space(tmp_path, tmp_path / "x", free + 1)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_writing_the_client_state_to_a_full_device_names_it():
    """/dev/full answers every write with ENOSPC: the real write path of client_state.pt and the metadata."""
    with pytest.raises(CheckpointError, match=r"^no space left on device while writing /dev/full \(free some"):
        _write_durably(Path("/dev/full"), b"x" * 100)


def _mount_namespace_reason() -> str | None:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare and mount (util-linux)"
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "true"], capture_output=True, check=False)
    return None if probe.returncode == 0 else "cannot make a private mount namespace (unshare --mount)"


@pytest.mark.skipif(_mount_namespace_reason() is not None, reason=str(_mount_namespace_reason()))
@pytest.mark.parametrize("size, where", [("1m", "before writing"), ("2m", "part-way through the writes")])
def test_a_full_tmpfs_is_named_on_every_rank(tmp_path, size, where):
    """Two gloo ranks save ~1.2 MB each onto a real tmpfs: of 1 MiB (neither fits: refused before writing)
    or of 2 MiB (each fits, both do not: a write fails part-way, where torch.save reports "unexpected pos")."""
    mount = tmp_path / "disk"
    mount.mkdir()
    run = subprocess.run(["unshare", "--mount", "--map-root-user", sys.executable, "-m", "tests.checkpoint.disk_full",
                          str(mount), size], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    first, second = result["errors"]
    assert first == second, "every rank reports the same"
    assert first.startswith(f"CheckpointError: saving checkpoint 'big' to {mount} failed: ")
    assert "no space left on device while writing " in first and "unexpected pos" not in first.split("(")[0]
    if where == "before writing":
        for rank in (0, 1):
            assert f"rank {rank}: no space left on device while writing " in first
            assert f"__{rank}_0.distcp: it needs" in first
    else:
        assert "writing the tensors failed: rank " in first
    assert "Nothing was replaced: no `latest` was written" in first
    assert result["left"] == [".lock"], "a failed save leaves nothing behind but the lock of save_dir"


def test_a_file_size_limit_is_named_on_every_rank(tmp_path):
    """A real RLIMIT_FSIZE of 200 kB on both ranks (each writes ~1.2 MB): write() fails with EFBIG part-way,
    where torch.save reports "unexpected pos"; the previous checkpoint and ``latest`` stay as they were."""
    results = run_world(disk_limits.save_under_size_limit, 2, str(tmp_path), 200_000)
    first, second = (r["error"] for r in results)
    assert first == second, "every rank reports the same"
    assert first.startswith(f"CheckpointError: saving checkpoint 'big' to {tmp_path} failed: writing the tensors")
    for rank in (0, 1):
        assert f"rank {rank}: file too large for this process's file-size limit (ulimit -f) while writing " in first
    assert "raise the limit, e.g. ulimit -f unlimited" in first and "unexpected pos" not in first
    assert "`latest` still names 'small'" in first
    assert results[0]["left"] == [".lock", "latest", "small", "zero_to_fp32.py"] and results[0]["latest"] == "small"
    assert disk_limits.loads(str(tmp_path))


@pytest.mark.skipif(_mount_namespace_reason() is not None, reason=str(_mount_namespace_reason()))
def test_a_read_only_file_system_is_named_on_every_rank(tmp_path):
    """A real tmpfs remounted read-only after a first save: the next save fails with EROFS on every rank."""
    mount = tmp_path / "disk"
    mount.mkdir()
    run = subprocess.run(["unshare", "--mount", "--map-root-user", sys.executable, "-m",
                          "tests.checkpoint.disk_limits", str(mount)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    first, second = (r["error"] for r in result["ranks"])
    assert first == second, "every rank reports the same"
    assert first.startswith(f"CheckpointError: saving checkpoint 'big' to {mount} failed: read-only file system "
                            f"while writing {mount}/.big.tmp-")
    assert "remount it read-write or save to another directory" in first
    assert "`latest` still names 'small'" in first
    assert result["ranks"][0]["left"] == [".lock", "latest", "small", "zero_to_fp32.py"] and result["loads"]



@pytest.mark.skipif(_mount_namespace_reason() is not None, reason=str(_mount_namespace_reason()))
def test_a_disk_full_exactly_at_latest_says_the_tag_was_saved_and_leaves_no_temporary(tmp_path):
    """A real tmpfs filled until the checkpoint's files fit and ``latest`` does not: the error says what was
    done (the tag is published, ``latest`` not updated), the half-written ``latest`` is removed, and the
    next save works."""
    run = subprocess.run(["unshare", "--mount", "--map-root-user", sys.executable, "-m",
                          "tests.checkpoint.disk_latest", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    full = tmp_path / "full"
    assert result["error"].startswith(
        f"CheckpointError: checkpoint 'second' was saved to {full}/second and is complete, but `latest` was not "
        f"updated: no space left on device while writing {full}/.latest.tmp-")
    assert result["error"].endswith("(free some space or save to another directory); `latest` still names "
                                    "'first'. Load the new checkpoint with tag='second'.")
    assert "Nothing was replaced" not in result["error"]
    assert result["left"] == [".lock", "filler", "first", "latest", "second"] and result["latest"] == "first"
    assert result["loads"] and result["after"] == [".lock", "first", "latest", "second", "third"]

SAVE_TO_PATH = """
import resource, signal, sys
from pathlib import Path
import torch
from dsfunc.checkpoint.disk import disk_text
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
path = Path(sys.argv[1])
try:
    torch.save(torch.zeros(100_000), path)  # to a path: torch's own writer, no Python file behind it
except RuntimeError as e:
    causes, c = [], e
    while c is not None:
        causes.append(c)
        c = c.__cause__ or c.__context__
    print(str(e) if not any(isinstance(c, OSError) for c in causes) else "an OSError is chained")
    print(disk_text(e, path))
"""


def test_torch_save_to_a_path_loses_the_errno_and_the_file_system_tells(tmp_path):
    """torch.save into a path reports a real EFBIG as "unexpected pos" with no OSError behind it; the file
    left at the size limit is how :func:`disk.disk_text` knows."""
    file = tmp_path / "w.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", SAVE_TO_PATH, str(file)], capture_output=True, text=True, env=env,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    torch_says, we_say = run.stdout.strip().splitlines()
    assert "unexpected pos" in torch_says
    assert we_say == (f"file too large for this process's file-size limit (ulimit -f) while writing {file} "
                      "(w.pt stopped at the limit of 100,000 bytes; raise the limit, e.g. ulimit -f unlimited, "
                      "before starting the job)")
