"""DeepSpeed's own unit tests, run against the real DeepSpeed and against dsfunc (``DSFUNC_AS_DEEPSPEED=1``).

DeepSpeed's ``tests/unit`` (with its ``tests/conftest.py`` and ``pytest.ini``) is exported from a DeepSpeed
git repository (``git archive``) or taken from an existing checkout, and each of its test files in the chosen
folders runs in its own pytest process on the CPU (``DS_ACCELERATOR=cpu``, gloo), once per side: ``ds`` (the
installed DeepSpeed) and ``dsfunc`` (this repository's dsfunc answering ``import deepspeed``). One file per
process: DeepSpeed's ``DistributedTest`` ends the whole session when a test hangs, and a file's hang must
not hide the rest; a file's run that overruns goes on in a new process after the test it stopped in
(:func:`run_file`), so a hang, or a file of many slow tests, costs one test and not the rest. The outcome of every test id goes to ``OUT/<side>.json``; ``OUT/table.csv`` lists each id
with its outcome on both sides, and the counts are printed: all, and those that exercise public API (the ids
``internal.txt`` lists, with why, reach into DeepSpeed's internals or features dsfunc does not build).

``python tests/deepspeed/upstream/run.py --repo DEEPSPEED_GIT_DIR --out OUT`` runs both sides;
``--side dsfunc --select OUT/ds.json`` runs under dsfunc only the tests that passed under DeepSpeed (what the
comparison needs, in half the time). The full run takes hours on two cores; the CI runs a small fixed subset
(test_upstream.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
INTERNAL = Path(__file__).with_name("internal.txt")
FOLDERS = ("runtime", "checkpoint", "launcher", "utils", "comm")
SIDES = ("ds", "dsfunc")


def export_tests(repo: Path, ref: str, dest: Path) -> Path:
    """DeepSpeed's ``tests`` folder (conftest, pytest.ini, unit) at ``ref`` of the git repository ``repo``,
    written under ``dest``; returns that ``tests`` folder."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", ref, "tests/conftest.py",
                              "tests/pytest.ini", "tests/unit"], capture_output=True, check=True).stdout
    with tempfile.TemporaryFile() as tar:
        tar.write(archive)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as t:
            t.extractall(dest, filter="data")
    return dest / "tests"


def unit_test_files(tests: Path, paths: tuple[str, ...]) -> list[str]:
    """The test files of ``tests/unit/<path>`` (a folder or a file), relative to ``tests``, in the order of
    ``paths`` (each folder's sorted), each once."""
    found: dict[str, None] = {}
    for path in paths:
        where = tests / "unit" / path
        for p in [where] if where.is_file() else sorted(where.rglob("test_*.py")):
            found.setdefault(str(p.relative_to(tests)))
    return list(found)


def environment(side: str) -> dict[str, str]:
    """The environment a side's pytest runs in: the CPU accelerator with 4 "devices" (``LOCAL_SIZE``: without
    it DeepSpeed's CPU accelerator counts NUMA nodes, and tests of 2 or 4 ranks skip for want of devices), and
    for dsfunc the switch and this repository first on the path (the ranks the tests start inherit both)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_UNITTEST_TIMEOUT=os.environ.get("DS_UNITTEST_TIMEOUT", "300"),
               DS_DISABLE_REUSE_DIST_ENV="1", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", LOCAL_SIZE="4")
    env.pop("DSFUNC_AS_DEEPSPEED", None)
    if side == "dsfunc":
        env["DSFUNC_AS_DEEPSPEED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def outcomes(records: list[dict]) -> tuple[dict[str, str], set[str], tuple[str, float] | None]:
    """From :mod:`upstream_outcomes`'s records of one run: ``{test id: passed | failed | error | skipped}`` of the
    tests it finished, the ids it collected, and the test it had started and not finished (with its start time)."""
    result: dict[str, str] = {}
    collected: set[str] = set()
    started: dict[str, float] = {}
    for record in records:
        if "collected" in record:
            collected.update(record["collected"])
        elif "start" in record:
            started[record["id"]] = record["start"]
        elif record["when"] == "collect":
            result[record["id"] or "<collection>"] = "error"
        elif record["outcome"] == "failed":
            result[record["id"]] = "failed" if record["when"] == "call" else "error"
        elif record["outcome"] == "skipped":
            result[record["id"]] = "skipped"
        elif record["when"] == "call":
            result.setdefault(record["id"], "passed")
        if record.get("when") == "teardown":
            started.pop(record["id"], None)
    running = next(reversed(started.items()), None)  # one at most: a test's teardown report ends it
    return result, collected, running


def run_file(tests: Path, file: str, side: str, ids: list[str] | None, timeout: int, log: Path) -> dict[str, str]:
    """One test file (or the given ids of it) under one side. A run that does not finish in 4 x ``timeout`` seconds
    is stopped and the tests it had not reached run again in a new one (a file of many slow tests takes several):
    the test it stopped in counts as ``timeout`` once it had run ``timeout`` seconds or was stopped in twice (else
    it runs again), so each run gets further. Tests never reported (the file could not be collected) count as
    ``error``."""
    records_path = log.with_suffix(".jsonl")
    log.unlink(missing_ok=True)
    result: dict[str, str] = {}
    expected: set[str] = set(ids or [])
    pending, stopped_in, unreported = ids or [file], None, "error"
    while pending:
        records_path.unlink(missing_ok=True)
        killed = _run_once(tests, side, pending, timeout, log, records_path)
        records = [json.loads(line) for line in records_path.read_text().splitlines()] if records_path.exists() else []
        got, collected, running = outcomes(records)
        result.update(got)
        expected |= collected
        if not killed:
            break
        if running is None and not got:  # stopped before any test began: nothing to go on from
            unreported = "timeout"
            break
        if running is not None and (time.time() - running[1] >= timeout or running[0] == stopped_in):
            result[running[0]] = "timeout"
        stopped_in = running and running[0]
        pending = sorted(expected - set(result))
    for test_id in expected:
        result.setdefault(test_id, unreported)
    if not result:
        result[file] = "error"
    return result


def _run_once(tests: Path, side: str, args: list[str], timeout: int, log: Path, records: Path) -> bool:
    """One pytest process over ``args`` (a file or test ids), its output appended to ``log`` and its outcomes to
    ``records``; True if it had to be stopped (it ran past 4 x ``timeout`` seconds)."""
    # a base temporary folder of its own: pytest prunes all but the newest few under /tmp/pytest-of-<user>, so runs
    # beside it (another file's, another developer's) would delete the folders its tests are writing in
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "upstream_outcomes", "-q",
               "--timeout", str(timeout), f"--basetemp={log.with_suffix('.tmp')}", *args]
    env = environment(side)
    env["UPSTREAM_OUTCOMES"] = str(records)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *filter(None, [env.get("PYTHONPATH")])])
    with open(log, "a") as out:
        process = subprocess.Popen(command, cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            process.wait(timeout=4 * timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return True
    return False


def run_side(tests: Path, side: str, files: list[str], select: set[str] | None, timeout: int,
             out: Path) -> dict[str, str]:
    """Every file under one side; with ``select``, only those ids (files with none are not run)."""
    logs = out / side
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, str] = {}
    for file in files:
        ids = sorted(i for i in select if i.split("::")[0] == file) if select is not None else None
        if ids == []:
            continue
        got = run_file(tests, file, side, ids, timeout, logs / file.replace("/", "__").replace(".py", ".log"))
        results.update(got)
        counts = {k: sum(v == k for v in got.values()) for k in sorted(set(got.values()))}
        print(f"{side} {file}: {counts}", flush=True)
        (out / f"{side}.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    return results


def internal_prefixes(path: Path = INTERNAL) -> list[str]:
    """The test-id prefixes ``internal.txt`` judges internal (a file, a class or one id, before its " # why")."""
    lines = (line.split(" # ")[0].strip() for line in path.read_text().splitlines() if not line.startswith("#"))
    return [line for line in lines if line]


def is_internal(test_id: str, prefixes: list[str]) -> bool:
    """Whether ``test_id`` is one of ``prefixes`` or a test under one."""
    return any(test_id == p or test_id.startswith((p + "::", p + "[")) for p in prefixes)


def write_table(out: Path) -> None:
    """``table.csv``: each test id with its outcome under DeepSpeed and dsfunc, and the pass counts."""
    sides = {s: json.loads((out / f"{s}.json").read_text()) for s in SIDES if (out / f"{s}.json").exists()}
    ids = sorted(set().union(*sides.values()))
    with open(out / "table.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["test_id", *sides])
        for test_id in ids:
            writer.writerow([test_id, *(sides[s].get(test_id, "not run") for s in sides)])
    for side, results in sides.items():
        print(f"{side}: {sum(v == 'passed' for v in results.values())} passed of {len(results)} run")
    if set(SIDES) <= set(sides):
        both = sum(sides["ds"][i] == "passed" and sides["dsfunc"].get(i) == "passed" for i in sides["ds"])
        print(f"dsfunc passes {both} of the {sum(v == 'passed' for v in sides['ds'].values())} that pass under DeepSpeed")
        prefixes = internal_prefixes()
        public = [i for i, v in sides["ds"].items() if v == "passed" and not is_internal(i, prefixes)]
        ours = sum(sides["dsfunc"].get(i) == "passed" for i in public)
        print(f"public API: dsfunc passes {ours} of the {len(public)} that pass under DeepSpeed "
              f"({100 * ours / max(1, len(public)):.0f}%; internal.txt lists the others)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--repo", type=Path, help="a DeepSpeed git repository (a bare one works)")
    where.add_argument("--tests", type=Path, help="an existing DeepSpeed tests folder (with unit/)")
    parser.add_argument("--ref", default="HEAD", help="the commit or tag of --repo (default HEAD)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the logs, <side>.json, table.csv")
    parser.add_argument("--side", choices=(*SIDES, "both"), default="both")
    parser.add_argument("--paths", nargs="+", default=list(FOLDERS),
                        help="folders or files under tests/unit, run in this order")
    parser.add_argument("--select", type=Path, help="a <side>.json: run only its passed ids")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tests = args.tests.resolve() if args.tests else export_tests(args.repo, args.ref, Path(tmp))
        files = unit_test_files(tests, tuple(args.paths))
        select = None
        if args.select:
            select = {i for i, v in json.loads(args.select.read_text()).items() if v == "passed"}
        for side in SIDES if args.side == "both" else (args.side,):
            run_side(tests, side, files, select, args.timeout, args.out)
    write_table(args.out)


if __name__ == "__main__":
    main()
