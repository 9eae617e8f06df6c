"""`dsfunc --launcher slurm` against a real single-node slurm (munged, slurmctld, slurmd started here): the
ranks come from srun and form a gloo group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.launcher.scripts.harness import (
    SCRIPTS,
    cli_env,
    free_port,
    reports,
    run_dsfunc,
)
from tests.launcher.slurm_cluster import SlurmCluster, slurm_missing_reason


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurm_missing_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":  # CI installs slurm: its absence is a broken setup, not a skip
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    left = cluster.stop()
    assert not left, f"the slurm cluster left processes behind: {left}"


@pytest.fixture
def job(tmp_path: Path, slurm: SlurmCluster):
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    out.mkdir()
    base = ["--launcher", "slurm", "--num_nodes", "1", "--num_gpus", "2", "--master_port", str(free_port())]
    return tmp_path, out, slurm.client_env(cli_env(home)), base


def test_two_tasks_through_srun_form_a_group(job):
    cwd, out, env, base = job
    res = run_dsfunc([*base, str(SCRIPTS / "report.py"), str(out)], cwd, env)
    assert res.returncode == 0, res.stderr
    assert "via slurm" in res.stderr and "srun --nodes=1 --ntasks=2 --ntasks-per-node=2" in res.stderr
    ranks = reports(out)
    assert sorted(ranks) == [0, 1]
    for rank, r in ranks.items():
        assert r["sum"] == 3.0 and r["world_size"] == 2 and r["backend"] == "gloo"
        e = r["env"]
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank), "2", "2")
        assert r["argv"] == [f"--local_rank={rank}", str(out)]
    assert ranks[0]["pid"] != ranks[1]["pid"]

