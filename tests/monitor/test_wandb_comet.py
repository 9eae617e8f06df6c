"""The wandb and comet monitors, run offline: the files they leave hold the logged values."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

import dsfunc
from dsfunc.monitor import Monitor
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world

ROOT = str(Path(__file__).resolve().parents[2])
BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of records with 7-byte headers


def wandb_records(path: str) -> list[bytes]:
    """The records of a ``.wandb`` file (after its 7-byte ``:W&B`` header), fragments joined."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            records.append(pending)
            pending = b""
    return records


def wandb_history(run_dir: str) -> dict[int, dict[str, float]]:
    """wandb's own protobuf records of an offline run: the logged values by step (wandb's _runtime etc. left out).
    wandb's service process writes the file after ``run.finish()`` returns: read it once its exit record is in."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "*.wandb"))
    for _ in range(600):
        records = []
        for raw in wandb_records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    out: dict[int, dict[str, float]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = items.pop("_step")
            out.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})  # not wandb's
    return out


def train(cfg: dict, steps: int) -> list[dict[str, float]]:
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), cfg)
    monitor = Monitor(state, write=lambda line: None)
    seen = []
    for batch in mlp_batches(steps, cfg["train_micro_batch_size_per_gpu"]):
        state = dsfunc.train_step(state, batch)
        seen.append(state.metrics.to_dict())
        monitor.log(state, batch)
    monitor.close()
    return seen


def test_a_scripts_own_events_go_to_every_writer_as_deepspeeds_monitor_write_events(offline_wandb, tmp_path):
    cfg = config(micro=2, csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
                 wandb={"enabled": True, "project": "p"})
    monitor = Monitor(dsfunc.init_state(MLP(), cfg), write=lambda line: None)
    assert monitor.enabled
    monitor.write_events([("Eval/accuracy", torch.tensor(0.5), 8), ("Eval/accuracy", 0.75, 16)])
    monitor.close()
    assert (tmp_path / "j" / "Eval_accuracy.csv").read_text().split() == ["step,accuracy", "8,0.5", "16,0.75"]
    (run_dir,) = glob.glob(str(offline_wandb / "wandb" / "offline-run-*"))
    assert wandb_history(run_dir) == {8: {"Eval/accuracy": 0.5}, 16: {"Eval/accuracy": 0.75}}
    assert not Monitor(dsfunc.init_state(MLP(), config(micro=2)), write=lambda line: None).enabled


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb offline in tmp_path; wandb keeps its settings (WANDB_DIR) for the process: torn down after."""
    wandb = pytest.importorskip("wandb")
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                       "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(key, value)
    yield tmp_path
    wandb.teardown()


def test_wandb_offline_run_holds_loss_and_lr_by_global_samples(offline_wandb):
    cfg = config(micro=2, fp16={"enabled": True}, wandb={"enabled": True, "project": "p", "group": "g"})
    seen = train(cfg, 3)
    (run_dir,) = glob.glob(str(offline_wandb / "wandb" / "offline-run-*"))
    history = wandb_history(run_dir)
    assert sorted(history) == [2, 4, 6]  # x = global samples (train_batch_size 2)
    for step, metrics in zip((2, 4, 6), seen):
        row = history[step]
        assert row["Train/Samples/train_loss"] == pytest.approx(metrics["loss"], rel=1e-6)
        assert row["Train/Samples/lr"] == pytest.approx(metrics["lr"])
        assert row["Train/Samples/loss_scale"] == metrics["loss_scale"]


def test_only_rank_0_makes_a_wandb_run(offline_wandb):
    run_world(_two_ranks, 2)
    assert len(glob.glob(str(offline_wandb / "wandb" / "offline-run-*"))) == 1


def _two_ranks(rank: int, world_size: int) -> None:
    train(config(micro=2, world=2, wandb={"enabled": True, "project": "p"}), 2)


COMET_RUN = """
import json
from tests.models import config
from tests.monitor.test_wandb_comet import train
cfg = config(micro=2, comet={"enabled": True, "online": False, "project": "p", "samples_log_interval": 4,
                             "experiment_name": "run1"})
print(json.dumps([m["loss"] for m in train(cfg, 5)]))
"""


def test_comet_offline_archive_holds_the_metrics(tmp_path):
    """In a process of its own: comet_ml leaves a socket open (an unraisable ResourceWarning) and threads."""
    pytest.importorskip("comet_ml")
    proc = subprocess.run([sys.executable, "-c", COMET_RUN], check=False, capture_output=True, text=True, timeout=300,
                          cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "COMET_OFFLINE_DIRECTORY": str(tmp_path),
                               "COMET_DISABLE_AUTO_LOGGING": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads(proc.stdout.strip().splitlines()[-1])
    (archive,) = glob.glob(str(tmp_path / "*.zip"))
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines()]
        experiment = json.loads(z.read("experiment.json"))
    metrics = [m["payload"]["metric"] for m in messages if m["type"] == "metric_msg"]
    loss = {m["step"]: m["metricValue"] for m in metrics if m["metricName"] == "Train/Samples/train_loss"}
    # samples 2, 4, ..., 10; logged at 2, then once 4 more samples have passed: 6, 10
    assert sorted(loss) == [2, 6, 10]
    assert [float(loss[s]) for s in (2, 6, 10)] == pytest.approx([losses[i] for i in (0, 2, 4)], rel=1e-6)
    assert experiment["project_name"] == "p" and "run1" in json.dumps(messages)


@pytest.mark.parametrize("section, package", [("wandb", "wandb"), ("comet", "comet_ml")])
def test_a_missing_package_is_named(section, package):
    code = (f"import sys; sys.modules[{package!r}] = None\n"
            "import dsfunc\n"
            "from tests.models import MLP, config\n"
            "from dsfunc.monitor import Monitor\n"
            f"Monitor(dsfunc.init_state(MLP(), config({section}={{'enabled': True}})))\n")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    assert proc.returncode != 0
    assert (f'MissingDependencyError: the config enables "{section}", but the {package} package is not installed: '
            f"`pip install {package}` (or dsfunc[{section}]), or set {section}.enabled to false") in proc.stderr
