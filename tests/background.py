"""Long subprocess jobs of the suite, started when collection ends and run beside it.

The two-process runs (tests/test_multiprocess.py), the sanitizer build and run
(tests/test_sanitizer.py) and the documentation site with its math typeset in a browser
(tests/test_docs_build.py) spend minutes in child processes, while the main pytest process
mostly compiles on one core. A test module names its jobs in a module-level
``BACKGROUND``: a function of no argument, run in a worker thread, returning what its
fixture needs (the job of every test of the module), or a dict of such functions to the
names of the tests that use each. ``pytest_collection_finish`` in conftest.py submits the
jobs of the selected tests, one at a time in the order of the tests, and the fixture takes
the result with :func:`result` (running the job in place when it was not submitted, e.g.
a module imported on its own). Every child process is started through :func:`popen`, so that
:func:`stop` (at the end of the session, a failure or ``-x`` included) kills what is
still running instead of leaving the interpreter waiting on it.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import threading
from collections.abc import Callable

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_jobs: dict[Callable, concurrent.futures.Future] = {}
_children: list[subprocess.Popen] = []
_lock = threading.Lock()
_stopped = threading.Event()


def submit(job: Callable) -> None:
  """Starts ``job`` in the background (once), after the jobs submitted before it."""
  global _pool
  with _lock:
    if job in _jobs:
      return
    if _pool is None:
      # One worker: two jobs at once would take both cores from the main process.
      _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="test-background")
    _jobs[job] = _pool.submit(job)


def result(job: Callable, timeout: float):
  """``job``'s return value (its exception re-raised), waiting at most ``timeout`` seconds
  once it has started; runs it here if it was never submitted."""
  with _lock:
    future = _jobs.get(job)
  if future is None:
    return job()
  return future.result(timeout=timeout)


def popen(argv, **kwargs) -> subprocess.Popen:
  """``subprocess.Popen`` whose process :func:`stop` kills."""
  with _lock:
    if _stopped.is_set():
      raise RuntimeError("the test session has ended")
    proc = subprocess.Popen(argv, **kwargs)
    _children.append(proc)
  return proc


def run(argv, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
  """``subprocess.run(argv, capture_output=True, text=True)`` through :func:`popen`."""
  with popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
             **kwargs) as proc:
    try:
      out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
      raise AssertionError(
          f"{argv[:2]} passed its {timeout} s deadline:\n{(out + err)[-6000:]}") from None
  return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def stop() -> None:
  """Kills every child still running and drops the jobs that have not started."""
  _stopped.set()
  with _lock:
    for future in _jobs.values():
      future.cancel()
    for proc in _children:
      if proc.poll() is None:
        proc.kill()
  if _pool is not None:
    _pool.shutdown(wait=True, cancel_futures=True)
