"""Small shims over JAX APIs that moved between the versions adamkit supports (jax >= 0.10).

Only what :mod:`adamkit._offload` needs lives here; each shim names the versions it bridges.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import compute_on as _compute_on_mod

# Where a traced array lives, for jax.device_put inside jit (jax.memory.Space: jax >= 0.7;
# adamkit requires jax >= 0.10, the first release whose jit keeps host-placed outputs in
# host memory on CPU).
HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


def _function_form() -> Callable[..., Any]:
  """The function form of ``compute_on``.

  * jax 0.10: the context manager ``compute_on``, plus the function form ``compute_on2(f,
    *, compute_type, out_memory_spaces)`` (checked on 0.10.2; used).
  * jax >= 0.11: ``compute_on`` itself becomes the function form; recognised by its
    ``out_memory_spaces`` parameter (not available here to run).

  (jax 0.6 - 0.9 had the context manager only; adamkit requires jax >= 0.10.)
  """
  fn = getattr(_compute_on_mod, "compute_on", None)
  if fn is not None:
    try:
      if "out_memory_spaces" in inspect.signature(fn).parameters:
        return fn
    except (TypeError, ValueError):  # a C-implemented callable without a signature
      pass
  return _compute_on_mod.compute_on2


_FUNCTION_FORM = _function_form()


def on_host(fn: Callable[..., Any], out_spaces: Any) -> Callable[..., Any]:
  """``fn`` computed on the host (``compute_on("device_host")``).

  Args:
    fn: a function of arrays (pytrees allowed) returning a pytree.
    out_spaces: a pytree prefix of ``fn``'s output made of ``jax.memory.Space`` values: the
      memory each output is left in.

  Returns:
    A function with ``fn``'s signature. Its inputs should already be in host memory.
  """
  return _FUNCTION_FORM(fn, compute_type="device_host", out_memory_spaces=out_spaces)
