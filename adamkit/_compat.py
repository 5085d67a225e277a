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


def _function_form() -> Callable[..., Any] | None:
  """The function form of ``compute_on`` if this JAX has one, else ``None``.

  * jax 0.6 - 0.9: ``compute_on(compute_type)`` is a context manager only (checked on
    0.6.2, 0.7.2, 0.8.3, 0.9.2).
  * jax 0.10: the context manager, plus the function form ``compute_on2(f, *,
    compute_type, out_memory_spaces)`` (checked on 0.10.2; used).
  * jax >= 0.11: ``compute_on`` itself becomes the function form; recognised by its
    ``out_memory_spaces`` parameter (not available here to run).
  """
  fn = getattr(_compute_on_mod, "compute_on", None)
  if fn is not None:
    try:
      if "out_memory_spaces" in inspect.signature(fn).parameters:
        return fn
    except (TypeError, ValueError):  # a C-implemented callable without a signature
      pass
  return getattr(_compute_on_mod, "compute_on2", None)


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
  if _FUNCTION_FORM is not None:
    return _FUNCTION_FORM(fn, compute_type="device_host", out_memory_spaces=out_spaces)

  # Context-manager-only JAX: trace fn under the host annotation, then place the outputs.
  def wrapped(*args):
    with _compute_on_mod.compute_on("device_host"):
      out = fn(*args)
    return jax.device_put(out, out_spaces)

  return wrapped
