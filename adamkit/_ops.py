"""The optimizer's operations, backend-neutral: the dense step, the lazy row step, the row add.

Code above this module asks for an operation; :mod:`adamkit._backend` decides whether the
C++ kernel or XLA computes it, and both give the same numbers (to float32 rounding: the
kernel computes the formula as written, XLA may contract a multiply and an add into one
FMA). Every operation checks its buffers against each other here, before either backend
runs, so a malformed state is a ``ValueError``, never a broadcast, a silent wrong row or
a write outside a buffer.

Moments are passed as buffers plus an optional offset: ``m_at=None`` means ``m`` is the
leaf's own array (shaped like the param); an int means the leaf's moment lies flat in the
1-D buffer ``m`` from that element (the multi-tensor layout of ``ak.fused_adam``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from adamkit import _backend, _row_sharded
from adamkit._adam import adam_direction
from adamkit._adamax import adamax_direction
from adamkit._dtypes import compute_dtype
from adamkit._sparse_types import RowSparse, gather_rows, safe_ids, scatter_rows

LEAVES_PER_CALL = 32  # dense kernel: leaves per call (XLA's compile time grows faster)


class Hyper(NamedTuple):
  """One step's rule and hyperparameters (float32 scalars)."""
  kind: str  # "hat" / "corrected" (Adam's eps placements) or "adamax"
  nesterov: bool
  b1: jax.Array
  b2: jax.Array
  eps: jax.Array
  bc1: jax.Array  # 1 - b1**t
  bc2: jax.Array  # 1 - b2**t
  lr: jax.Array = np.float32(0.0)  # learning rate (ops that return a direction ignore it)
  wd: jax.Array = np.float32(0.0)  # L2 coefficient of the dense step's `decay`


def _kernel_args(h: Hyper):
  f = _backend.native_ffi
  s = f.scalars(h.kind, b1=h.b1, b2=h.b2, eps=h.eps, lr=h.lr, wd=h.wd, bc1=h.bc1, bc2=h.bc2)
  return f.Variant(h.kind, h.nesterov), s


def direction(h: Hyper, g, m, v):
  """The update direction of one leaf, in the compute dtype. Returns ``(u, m, v)``."""
  if h.kind == "adamax":
    return adamax_direction(g, m, v, b1=h.b1, b2=h.b2, eps=h.eps, bc1=h.bc1)
  return adam_direction(g, m, v, b1=h.b1, b2=h.b2, eps=h.eps, bc1=h.bc1, bc2=h.bc2,
                        eps_mode=h.kind, nesterov=h.nesterov)


def lr_step(lr, u):
  """``-lr * u`` rounded as the learning-rate link rounds it (in ``u``'s dtype)."""
  return (-lr * u.astype(compute_dtype(u))).astype(u.dtype)


# ------------------------------------------------------------------- moment buffers


def check_moments(m, at: int | None, shape: tuple, what: str) -> None:
  """``m`` must hold a moment of ``shape``: be of that shape (``at=None``) or a 1-D buffer
  with ``prod(shape)`` elements from ``at``."""
  if not jnp.issubdtype(m.dtype, jnp.floating):
    raise TypeError(f"The {what} must be floating point, got dtype {m.dtype}.")
  if at is None:
    if tuple(m.shape) != tuple(shape):
      raise ValueError(f"The {what} has shape {tuple(m.shape)}, expected {tuple(shape)} "
                       "(the param's shape).")
  elif m.ndim != 1 or not 0 <= at <= m.shape[0] - int(np.prod(shape, dtype=np.int64)):
    raise ValueError(f"The {what} buffer of shape {tuple(m.shape)} cannot hold "
                     f"{int(np.prod(shape, dtype=np.int64))} elements from offset {at}.")


def view(m, at: int | None, shape: tuple):
  """The moment of a leaf of ``shape`` held in ``m`` (see :func:`check_moments`)."""
  if at is None:
    return m
  size = int(np.prod(shape, dtype=np.int64))
  return lax.slice(m, (at,), (at + size,)).reshape(shape)


def put(m, at: int | None, x):
  """``m`` with the leaf moment ``x`` written back (in place when ``m`` is donated)."""
  if at is None:
    return x
  return lax.dynamic_update_slice(m, x.ravel().astype(m.dtype), (at,))


def check_rows(g: RowSparse, table_shape: tuple, what: str = "gradient") -> None:
  """A row-sparse ``g`` must have one row per id, each shaped like the table's rows."""
  ids, values = g.indices, g.values
  if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"The row-sparse {what}'s ids must be 1-D integers, got {ids.dtype}"
                     f"{tuple(ids.shape)}.")
  if values.ndim < 1 or values.shape[0] != ids.shape[0]:
    raise ValueError(f"The row-sparse {what} has {ids.shape[0]} ids but values of shape "
                     f"{tuple(values.shape)}: one row of values per id is needed.")
  if len(table_shape) < 1 or g.num_rows != table_shape[0] or \
     tuple(values.shape[1:]) != tuple(table_shape[1:]):
    raise ValueError(f"The row-sparse {what} of dense shape {g.shape} does not fit a table "
                     f"of shape {tuple(table_shape)}.")


# ------------------------------------------------------------------------ dense step


def dense_step(h: Hyper, params: Sequence[jax.Array], grads: Sequence[jax.Array], m, v, *,
               m_at: Sequence[int] | None = None, v_at: Sequence[int] | None = None,
               decay: bool = False, backend: str = "auto"):
  """One dense step on consecutive leaves: decay (``g + wd * p`` with ``decay``), moments,
  direction, ``p - lr * u``. ``m``, ``v``: one leaf's own moments (``m_at=None``), or flat
  buffers holding the leaves' moments from the offsets ``m_at``, ``v_at``. Returns
  ``(params, m, v)``; the reference's rounding points: direction in the gradient's dtype,
  the learning rate, then the params' dtype."""
  params, grads = list(params), list(grads)
  _check_dense(params, grads, m, v, m_at, v_at)
  sizes = [p.size for p in params]
  contiguous = m_at is None or (list(m_at) == list(v_at) and all(
      m_at[j + 1] == m_at[j] + sizes[j] for j in range(len(params) - 1)))
  if _backend.use_kernel(backend, *params, *grads, m, v, fits=contiguous,
                         big_enough=m_at is not None or sum(sizes) >= _backend.MIN_LEAF):
    variant, s = _kernel_args(h)
    out = []
    for lo in range(0, len(params), LEAVES_PER_CALL):
      hi = min(lo + LEAVES_PER_CALL, len(params))
      ps, (m, v) = _backend.native_ffi.dense_step(
          variant, s, params[lo:hi], grads[lo:hi], (m, v), decay=decay,
          offset=0 if m_at is None else m_at[lo])
      out += ps
    return out, m, v
  return _dense_xla(_dense_leaf, h, params, grads, m, v, m_at, v_at, decay)


def dense_update(h: Hyper, params: Sequence[jax.Array], grads: Sequence[jax.Array], m, v, *,
                 m_at: Sequence[int] | None = None, v_at: Sequence[int] | None = None,
                 decay: bool = False):
  """:func:`dense_step`'s arithmetic, returning the optax protocol's update ``-lr * u`` of
  each leaf instead of its new params: rounded as the named optimizer's chain rounds it, so
  ``p + update`` is ``optax.apply_updates``' result bit for bit. Always XLA (the kernel
  writes params, not updates). Returns ``(updates, m, v)``."""
  params, grads = list(params), list(grads)
  _check_dense(params, grads, m, v, m_at, v_at)
  return _dense_xla(_leaf_update, h, params, grads, m, v, m_at, v_at, decay)


def _check_dense(params, grads, m, v, m_at, v_at) -> None:
  if m_at is None and len(params) != 1:
    raise ValueError("Leaf-shaped moments hold one leaf; pass offsets for several.")
  for j, (p, g) in enumerate(zip(params, grads)):
    if g.shape != p.shape:
      raise ValueError(f"A gradient of shape {g.shape} for a param of shape {p.shape}.")
    check_moments(m, None if m_at is None else m_at[j], p.shape, "first moment")
    check_moments(v, None if v_at is None else v_at[j], p.shape, "second moment")


def _dense_xla(leaf_fn, h: Hyper, params, grads, m, v, m_at, v_at, decay: bool):
  """XLA's loop over the leaves: ``leaf_fn`` on each leaf's moment views, the new moments
  written back into their buffers."""
  out = []
  for j, (p, g) in enumerate(zip(params, grads)):
    mj = None if m_at is None else m_at[j]
    vj = None if v_at is None else v_at[j]
    new_p, new_m, new_v = leaf_fn(h, p, g, view(m, mj, p.shape), view(v, vj, p.shape), decay)
    out.append(new_p)
    m, v = put(m, mj, new_m), put(v, vj, new_v)
  return out, m, v


def _dense_leaf(h: Hyper, p, g, m, v, decay: bool):
  step, m2, v2 = _leaf_update(h, p, g, m, v, decay)
  return (p + step).astype(p.dtype), m2, v2


def _leaf_update(h: Hyper, p, g, m, v, decay: bool):
  """One leaf's ``-lr * u`` and new moments: decay, direction in the gradient's dtype,
  the learning rate."""
  if decay:
    g = g + (h.wd * p.astype(jnp.float32)).astype(g.dtype)
  dt = compute_dtype(g)
  u, m2, v2 = direction(h, g.astype(dt), m.astype(dt), v.astype(dt))
  u = u.astype(g.dtype)
  return lr_step(h.lr, u), m2.astype(m.dtype), v2.astype(v.dtype)


# -------------------------------------------------------------------------- row ops


def lazy_rows(h: Hyper, g: RowSparse, m, v, *, table_shape: tuple, m_at: int | None = None,
              v_at: int | None = None, merge: bool = True, backend: str = "auto"):
  """Adam's direction on the rows of ``g`` only (repeated ids summed first when ``merge``).
  Returns ``(ids, u, m, v)``: distinct ids (padding ``num_rows``, dropped by scatters), one
  direction row each (compute dtype on XLA, float32 on the kernel), the new moments."""
  _check_row_step(g, m, v, table_shape, m_at, v_at)
  if _use_row_kernel(backend, g, m, v, m_at, v_at):
    variant, s = _kernel_args(h)
    ids, u, (m, v) = _backend.native_ffi.sparse_lazy(
        variant, s, g.indices, g.values, (m, v), row_shape=table_shape[1:],
        num_rows=g.num_rows, offset=m_at or 0, merge=merge)
    return ids, u, m, v
  layout = _row_layout(h, m, v, m_at, v_at)
  if layout is not None:  # a row-sharded table: each shard updates the rows it owns
    return _row_sharded.lazy_rows(g, m, v, layout, merge=merge, b1=h.b1, b2=h.b2, eps=h.eps,
                                  bc1=h.bc1, bc2=h.bc2, eps_mode=h.kind, nesterov=h.nesterov)
  ids, u, m_rows, v_rows, m_t, v_t = _lazy_rows_xla(h, g, m, v, table_shape, m_at, v_at, merge)
  return ids, u, put(m, m_at, scatter_rows(m_t, ids, m_rows)), put(v, v_at, scatter_rows(v_t, ids, v_rows))


def lazy_row_step(h: Hyper, p, g: RowSparse, m, v, *, m_at: int | None = None,
                  v_at: int | None = None, merge: bool = True, backend: str = "auto"):
  """The lazy step with the table: the rows of ``g`` of ``p``, ``m``, ``v`` move
  (``p - lr * u``), every other row keeps its bits. Returns ``(p, m, v)``."""
  _check_row_step(g, m, v, p.shape, m_at, v_at)
  if _use_row_kernel(backend, g, m, v, m_at, v_at, p):
    variant, s = _kernel_args(h)
    p, (m, v) = _backend.native_ffi.sparse_lazy(
        variant, s, g.indices, g.values, (m, v), p, row_shape=p.shape[1:], num_rows=g.num_rows,
        offset=m_at or 0, merge=merge)
    return p, m, v
  ids, u, m, v = lazy_rows(h, g, m, v, table_shape=p.shape, m_at=m_at, v_at=v_at, merge=merge,
                           backend="xla")
  return _add_rows(p, ids, lr_step(h.lr, u.astype(g.dtype))), m, v


def row_add(p, u: RowSparse, *, backend: str = "auto"):
  """``p[ids] += values`` (repeated ids add up, ids outside the table dropped)."""
  check_rows(u, p.shape, what="update")
  if _backend.use_kernel(backend, p, u.values, ids=u.indices, num_rows=u.num_rows):
    return _backend.native_ffi.row_add(p, u.indices, u.values)
  return _add_rows(p, safe_ids(u.indices, u.num_rows), u.values)


def _add_rows(p, ids, rows):
  """XLA's ``p[ids] += rows`` for safe ids; on a row-sharded table each shard adds its own."""
  layout = _row_sharded.row_layout(p)
  if layout is not None:
    return _row_sharded.scatter_add(p, ids, rows, layout)
  return scatter_rows(p, ids, rows, add=True)


def _row_layout(h: Hyper, m, v, m_at, v_at):
  """The row split of per-leaf moments sharded over several devices (see
  :mod:`adamkit._row_sharded`), or ``None``: XLA's own partitioning then."""
  if m_at is not None or v_at is not None or h.kind == "adamax":
    return None
  return _row_sharded.same_layout(m, v)


def _check_row_step(g, m, v, table_shape, m_at, v_at) -> None:
  check_rows(g, table_shape)
  check_moments(m, m_at, table_shape, "first moment")
  check_moments(v, v_at, table_shape, "second moment")


def _use_row_kernel(backend, g, m, v, m_at, v_at, *table) -> bool:
  return _backend.use_kernel(backend, g.values, m, v, *table, ids=g.indices,
                             num_rows=g.num_rows, fits=m_at == v_at)


def _lazy_rows_xla(h: Hyper, g: RowSparse, m, v, table_shape, m_at, v_at, merge):
  if merge:
    g = g.coalesce()
  ids = safe_ids(g.indices, g.num_rows)
  m_t, v_t = view(m, m_at, table_shape), view(v, v_at, table_shape)
  dt = compute_dtype(g.values)
  u, m_rows, v_rows = direction(h, g.values.astype(dt), gather_rows(m_t, ids).astype(dt),
                                gather_rows(v_t, ids).astype(dt))
  return ids, u, m_rows, v_rows, m_t, v_t
