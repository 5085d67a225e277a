"""Kernel or XLA: the one rule, for the dense step and the row-sparse ops alike.

The native backend (:mod:`adamkit._cpu`) is optional: without the package or without the
compiled library, every operation of :mod:`adamkit._ops` runs in XLA. The rule is
:func:`decide`, a pure function of a few facts (testable without a compiler);
:func:`use_kernel` gathers the facts from the arrays of one operation.

The rule (``backend`` is the user's argument):

1. ``"xla"``: XLA.
2. ``"kernel"`` when the library is not built: ``RuntimeError``. ``"auto"`` without it: XLA.
3. Arrays the kernel cannot take (not float32, ids wider than int32, a table of more than
   ``2**31 - 1`` rows, moments at different offsets; quantized moments in another format
   than "8bit", of two block sizes, or for an operation other than the dense step and the
   chain form's requantization (which takes them all "8bit");
   low-precision params other than bfloat16, or bfloat16 params outside the dense step
   with ``param_rounding`` over float32 moments): XLA, even when forced.
4. Arrays spread over several devices, or on a device that is not a CPU: XLA, even when
   forced. The kernel has no sharding rule; XLA would gather a sharded array onto one
   device and return it replicated, silently. XLA's own step keeps every sharding.
5. Inside ``jit`` the placement of a traced array is unknown (but on a mesh with Explicit
   axes, where its type carries its sharding, see 4), and so is the platform the program
   will be compiled for: a TPU or GPU step may be traced by a CPU-only process (JAX's
   deviceless compilation) and a CPU step by a TPU host. ``"auto"`` traces both the
   kernel and XLA's step when the process has exactly one CPU device, and the platform
   the program is *lowered* for picks one (``jax.lax.platform_dependent``: the kernel on
   "cpu", XLA's step elsewhere; the other branch is dropped before XLA sees it), never
   ``jax.default_backend()``. With several CPU devices it is XLA. ``"kernel"`` runs the
   kernel (the caller vouches that the arrays are on one CPU device, e.g. inside a
   host-compute region; compiled for a TPU or GPU such a program fails to compile: XLA
   finds no handler for the kernel's custom call there).
6. ``"auto"`` also leaves work too small for a kernel call to XLA (a per-leaf dense step
   on a leaf below :data:`MIN_LEAF` elements: XLA's fused loop is cheaper).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adamkit import _platform, _quant
from adamkit._tree import is_tracer

try:  # the native backend is optional: a pure-JAX install has no adamkit/_cpu
  from adamkit._cpu import ffi as native_ffi
  from adamkit._cpu import load as native_load
except ImportError:  # pragma: no cover - exercised by tests/test_backend.py in a copy
  native_ffi = native_load = None

BACKENDS = ("auto", "kernel", "xla")  # the accepted values of every `backend` argument
MIN_LEAF = 1 << 15  # per-leaf dense step, backend="auto": smaller leaves stay in XLA

# Where an operation's arrays are (see placement()).
ONE_CPU, SPREAD, NOT_CPU, TRACED_ONE_CPU, TRACED_CPU, TRACED_NOT_CPU = (
    "one cpu device", "several devices", "not a cpu", "traced, one-device cpu process",
    "traced, several devices", "traced, not a cpu")


def kernel_built() -> bool:
  """True when the compiled kernels are present and registered with XLA's CPU backend."""
  return native_load is not None and native_load.cpu_kernel_available()


def placement(*arrays: Any) -> str:
  """Where the arrays of one operation live, for :func:`decide`."""
  devices = set()
  traced = False
  for a in arrays:
    if is_tracer(a):
      traced = True
      spec = getattr(getattr(jax.typeof(a), "sharding", None), "spec", None)
      if spec is not None and any(axis is not None for axis in spec):
        return SPREAD  # sharded over an Explicit mesh: known even inside jit
    elif isinstance(a, jax.Array):
      devices |= set(a.devices())
  if len(devices) > 1:
    return SPREAD
  if devices:
    return ONE_CPU if next(iter(devices)).platform == "cpu" else NOT_CPU
  if not traced:  # NumPy inputs: they land on the default device
    return ONE_CPU if jax.default_backend() == "cpu" else NOT_CPU
  cpus = _cpu_count()
  if not cpus:
    return TRACED_NOT_CPU
  return TRACED_ONE_CPU if cpus == 1 else TRACED_CPU


def _cpu_count() -> int:
  """The process's CPU devices (0 where the CPU backend is switched off)."""
  try:
    return len(jax.devices("cpu"))
  except RuntimeError:
    return 0


def decide(backend: str, *, built: bool, fits: bool, where: str, big_enough: bool = True) -> bool:
  """The rule (see the module docstring): whether the kernel runs.

  Args:
    backend: ``"auto"``, ``"kernel"`` or ``"xla"``.
    built: the library is compiled and registered.
    fits: the kernel takes these arrays (dtypes, id range, one offset).
    where: :func:`placement` of the arrays.
    big_enough: the work is worth a kernel call (``"auto"`` only).
  """
  if backend == "xla":
    return False
  if backend == "kernel" and not built:
    raise RuntimeError("backend='kernel' but the adamkit CPU kernel is not built: run "
                       "`python -m adamkit._kernels` (see adamkit.build_cpu_kernel).")
  if not built or not fits or where in (SPREAD, NOT_CPU):
    return False
  if backend == "kernel":
    return True  # forced: inside jit the caller vouches for the placement
  return big_enough and where in (ONE_CPU, TRACED_ONE_CPU)


def _kernel_ids(ids) -> bool:
  return (jnp.issubdtype(ids.dtype, jnp.signedinteger) and jnp.iinfo(ids.dtype).bits <= 32) or (
      jnp.issubdtype(ids.dtype, jnp.unsignedinteger) and jnp.iinfo(ids.dtype).bits < 32)


def _takes(a: Any, quantized: bool) -> bool:
  if _quant.is_qarray(a):
    return quantized and a.fmt.kind == "8bit"
  return a.dtype == jnp.float32


def use_kernel(backend: str, *arrays, ids=None, num_rows: int | None = None,
               fits: bool = True, big_enough: bool = True, quantized: bool = False,
               narrow: tuple = ()) -> bool | str:
  """:func:`decide` for one operation on ``arrays`` (and, for row ops, ``ids`` of a
  ``num_rows``-row table); ``fits``: the caller's own layout condition; ``quantized``: the
  operation's kernel takes "8bit" quantized moments (others never do); ``narrow``: more
  arrays of the operation that its kernel takes in bfloat16 or float32 (the rounded dense
  step's params, gradients and Kahan buffers; the caller checks which must be which).

  Returns ``False`` (XLA), :data:`NOW` (the kernel) or :data:`TARGET` (traced where the
  target is not known yet: :func:`run` lets the lowering platform pick)."""
  fits = fits and all(_takes(a, quantized) for a in arrays) and all(
      getattr(a, "dtype", None) in (jnp.bfloat16, jnp.float32) for a in narrow)
  arrays = (*arrays, *narrow)
  if ids is not None:
    fits = fits and _kernel_ids(ids) and num_rows <= np.iinfo(np.int32).max
  arrays = [x for a in arrays for x in ((a.codes, a.scales) if _quant.is_qarray(a) else (a,))]
  where = placement(*arrays, *(() if ids is None else (ids,)))
  if not decide(backend, built=kernel_built(), fits=fits, where=where, big_enough=big_enough):
    return False
  if where == TRACED_ONE_CPU and backend == "auto":
    platform = _LOWERING.get()
    return TARGET if platform is None else (NOW if platform == "cpu" else False)
  return NOW


# The platform a trace is for, where a caller knows it (see lowering_for); None: unknown.
_LOWERING: contextvars.ContextVar = contextvars.ContextVar("adamkit_lowering", default=None)


@contextlib.contextmanager
def lowering_for(platform: str | None):
  """Within it, ``use_kernel`` takes the program to be compiled for ``platform`` ("cpu"
  or another; ``None``: unknown, the default) instead of deferring to the lowering
  (:data:`TARGET`). For a region that cannot hold a platform switch of its own (a
  host-compute region): its caller switches around it, see :func:`by_platform`."""
  token = _LOWERING.set(platform)
  try:
    yield
  finally:
    _LOWERING.reset(token)


def by_platform(fn: Callable[[], Any], *arrays: Any) -> Any:
  """``fn()``, traced once per platform under :func:`lowering_for` where ``arrays`` are
  traced on a one-CPU process (the platform is the lowering's:
  :func:`adamkit._platform.on_cpu` keeps one trace), else once."""
  if _LOWERING.get() is not None or placement(*arrays) != TRACED_ONE_CPU:
    return fn()

  def on(platform):
    with lowering_for(platform):
      return fn()
  return _platform.on_cpu(lambda: on("cpu"), lambda: on("other"))


NOW, TARGET = "now", "target"  # use_kernel's yes: the kernel itself, or by the target


def run(choice: Any, kernel: Callable[[], Any], xla: Callable[[], Any]) -> Any:
  """``kernel()`` or ``xla()`` (same outputs) as :func:`use_kernel` chose: ``xla()`` for
  ``False``, ``kernel()`` for ``NOW``, and for ``TARGET`` whichever the platform the
  program is lowered for takes (:func:`adamkit._platform.on_cpu`)."""
  if not choice:
    return xla()
  if choice == NOW:
    return kernel()
  return _platform.on_cpu(kernel, xla)
