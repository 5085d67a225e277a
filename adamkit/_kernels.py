"""The public face of the native backend: ``ak.build_cpu_kernel``, ``ak.cpu_kernel_available``
and ``python -m adamkit._kernels`` (build the kernels).

The backend itself lives in :mod:`adamkit._cpu` (build, load, ffi); which of it runs is
decided in :mod:`adamkit._backend`; the operations are in :mod:`adamkit._ops`. Without
``adamkit/_cpu`` this module still imports: nothing is available, building raises.
"""

from __future__ import annotations

import os
import pathlib

from adamkit import _backend

BACKENDS = _backend.BACKENDS  # kept for callers of the v0.1 name (the rule lives in _backend)


def build_cpu_kernel(output: str | os.PathLike | None = None, *, compiler: str | None = None,
                     verbose: bool = False) -> pathlib.Path:
  """Compiles adamkit's CPU kernels (``adamkit/_cpu/adam_kernels.cc``: the one-pass dense
  step, the lazy sparse step and the row add) with the system's C++ compiler against the
  XLA FFI headers that ship with jaxlib.

  ``pip install`` does this when a compiler is found; otherwise run it once (``python -m
  adamkit._kernels``). Until then ``ak.fused_adam``, ``ak.sparse_adam`` and
  ``ak.apply_updates`` use their pure-JAX paths.

  Args:
    output: where to write the library (default: where it is looked for,
      ``adamkit/_cpu/libadamkit_cpu-jaxlib<version>.so`` or ``$ADAMKIT_CPU_KERNEL``).
    compiler: the C++ compiler (default ``$CXX`` or ``c++``).
    verbose: print the compiler command.

  Returns:
    The library's path.

  Raises:
    RuntimeError: no compiler, compiling failed, or this install has no native backend.
  """
  if _backend.native_load is None:
    raise RuntimeError("This adamkit install has no native backend (adamkit/_cpu).")
  from adamkit._cpu import build  # noqa: PLC0415

  return build.build_cpu_kernel(output, compiler=compiler, verbose=verbose)


def cpu_kernel_available() -> bool:
  """True when the compiled CPU kernels are present and registered with XLA."""
  return _backend.kernel_built()


if __name__ == "__main__":
  print(build_cpu_kernel(verbose=True))
