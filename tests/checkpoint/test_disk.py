"""A full disk is reported as "no space left on device while writing FILE" on every rank: checked before
writing, and mapped from the errno (or from the free space left) when a write fails part-way."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsfunc.checkpoint import disk
from dsfunc.checkpoint.errors import CheckpointError
from dsfunc.checkpoint.publish import _write_durably

ROOT = Path(__file__).resolve().parents[2]


def test_the_errno_of_a_full_disk_a_quota_or_a_size_limit_is_named_with_the_file(tmp_path):
    file = tmp_path / "__1_0.distcp"
    cases = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
             errno.EFBIG: "file too large for this process's file-size limit (ulimit -f)"}
    for code, reason in cases.items():
        assert disk.disk_text(OSError(code, "os says"), file) == f"{reason} while writing {file}"
    try:  # as DCP and torch.save raise it: another error caused by the OSError
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("writing failed") from e
    except RuntimeError as e:
        assert disk.disk_text(e, file) == f"no space left on device while writing {file}"
    assert disk.disk_text(ValueError("unrelated"), file) is None  # tmp_path has room


def test_a_write_error_without_errno_on_a_full_disk_says_so(tmp_path, monkeypatch):
    """torch.save's zip writer reports a full disk as "unexpected pos"; the free space left tells."""
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(disk, "free_bytes", lambda path: 4096)
    assert disk.disk_text(error, tmp_path / "f") == (
        f"no space left on device while writing {tmp_path / 'f'} (4,096 bytes free; RuntimeError: {error})")


def test_check_space_refuses_what_cannot_fit(tmp_path):
    free = disk.free_bytes(tmp_path)
    disk.check_space(tmp_path, tmp_path / "x", free // 2)
    with pytest.raises(CheckpointError, match=rf"no space left on device while writing {tmp_path / 'x'}: it needs"):
        disk.check_space(tmp_path, tmp_path / "x", free + 1)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_writing_the_client_state_to_a_full_device_names_it():
    """/dev/full answers every write with ENOSPC: the real write path of client_state.pt and the metadata."""
    with pytest.raises(CheckpointError, match="^no space left on device while writing /dev/full$"):
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
    assert result["left"] == [], "a failed save leaves nothing behind"
