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


# ------------------------------------------------------------------------ the fast tier
# `python -m pytest -m "not slow"` is the contributors' quick run (a few minutes on 2
# cores); CI runs everything. Slow, and marked here in one place:
# - whole files: the sanitizer build of the kernels, the two-process runs;
# - the notebooks (nbmake runs each in its own kernel);
# - single long tests: the demo's full run, MathJax in a browser;
# - the registry products: a suite parametrized over every registry optimizer runs in the
#   fast tier on FAST_NAMES only (one entry per family: the options-heavy chains, the
#   sparse, fused, offloaded and master-weights forms), on all of them in the full run.
SLOW_FILES = {"test_sanitizer.py", "test_multiprocess.py"}
SLOW_TESTS = {"test_demo.py::test_demo_main_trains_every_optimizer"}
FAST_NAMES = {"adam_full", "adamw_amsgrad_full", "adamax_wd_groups", "sparse_adam_full",
              "fused_adam", "offload_sparse_adam_state", "master_weights_adamw"}


def pytest_collection_modifyitems(config, items):
  from registry import REGISTRY
  assert FAST_NAMES <= set(REGISTRY), FAST_NAMES - set(REGISTRY)
  for item in items:
    name = getattr(item, "callspec", None) and item.callspec.params.get("name")
    slow = (item.path.name in SLOW_FILES or item.path.suffix == ".ipynb"
            or f"{item.path.name}::{getattr(item, 'originalname', item.name)}" in SLOW_TESTS
            or (isinstance(name, str) and name in REGISTRY and name not in FAST_NAMES))
    if slow:
      item.add_marker(pytest.mark.slow)
