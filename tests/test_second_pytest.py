"""The suite's second pytest (tests/conftest.py, WORKER_FILES): the tests of those files run
in a second pytest process beside the rest, and their items in the main run report its
outcomes. Checked on a throwaway suite with this conftest: a failure must stay a failure
(with its message), a skip a skip (with its reason), a pass a pass."""

import pathlib
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).parent

WORKER_TESTS = '''
import pytest

def test_passes():
  assert 1 + 1 == 2

def test_fails():
  assert 2 + 2 == 5, "the arithmetic the worker got wrong"

def test_skips():
  pytest.skip("a reason carried over")
'''

OTHER_TESTS = '''
def test_beside():
  assert True
'''


def test_worker_outcomes_are_reported_in_the_main_run(tmp_path):
  for name in ("conftest.py", "background.py", "registry.py"):
    shutil.copy(HERE / name, tmp_path / name)
  (tmp_path / "test_composition.py").write_text(WORKER_TESTS)  # one of WORKER_FILES
  (tmp_path / "test_other.py").write_text(OTHER_TESTS)
  (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  slow: long\n")
  done = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                         str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                        timeout=600, check=False)
  out = done.stdout
  assert done.returncode == 1, out[-3000:]
  assert "1 failed, 2 passed, 1 skipped" in out, out[-3000:]
  assert "FAILED test_composition.py::test_fails" in out, out[-3000:]
  assert "(in the second pytest)" in out and "the arithmetic the worker got wrong" in out
  assert "a reason carried over" in out
  assert "PASSED test_composition.py::test_passes" in out
  # the worker's items ran last in the main run, after the test beside them
  assert out.index("PASSED test_other.py::test_beside") < \
      out.index("PASSED test_composition.py::test_passes"), out[-3000:]
