"""adamkit under jax.distributed: 2 processes x 2 CPU devices on 127.0.0.1 (gloo).

One launch of ``tests/multiprocess_worker.py`` per process trains a model sharded over the
global ("data", "model") mesh (model-parallel dense leaves, a data-parallel batch, an
embedding table row-sharded over all 4 devices) with every optimizer of
``tests/registry.py`` plus sparse, fused, offloaded and master-weight variants, compares
each process's shards with a one-device run, and checks ``ak.state_dict`` and orbax
checkpoints of the sharded state. Every wait is bounded: the children get a deadline and
are killed when it passes, so a hang fails the test instead of stalling CI. The run starts
in the background when collection ends (tests/background.py) and shares the machine with
the rest of the suite until its tests take its results.
"""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time

import background
import pytest

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "multiprocess_worker.py"
EXAMPLE = HERE.parent / "examples" / "two_process.py"
# The whole job: about 2.5 minutes on 2 idle cores, up to twice that beside the suite.
DEADLINE_S = 900


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(argv_of, n: int, deadline_s: float, cwd: pathlib.Path) -> list[str]:
  """Starts ``n`` processes ``argv_of(i)``, waits for all of them at most ``deadline_s``,
  kills every survivor when one fails or the deadline passes. Returns their outputs;
  raises AssertionError on a failure or timeout."""
  env = dict(os.environ, PYTHONPATH=str(cwd), XLA_FLAGS="")
  procs = [background.popen(argv_of(i), cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(n)]
  logs = [""] * n
  try:
    end = time.monotonic() + deadline_s
    while any(p.poll() is None for p in procs):
      if time.monotonic() > end:
        raise AssertionError(f"multi-process run passed its {deadline_s} s deadline")
      if any(p.poll() not in (None, 0) for p in procs):
        break  # one died: the others would wait for it in a collective
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for i, p in enumerate(procs):
      logs[i] = p.communicate(timeout=30)[0]
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{logs[i][-6000:]}"
  return logs


def _two_processes() -> list[dict]:
  """Both workers' results (one dict of case outcomes per process)."""
  with tempfile.TemporaryDirectory(prefix="adamkit-multiprocess-") as tmp:
    out = pathlib.Path(tmp)
    port = _free_port()
    run_processes(lambda i: [sys.executable, str(WORKER), str(i), "2", str(port), str(out)],
                  2, DEADLINE_S, HERE.parent)
    return [json.loads((out / f"result_{i}.json").read_text()) for i in range(2)]


BACKGROUND = {_two_processes: {"test_trains_like_one_device", "test_params_keep_their_shardings",
                                "test_checkpoints_across_processes"}}


@pytest.fixture(scope="module")
def results():
  return background.result(_two_processes, timeout=2 * DEADLINE_S)


def _cases():
  # The worker's case names, known before it runs: the registry's plus its own.
  sys.path.insert(0, str(HERE))
  from registry import REGISTRY
  own = ["sparse_adam_lazy", "sparse_adam_not_lazy", "fused_adam_xla", "fused_adam_auto",
         "fused_adamax", "fused_adam_update", "offload_state", "offload_compute",
         "master_weights", "quantized_offload_state", "routed_rows", "param_rounding_stochastic",
         "param_rounding_kahan"]
  return [f"registry:{n}" for n in REGISTRY] + own


def _outcome(results, case, what):
  for i, per_process in enumerate(results):
    assert case in per_process, f"process {i} did not run {case}"
    got = per_process[case][what]
    assert got == "ok", f"process {i}, {case}, {what}:\n{got}"


@pytest.mark.parametrize("case", _cases())
def test_trains_like_one_device(results, case):
  _outcome(results, case, "values")


@pytest.mark.parametrize("case", _cases())
def test_params_keep_their_shardings(results, case):
  _outcome(results, case, "shardings")


@pytest.mark.parametrize("case", ["sparse_adam_lazy", "offload_state", "offload_compute",
                                  "fused_adam_xla", "quantized_offload_state"])
@pytest.mark.parametrize("what", ["state_dict", "orbax"])
def test_checkpoints_across_processes(results, case, what):
  _outcome(results, f"checkpoint:{case}", what)


def test_two_process_example():
  """examples/two_process.py (docs/scaling_out.md) runs: both processes train with a
  row-sharded table on an Explicit mesh and restore their orbax checkpoint identically."""
  env = dict(os.environ, PYTHONPATH=str(HERE.parent), XLA_FLAGS="")
  out = subprocess.run([sys.executable, str(EXAMPLE)], cwd=HERE.parent, env=env,
                       capture_output=True, text=True, timeout=DEADLINE_S)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  for i in range(2):  # the two processes share the pipe: their lines may interleave
    losses = [float(x) for x in re.findall(rf"process {i}: step \d+ loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 2 and losses[1] < 0.5 * losses[0], out.stdout
    assert f"process {i}: checkpoint restored identically: True" in out.stdout
