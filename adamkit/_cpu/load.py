"""Finding, loading and registering the compiled CPU kernels (once per library path)."""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import pathlib
import threading

import jax

from adamkit._cpu import build

# XLA custom-call target -> handler symbol of the library.
TARGETS = {"adamkit_cpu_step": "AdamkitCpuStep", "adamkit_cpu_sparse_lazy": "AdamkitCpuSparseLazy",
           "adamkit_cpu_row_add": "AdamkitCpuRowAdd",
           "adamkit_cpu_step_quantized": "AdamkitCpuStepQuantized",
           "adamkit_cpu_step_rounded": "AdamkitCpuStepRounded",
           "adamkit_cpu_requantize": "AdamkitCpuRequantize",
           "adamkit_cpu_sparse_lazy_quantized": "AdamkitCpuSparseLazyQuantized"}

_lock = threading.Lock()
_found: dict[pathlib.Path, bool] = {}  # library path -> usable (looked up once per path)
_registered_from: pathlib.Path | None = None  # XLA keeps the first registration of a name


def kernel_path() -> pathlib.Path:
  """Where the compiled CPU kernel is looked for (``$ADAMKIT_CPU_KERNEL`` overrides)."""
  env = os.environ.get("ADAMKIT_CPU_KERNEL")
  if env:
    return pathlib.Path(env)
  return pathlib.Path(__file__).parent / build.library_name(jaxlib_version())


def jaxlib_version() -> str:
  """The installed jaxlib's version (the headers the kernel must be compiled against)."""
  return importlib.metadata.version("jaxlib")


def forget(path: str | os.PathLike) -> None:
  """Look for the library at ``path`` again (it was just built)."""
  with _lock:
    _found.pop(pathlib.Path(path).resolve(), None)


def cpu_kernel_available() -> bool:
  """True when the compiled kernels are present and registered with XLA's CPU backend."""
  global _registered_from
  path = kernel_path().resolve()
  with _lock:
    if path not in _found:
      try:
        lib = ctypes.cdll.LoadLibrary(str(path)) if path.exists() else None
      except OSError:
        lib = None
      # A library built from an older source lacks the newer handlers: not usable.
      usable = lib is not None and all(hasattr(lib, sym) for sym in TARGETS.values())
      if usable and _registered_from is None:
        for target, sym in TARGETS.items():
          jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, sym)),
                                      platform="cpu")
        _registered_from = path
      _found[path] = usable
    return _found[path]
