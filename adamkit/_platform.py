"""Which platform a program is compiled for: one branch per platform, picked at lowering.

A step may be traced by one process and compiled for another platform (JAX's deviceless
compilation traces a TPU step on a CPU host), so no choice here asks
``jax.default_backend()``: each helper traces the branches this process can compile and
``jax.lax.platform_dependent`` keeps the lowering platform's. This module imports nothing
of adamkit, so the codecs (:mod:`adamkit._quant`) and the kernel rule
(:mod:`adamkit._backend`) both build on it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import pkgutil
from collections.abc import Callable
from typing import Any

import jax


def on_cpu(cpu: Callable[[], Any], other: Callable[[], Any]) -> Any:
  """``cpu()`` where the program is compiled for a CPU, ``other()`` where it is compiled
  for a TPU or GPU (both traced; ``jax.lax.platform_dependent`` keeps the one of the
  lowering platform, outside ``jit`` the default backend's). Their outputs must have the
  same structure, shapes and dtypes. Where this process can compile for no other
  platform (no ``libtpu``, no PJRT plugin) ``cpu()`` alone is traced."""
  if not tpu_compilable() and not _plugins():
    return cpu()
  return jax.lax.platform_dependent(cpu=cpu, default=other)


def on_gpu(gpu: Callable[[], Any], other: Callable[[], Any]) -> Any:
  """``gpu()`` where the program is compiled for an NVIDIA or AMD GPU, ``other()``
  elsewhere, as :func:`on_cpu` picks (same output structure). Both are traced only where
  this process can compile for a GPU (:func:`gpu_compilable`); elsewhere ``other()``
  alone, which saves the second trace."""
  if not gpu_compilable():
    return other()
  return jax.lax.platform_dependent(cuda=gpu, rocm=gpu, default=other)


def on_accelerator(accelerator: Callable[[], Any], cpu: Callable[[], Any]) -> Any:
  """``accelerator()`` where the program is compiled for a GPU or a TPU, ``cpu()``
  elsewhere (as :func:`on_gpu`; each branch traced only where it can be compiled)."""
  return on_tpu(accelerator, lambda: on_gpu(accelerator, cpu))


def on_tpu(tpu: Callable[[], Any], other: Callable[[], Any]) -> Any:
  """``tpu()`` where the program is compiled for a TPU, ``other()`` elsewhere (as
  :func:`on_gpu`). Both are traced only where this process can compile for a TPU
  (``libtpu`` installed, :func:`tpu_compilable`)."""
  if not tpu_compilable():
    return other()
  return jax.lax.platform_dependent(tpu=tpu, default=other)


@functools.cache
def tpu_compilable() -> bool:
  """Whether ``libtpu`` is installed: without it JAX cannot lower a program for a TPU."""
  return importlib.util.find_spec("libtpu") is not None


@functools.cache
def gpu_compilable() -> bool:
  """Whether a CUDA or ROCm PJRT plugin is installed: without one JAX cannot lower a
  program for a GPU, with or without the device (deviceless compiles need it too)."""
  return any(k in name for name in _plugins() for k in ("cuda", "rocm"))


@functools.cache
def _plugins() -> tuple[str, ...]:
  """The names of the PJRT plugins installed (entry points and ``jax_plugins`` modules)."""
  names = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
  spec = importlib.util.find_spec("jax_plugins")
  if spec is not None and spec.submodule_search_locations:
    names += [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]
  return tuple(names)
