"""adamkit's compiled CPU kernels (``adamkit/_cpu/adam_kernels.cc``) and their ``jax.ffi`` calls.

One shared library, compiled by ``pip install`` (the hatch build hook) or by
:func:`build_cpu_kernel` / ``python -m adamkit._kernels``, holds three XLA custom-call
handlers, registered for the CPU platform on first use:

* ``adamkit_cpu_step``: the dense one-pass Adam/AdaMax step of :mod:`adamkit._fused`;
* ``adamkit_cpu_sparse_lazy``: the lazy row-sparse step (distinct ids merged in a hash
  table, each touched row of the table and its moments read and written once, rows
  prefetched ahead) for ``ak.sparse_adam`` and ``ak.fused_sparse_lazy_adam``;
* ``adamkit_cpu_row_add``: the row scatter-add of ``ak.apply_updates``.

Without the library (no C++ compiler at install time), every caller uses its pure-JAX path.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

from adamkit import _kernel_build

_KERNEL_DIR = pathlib.Path(__file__).parent / "_cpu"
_KERNEL_SOURCE = _KERNEL_DIR / "adam_kernels.cc"
_KERNEL_NAME = "libadamkit_cpu.so"
_TARGET = "adamkit_cpu_step"
# XLA custom-call target -> handler symbol of the library
_TARGETS = {_TARGET: "AdamkitCpuStep", "adamkit_cpu_sparse_lazy": "AdamkitCpuSparseLazy",
            "adamkit_cpu_row_add": "AdamkitCpuRowAdd"}
_KIND = {"hat": 0, "corrected": 1, "adamax": 2}
BACKENDS = ("auto", "kernel", "xla")  # the accepted values of every `backend` argument

_lock = threading.Lock()
_registered: bool | None = None


def kernel_path() -> pathlib.Path:
  """Where the compiled CPU kernel is looked for (``$ADAMKIT_CPU_KERNEL`` overrides)."""
  env = os.environ.get("ADAMKIT_CPU_KERNEL")
  return pathlib.Path(env) if env else _KERNEL_DIR / _KERNEL_NAME


def build_cpu_kernel(output: str | os.PathLike | None = None, *, compiler: str | None = None,
                     verbose: bool = False) -> pathlib.Path:
  """Compiles adamkit's CPU kernels (``adamkit/_cpu/adam_kernels.cc``: the one-pass dense
  step, the lazy sparse step and the row add) with the system's C++ compiler against the
  XLA FFI headers that ship with jaxlib.

  ``pip install`` does this when a compiler is found; otherwise run it once (``python -m
  adamkit._kernels``). Until then ``ak.fused_adam``, ``ak.sparse_adam`` and
  ``ak.apply_updates`` use their pure-JAX paths. Returns the library's path. Raises
  ``RuntimeError`` when compiling fails.
  """
  out = pathlib.Path(output) if output else kernel_path()
  cmd = _kernel_build.compile_command(_KERNEL_SOURCE, out, jax.ffi.include_dir(), compiler)
  if verbose:
    print(" ".join(cmd), file=sys.stderr)
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
  except OSError as e:
    raise RuntimeError(f"No C++ compiler ({cmd[0]!r}): {e}") from e
  if done.returncode != 0:
    raise RuntimeError(f"Compiling the adamkit CPU kernel failed:\n{done.stderr}")
  global _registered
  with _lock:
    if _registered is False and out.resolve() == kernel_path().resolve():
      _registered = None  # look again: the library now exists
  return out


def cpu_kernel_available() -> bool:
  """True when the compiled kernels are present and registered with XLA's CPU backend."""
  global _registered
  with _lock:
    if _registered is None:
      path = kernel_path()
      try:
        lib = ctypes.cdll.LoadLibrary(str(path)) if path.exists() else None
      except OSError:
        lib = None
      # A library built from an older source lacks the newer handlers: not usable.
      if lib is not None and all(hasattr(lib, sym) for sym in _TARGETS.values()):
        for target, sym in _TARGETS.items():
          jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, sym)),
                                      platform="cpu")
        _registered = True
      else:
        _registered = False
    return _registered


def on_cpu(tree) -> bool:
  """Whether the step runs on CPU: the arrays' device, or JAX's default backend while tracing."""
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      return all(d.platform == "cpu" for d in leaf.devices())
  return jax.default_backend() == "cpu"


def dense_call(kind: str, nesterov: bool, decay: bool, offset: int, scalars, ps, gs, m, v):
  """One kernel call: params ``ps`` and grads ``gs`` (float32 leaves) and the moment buffers
  ``m``, ``v`` holding those leaves back to back from element ``offset``."""
  n = len(ps)
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in ps + [m, v]]
  aliases = {1 + i: i for i in range(n)}
  aliases.update({1 + 2 * n: n, 2 + 2 * n: n + 1})
  call = jax.ffi.ffi_call(_TARGET, shapes, input_output_aliases=aliases,
                          vmap_method="sequential")
  out = call(scalars, *ps, *gs, m, v, kind=np.int64(_KIND[kind]), nesterov=bool(nesterov),
             decay=bool(decay), offset=np.int64(offset))
  return list(out[:n]), out[n], out[n + 1]


def kernel_scalars(kind: str, b1, b2, eps, lr, wd, bc1, bc2) -> jax.Array:
  """The kernels' nine float32 scalars, in the reference's own arithmetic: XLA turns
  ``x / c`` into ``x * (1 / c)`` for a scalar ``c``, so the kernels receive the reciprocals."""
  if kind == "hat":
    c1, c2 = jnp.sqrt(bc2) / bc1, jnp.float32(1.0)
  elif kind == "corrected":
    c1, c2 = 1.0 / bc1, 1.0 / bc2
  else:
    c1, c2 = bc1, jnp.float32(1.0)
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  b1, b2 = f32(b1), f32(b2)
  return jnp.stack([b1, 1.0 - b1, b2, 1.0 - b2, f32(eps), f32(lr), f32(wd), f32(c1), f32(c2)])


def use_sparse_kernel(backend: str, *arrays, ids, num_rows: int) -> bool:
  """Whether a lazy row step (or row add) on these arrays runs in the kernel, for a
  ``backend`` argument: ``"xla"`` never; ``"kernel"`` for float32 arrays and int32 ids
  (error if the kernel is not built); ``"auto"`` when :func:`sparse_kernel_usable`."""
  if backend == "xla":
    return False
  if backend == "kernel" and not cpu_kernel_available():
    raise RuntimeError("backend='kernel' but the adamkit CPU kernel is not built: run "
                       "`python -m adamkit._kernels` (see adamkit.build_cpu_kernel).")
  if num_rows > np.iinfo(np.int32).max:  # the kernel's ids and padding id are int32
    return False
  if backend == "kernel":  # forced: any device count; other dtypes still take the XLA path
    return ids.dtype == jnp.int32 and all(a.dtype == jnp.float32 for a in arrays)
  return sparse_kernel_usable(*arrays, ids=ids)


def sparse_kernel_usable(*arrays, ids) -> bool:
  """Whether the sparse kernel can run a step on these arrays: float32 arrays and int32 ids,
  computed on one CPU device (the kernel has no sharding rule: a table sharded over several
  devices keeps the XLA path, which is partitioned by rows), and the kernel built."""
  if ids.dtype != jnp.int32 or any(a.dtype != jnp.float32 for a in arrays):
    return False
  for a in (*arrays, ids):
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
      if len(a.devices()) != 1 or next(iter(a.devices())).platform != "cpu":
        return False
  if jax.default_backend() != "cpu" or jax.device_count() != 1:
    return False
  return cpu_kernel_available()


def sparse_lazy_call(kind: str, nesterov: bool, merge: bool, scalars, ids, values, m, v,
                     table=None, *, num_rows: int, offset: int = 0):
  """One call of the lazy sparse kernel on the rows ``ids`` of a ``num_rows``-row table
  whose moments lie in ``m``, ``v`` from element ``offset``. With ``table``: returns the new
  ``(m, v, table)``; without: ``(m, v, ids, u)``, the distinct ids (``num_rows`` in unused
  slots) and the direction of each."""
  k = ids.shape[0]
  shapes = [jax.ShapeDtypeStruct(m.shape, m.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  aliases = {3: 0, 4: 1}
  operands = [scalars, ids, values, m, v]
  if table is not None:
    shapes.append(jax.ShapeDtypeStruct(table.shape, table.dtype))
    aliases[5] = 2
    operands.append(table)
  else:
    shapes += [jax.ShapeDtypeStruct((k,), jnp.int32),
               jax.ShapeDtypeStruct(values.shape, values.dtype)]
  call = jax.ffi.ffi_call("adamkit_cpu_sparse_lazy", shapes, input_output_aliases=aliases,
                          vmap_method="sequential")
  return call(*operands, kind=np.int64(_KIND[kind]), nesterov=bool(nesterov),
              apply=table is not None, merge=bool(merge), offset=np.int64(offset),
              num_rows=np.int64(num_rows))


def row_add_call(table, ids, rows):
  """``table[ids] += rows`` (repeated ids add up, ids outside the table skipped), one kernel
  call, in place when ``table`` is donated."""
  call = jax.ffi.ffi_call("adamkit_cpu_row_add", jax.ShapeDtypeStruct(table.shape, table.dtype),
                          input_output_aliases={2: 0}, vmap_method="sequential")
  return call(ids, rows, table)


if __name__ == "__main__":
  print(build_cpu_kernel(verbose=True))
