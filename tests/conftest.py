"""Test set-up: 8 CPU devices (sharding without an accelerator) and strict dtype promotion."""

import os

# Must happen before JAX initialises its backends. The flag works on every JAX version;
# jax_num_cpu_devices (JAX >= 0.4.38) is set too where it exists.
# The suite runs on CPU devices; where jax[tpu] or a CUDA plugin is installed (the
# accelerator tier compiles for those targets without their hardware) JAX must not look for
# a TPU or GPU at start-up.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The accelerator tier loads libtpu here and in its worker process at once (libtpu's lock).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

try:
  jax.config.update("jax_num_cpu_devices", 8)
except (AttributeError, RuntimeError):  # older JAX, or backend already up
  pass
jax.config.update("jax_numpy_dtype_promotion", "strict")

import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

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


def load_ao_8bit_run(run):
  """One torchao run of ``tests/golden/ao_8bit_runs.npz`` (see make_ao_8bit_runs.py) as
  (config dict, initial params, gradients per step, {step: recorded params}, {name:
  whether torchao kept that leaf's moments in 8 bits})."""
  import json

  from golden.make_ao_8bit_runs import STEPS, inputs
  d = np.load(GOLDEN / "ao_8bit_runs.npz")
  init, grads = inputs()
  recorded = {t: {k: d[f"{run}/params/{t}/{k}"] for k in init} for t in STEPS}
  quantized = {k: bool(d[f"{run}/quantized/{k}"]) for k in init}
  return json.loads(str(d[f"{run}/config"])), init, grads, recorded, quantized


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
# cores); CI runs everything. The marks are set here, in one place:
# - whole files: the sanitizer build of the kernels, the two-process runs;
# - the notebooks (nbmake runs each in its own kernel);
# - single long tests (SLOW_TESTS): the demo's runs, MathJax in a browser, a repeated docs
#   run, a fresh interpreter without the kernels, the cross-checks against PyTorch;
# - the registry products: a suite parametrized over every registry optimizer runs in the
#   fast tier on FAST_NAMES only (the options-heavy Adam, AdamW and sparse chains and the
#   offloaded sparse optimizer);
# - every other parametrized test runs FAST_CASES of its cases (its first and its last),
#   except the docs' pages, which all run, and the registry products above.
SLOW_FILES = {"test_sanitizer.py", "test_multiprocess.py"}
SLOW_TESTS = {"test_demo.py::test_demo_main_trains_every_optimizer",
              # 26 compiles for TPU and GPU targets (the table of docs/accelerators.md)
              "test_accelerator.py::test_docs_device_table",
              "test_demo.py::test_demo_subset_and_plain_progress",
              # the same pages as test_readme.py's test_page_examples_run
              "test_composition.py::test_docs_examples_run",
              # a fresh interpreter importing adamkit without its kernels
              "test_backend.py::test_library_works_without_its_native_backend",
              # cross-checks against PyTorch (importing torch alone takes seconds)
              "test_adamw.py::test_amsgrad_matches_torch_adam_and_adamw",
              "test_sparse.py::test_lazy_matches_torch_sparse_adam"}
FAST_NAMES = {"adam_full", "adamw_amsgrad_full", "sparse_adam_full", "offload_sparse_adam_state"}
FAST_CASES = 2
EVERY_CASE = {"test_readme.py::test_page_examples_run"}


def _spread(n: int, k: int) -> set[int]:
  """``k`` indices spread over ``range(n)``, first and last included."""
  return set(range(n)) if n <= k else {round(i * (n - 1) / (k - 1)) for i in range(k)}


def pytest_collection_modifyitems(config, items):
  from registry import REGISTRY
  assert FAST_NAMES <= set(REGISTRY), FAST_NAMES - set(REGISTRY)
  cases = {}  # test -> its parametrized items still in the fast tier
  for item in items:
    test = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
    name = getattr(item, "callspec", None) and item.callspec.params.get("name")
    if (item.path.name in SLOW_FILES or item.path.suffix == ".ipynb" or test in SLOW_TESTS
        or (isinstance(name, str) and name in REGISTRY and name not in FAST_NAMES)):
      item.add_marker(pytest.mark.slow)
    elif hasattr(item, "callspec") and test not in EVERY_CASE and name not in FAST_NAMES:
      cases.setdefault(test, []).append(item)
  for group in cases.values():
    keep = _spread(len(group), FAST_CASES)
    for i, item in enumerate(group):
      if i not in keep:
        item.add_marker(pytest.mark.slow)
  if not WORKER:  # the files a second pytest runs go last here (a stable sort)
    items.sort(key=lambda item: item.path.name in WORKER_FILES)


# ------------------------------------------------------------------ background jobs


# Whole files run by a second pytest process beside this one (the last job of the
# background lane): their items here wait for its outcome and report it. They are the
# largest registry products; the rest of the suite runs meanwhile.
WORKER_FILES = {"test_composition.py", "test_suite.py"}
WORKER = os.environ.get("ADAMKIT_TEST_WORKER")  # in that second process: its report file
_REPORTS: dict[str, dict] = {}


def pytest_collection_finish(session):
  """Starts the long subprocess jobs (tests/background.py) of the modules that have
  selected tests, then the second pytest for the selected tests of WORKER_FILES, so that
  they run beside the rest of the suite."""
  if session.config.option.collectonly or WORKER:
    return
  import background
  jobs = []
  for item in session.items:
    bg = getattr(getattr(item, "module", None), "BACKGROUND", None)
    # a job of every test of the module, or {job: the names of the tests that use it}
    for job, names in ({bg: None} if callable(bg) else bg or {}).items():
      if job not in jobs and (names is None or getattr(item, "originalname", None) in names):
        jobs.append(job)
  theirs = [item for item in session.items if item.path.name in WORKER_FILES]
  if theirs and len(theirs) < len(session.items):  # else nothing would run beside it
    job = functools.partial(_second_pytest, session.config.rootpath,
                            tuple(item.nodeid for item in theirs))
    for item in theirs:
      item.runtest = functools.partial(_replay, item, job)
    jobs.append(job)
  for job in jobs:
    background.submit(job)


def _second_pytest(root: pathlib.Path, nodeids: tuple) -> tuple[dict, str]:
  """Runs ``nodeids`` in a second pytest: ``({nodeid: outcome}, the end of its output)``."""
  import background
  with tempfile.TemporaryDirectory(prefix="adamkit-worker-") as tmp:
    report = pathlib.Path(tmp) / "report.json"
    done = background.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *nodeids], cwd=root, timeout=3600,
                          env=dict(os.environ, ADAMKIT_TEST_WORKER=str(report)))
    outcomes = json.loads(report.read_text()) if report.exists() else {}
  return outcomes, (done.stdout[-6000:] + done.stderr[-3000:])


def _replay(item, job) -> None:
  """``item``'s outcome in the second pytest, as this item's."""
  import background
  outcomes, log = background.result(job, timeout=3600)
  got = outcomes.get(item.nodeid)
  if got is None:
    pytest.fail(f"the second pytest did not report {item.nodeid}:\n{log}", pytrace=False)
  if got["outcome"] == "skipped":
    pytest.skip(got["text"])
  if got["outcome"] == "failed":
    pytest.fail(f"(in the second pytest)\n{got['text']}", pytrace=False)


def pytest_runtest_logreport(report):
  """In the second pytest: each test's outcome, for the first one to report."""
  if not WORKER:
    return
  got = _REPORTS.setdefault(report.nodeid, {"outcome": "passed", "text": ""})
  if report.failed:
    got["outcome"] = "failed"
    got["text"] += f"[{report.when}]\n{report.longreprtext}\n"
  elif report.skipped and got["outcome"] == "passed":
    got["outcome"] = "skipped"
    got["text"] = (report.longrepr[2] if isinstance(report.longrepr, tuple)
                   else str(report.longrepr))


def pytest_sessionfinish(session, exitstatus):
  if WORKER:
    pathlib.Path(WORKER).write_text(json.dumps(_REPORTS))
    return
  import background
  background.stop()



def _jit_dispatch_caches() -> list:
  """JAX's two global C++ dispatch caches (private; empty where a JAX version lacks them)."""
  try:
    from jax._src import pjit
    return [pjit._cpp_pjit_cache_fun_only, pjit._cpp_pjit_cache_explicit_attributes]
  except (ImportError, AttributeError):
    return []


def pytest_runtest_setup(item):
  """Empties JAX's caches before one of its C++ dispatch caches fills up.

  jax 0.10.2: once a dispatch cache holds its capacity (8192) of live entries, every jitted
  function created later in the process keeps no fast-path entry (``_cache_size()`` stays
  0: jax-ml/jax#39078). The whole suite, 3,000 tests in one process, reaches that, and the
  tests that assert one compilation per step would then fail for a reason of JAX's.
  """
  for cache in _jit_dispatch_caches():
    if cache.size() >= cache.capacity() * 3 // 4:
      jax.clear_caches()
      return
