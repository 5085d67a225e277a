"""Small shims over JAX APIs that moved between the versions adamkit supports (jax >= 0.10).

Every version-dependent JAX API adamkit uses goes through this module; each shim names the
versions it bridges (checked on jax 0.10.2 and 0.12.0.1).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import numpy as np
from jax.experimental import compute_on as _compute_on_mod

try:  # jax <= 0.11; removed in jax 0.12
  from jax.experimental.shard_alike import shard_alike as _shard_alike
except ImportError:
  _shard_alike = None
TIES_SHARDINGS = _shard_alike is not None  # tie_sharding also works inside jit in Auto mode

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


def known_sharding(x: Any) -> Any:
  """``x``'s sharding where it is known at trace time, else ``None``: a concrete array's
  own, or a traced one's on a mesh with Explicit axes (its type carries it)."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    return x.sharding
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or getattr(mesh, "empty", True):
    return None
  return sharding


def zeros_like(x: Any) -> jax.Array:
  """``jnp.zeros_like(x)`` on ``x``'s mesh.

  jax 0.12 makes ``jnp.zeros_like`` of a traced array on a mesh with Explicit axes, under
  ``jit`` with no mesh set (``jax.set_mesh``), an array of no mesh; an update of it with
  values computed from ``x`` is then refused (``ShardingTypeError``). jax 0.10 keeps the
  mesh. Here the zeros are resharded onto ``x``'s sharding where JAX dropped it.
  """
  z = jax.numpy.zeros_like(x)
  sharding = known_sharding(x)
  mesh = getattr(sharding, "mesh", None)
  if (isinstance(x, jax.core.Tracer) and mesh is not None
      and jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)
      and getattr(getattr(jax.typeof(z), "sharding", None), "mesh", mesh).empty):
    z = jax.sharding.reshard(z, sharding)
  return z


def tie_sharding(new: Any, old: Any) -> Any:
  """``new`` laid out as ``old`` (same shape).

  * jax <= 0.11: ``jax.experimental.shard_alike`` (the partitioner ties the two, also
    inside ``jit`` in Auto mode).
  * jax 0.12 removed it: ``old``'s sharding where it is known (:func:`known_sharding`) is
    imposed with ``jax.lax.with_sharding_constraint``; inside ``jit`` in Auto mode, where
    it is not, ``new`` is left to the partitioner: pass ``out_shardings`` to ``jit`` (or
    use Explicit mesh axes) where the layout matters.
  """
  if _shard_alike is not None:
    return _shard_alike(new, old)[0]
  sharding = known_sharding(old)
  if sharding is None or getattr(sharding, "memory_kind", None) not in (None, "device"):
    return new
  return jax.lax.with_sharding_constraint(new, sharding)


# ------------------------------------------------------- the devices a program is lowered for


def _devices_index_lowering(ctx, *, counts):
  """A constant: the index of the first of ``counts`` (device counts, ascending) not below
  the number of devices the program is lowered for (its partitioner's context; inside a
  ``shard_map`` or any other manual context: the last)."""
  from jax.interpreters import mlir  # noqa: PLC0415 - jax.interpreters loads lazily

  n = getattr(ctx.module_context.axis_context, "num_devices", None)
  index = len(counts) if n is None else next(
      (i for i, c in enumerate(counts) if n <= c), len(counts))
  return [mlir.ir_constant(np.int32(index))]


def _devices_index_primitive():
  from jax.interpreters import mlir  # noqa: PLC0415

  p = jax.extend.core.Primitive("adamkit_devices_index")
  p.def_abstract_eval(lambda **_: jax.core.ShapedArray((), np.int32))
  p.def_impl(lambda *, counts: np.int32(len(counts)))  # outside a program: the last
  mlir.register_lowering(p, _devices_index_lowering)
  return p


_DEVICES_INDEX = _devices_index_primitive()


def one_device(single: Callable[[], Any], many: Callable[[], Any]) -> Any:
  """``single()`` where the program is lowered for one device, else ``many()``; both are
  traced, and the choice is a constant of the lowering that XLA folds (as
  ``jax.lax.platform_dependent`` is for the platform). Inside ``jit`` a traced array of
  an ``Auto`` mesh carries no sharding, so the device count is known only here."""
  index = _DEVICES_INDEX.bind(counts=(1,))
  return jax.lax.switch(index, [single, many])
