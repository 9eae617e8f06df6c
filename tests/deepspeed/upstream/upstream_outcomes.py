"""A pytest plugin for run.py: each test's start and reports appended to the file ``UPSTREAM_OUTCOMES`` names, one
JSON object a line, as they happen. A run stopped for overrunning its time keeps what its finished tests gave (a
JUnit report is written only at the end), and says which test was running and since when."""

from __future__ import annotations

import json
import os
import time


def _write(record: dict) -> None:
    with open(os.environ["UPSTREAM_OUTCOMES"], "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session) -> None:
    _write({"collected": [item.nodeid for item in session.items]})


def pytest_collectreport(report) -> None:
    if report.failed:
        _write({"id": report.nodeid, "when": "collect", "outcome": "failed"})


def pytest_runtest_logstart(nodeid, location) -> None:
    _write({"id": nodeid, "start": time.time()})


def pytest_runtest_logreport(report) -> None:
    _write({"id": report.nodeid, "when": report.when, "outcome": report.outcome})
