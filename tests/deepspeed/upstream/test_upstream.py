"""A fixed subset of DeepSpeed's own unit tests passes under dsfunc (``DSFUNC_AS_DEEPSPEED=1``): tests that pass
under real DeepSpeed 0.19.8 on the CPU and exercise what scripts use (the config and its classes, checkpoint
tag validation, the launcher's arguments). ``expected_pass.txt`` lists them; one that stops passing fails this
test, naming it and its log. The full comparison is ``run.py`` (hours on two cores).

DeepSpeed's tests are its repository's ``tests/`` folder (v0.19.8's; its source distribution on PyPI has none, and
CI reaches no other host), so this test runs where a developer has put them: ``DSFUNC_DEEPSPEED_TESTS``, or
``~/.cache/dsfunc/deepspeed-0.19.8/tests`` (e.g. ``git archive v0.19.8 tests | tar -x -C ~/.cache/dsfunc/deepspeed-0.19.8``
in a clone of DeepSpeed), and skips elsewhere, saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.deepspeed.upstream import run

EXPECTED = Path(__file__).with_name("expected_pass.txt")
TESTS = Path(os.environ.get("DSFUNC_DEEPSPEED_TESTS",
                            Path.home() / ".cache" / "dsfunc" / "deepspeed-0.19.8" / "tests"))


def expected_ids() -> list[str]:
    return [line for line in EXPECTED.read_text().splitlines() if line and not line.startswith("#")]


@pytest.mark.timeout(900)
def test_deepspeeds_own_tests_pass_under_dsfunc(tmp_path):
    if not (TESTS / "unit" / "common.py").is_file():
        pytest.skip(f"DeepSpeed's tests are not in {TESTS}: put its repository's tests/ folder there, or set "
                    "DSFUNC_DEEPSPEED_TESTS")
    ids = expected_ids()
    # one pytest process for them all: DeepSpeed's conftest and imports cost ~7 s a process, most of a file's run
    log = tmp_path / "unit.log"
    got = run.run_file(TESTS, "unit", "dsfunc", ids, 120, log)
    failed = {i: got.get(i, "not run") for i in ids if got.get(i) != "passed"}
    assert not failed, f"{len(failed)} of DeepSpeed's tests no longer pass under dsfunc: {failed}\nlog: {log}"


HANGS = """
import signal, time

def test_first():
    pass

def test_hangs():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # pytest-timeout cannot stop it: the runner must
    time.sleep(600)

def test_after():
    pass

def test_skipped():
    import pytest
    pytest.skip("no")
"""


@pytest.mark.timeout(120)
def test_a_file_that_overruns_goes_on_after_the_test_it_stopped_in(tmp_path):
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_hangs.py").write_text(HANGS)
    got = run.run_file(tmp_path, "unit/test_hangs.py", "ds", None, 5, tmp_path / "hangs.log")
    assert got == {"unit/test_hangs.py::test_first": "passed", "unit/test_hangs.py::test_hangs": "timeout",
                   "unit/test_hangs.py::test_after": "passed", "unit/test_hangs.py::test_skipped": "skipped"}
