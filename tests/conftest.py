"""Test set-up: 8 CPU devices (sharding without an accelerator) and strict dtype promotion."""

import os

# Must happen before JAX initialises its backends. The flag works on every JAX version;
# jax_num_cpu_devices (JAX >= 0.4.38) is set too where it exists.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

try:
  jax.config.update("jax_num_cpu_devices", 8)
except (AttributeError, RuntimeError):  # older JAX, or backend already up
  pass
jax.config.update("jax_numpy_dtype_promotion", "strict")

import pathlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "golden"


@pytest.fixture
def golden_dir():
  return GOLDEN


def load_golden(name):
  """Loads ``tests/golden/<name>.npz`` as (config dict, npz)."""
  import json
  d = np.load(GOLDEN / f"{name}.npz")
  return json.loads(str(d["__config__"])), d


@pytest.fixture(scope="session")
def kernel(tmp_path_factory):
  """Makes adamkit's compiled CPU kernel available, building it into a temp dir if the
  install did not (tests that need it skip where no C++ compiler is found)."""
  import adamkit as ak
  if ak.cpu_kernel_available():
    yield
    return
  out = tmp_path_factory.mktemp("kernel") / "libadamkit_cpu.so"
  try:
    ak.build_cpu_kernel(out)
  except RuntimeError as e:
    pytest.skip(f"cannot build the CPU kernel here: {e}")
  mp = pytest.MonkeyPatch()
  mp.setenv("ADAMKIT_CPU_KERNEL", str(out))  # the loader caches by path: looked up afresh
  assert ak.cpu_kernel_available()
  yield
  mp.undo()
