"""The optimizer's operations, backend-neutral: the dense step, the lazy row step, the row add.

Code above this module asks for an operation; :mod:`adamkit._backend` decides whether the
C++ kernel or XLA computes it, and both give the same numbers (to float32 rounding: the
kernel computes the formula as written, XLA may contract a multiply and an add into one
FMA). Every operation checks its buffers against each other here, before either backend
runs, so a malformed state is a ``ValueError``, never a broadcast, a silent wrong row or
a write outside a buffer.

The state of a step is a tuple of moment buffers, ``(m, v)``, or ``(m, v, vmax)`` with
AMSGrad (:attr:`Hyper.amsgrad`), each with an optional offset: ``None`` means the buffer is
the leaf's own array (shaped like the param); an int means the leaf's moment lies flat in
the 1-D buffer from that element (the multi-tensor layout of ``ak.fused_adam``). The rule
of a step (eps placement, Nesterov, AMSGrad, L2 or decoupled decay, bias correction or
none) is its :class:`Hyper`.

A dense step's moment buffer may also be quantized (:class:`adamkit._quant.QuantizedArray`:
codes and one scale per block): the leaf's own (``None``), or a flat one of shape ``(n,)``
in which each leaf starts a block (offsets are elements, multiples of the block; a leaf
takes its size rounded up to whole blocks). The step reads it dequantized and stores its
new value quantized; the kernel does both per block in its one pass ("8bit" only). The
4-bit first moment's dither is keyed on :attr:`Hyper.step` and each element's flat
position in its leaf (from 0 for every leaf of a flat buffer too).

A table's moment may also be stored quantized, in its own array (blocks within rows) or
in a flat buffer whose rows are whole blocks (the leaf starts a block, and a row's
elements are a multiple of the block): the lazy row step then gathers and scatters the
touched rows' codes and scales only (by row in the table's own array, by block number
in a flat one), always in XLA; an element's position is ``row * D + column`` in the table
of rows of ``D`` elements, wherever the table is stored.

The rounded steps (:func:`rounded_dense_step`, :func:`rounded_lazy_row_step`) take bf16 or
fp16 params, compute in float32 and write them back rounded by a :class:`Rounding`
(``param_rounding`` of the fused steps, :mod:`adamkit._rounding`'s rules); the kernel
takes bf16 params over float32 moments.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from adamkit import _backend, _quant, _quant_ops, _rounding, _row_sharded
from adamkit._adam import adam_direction, amsgrad_direction, bias_corrections
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
  bc1: jax.Array  # 1 - b1**t (1 without bias correction)
  bc2: jax.Array  # 1 - b2**t (1 without bias correction)
  lr: jax.Array = np.float32(0.0)  # learning rate (ops that return a direction ignore it)
  wd: jax.Array = np.float32(0.0)  # decay coefficient of the leaves stepped with `decay`
  amsgrad: bool = False  # state (m, v, vmax): max(vmax, v) replaces v in the denominator
  decoupled: bool = False  # `decay` adds wd * w to the direction (AdamW), not to g (L2)
  # int32 scalar: the step count t of the moments this step stores (1 at the first step),
  # which keys the 4-bit first moment's dither; None where no moment is stored quantized
  step: jax.Array | None = None

  @classmethod
  def of(cls, kind: str, nesterov: bool, b1, b2, eps, count: jax.Array, *,
         bias_correction: bool = True, **rest) -> Hyper:
    """The step of count ``count`` (int32, 1 at the first step): float32 ``b1, b2, eps``,
    the bias corrections ``1 - b**count`` (1 without ``bias_correction``) and
    ``step=count``; ``rest``: the other fields (``lr`` and ``wd`` made float32)."""
    if bias_correction:
      bc1, bc2 = bias_corrections(b1, b2, count)
    else:
      bc1 = bc2 = jnp.ones([], jnp.float32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    rest.update({k: f32(rest[k]) for k in ("lr", "wd") if k in rest})
    return cls(kind, nesterov, f32(b1), f32(b2), f32(eps), bc1, bc2, step=count, **rest)


STATE_NAMES = ("first moment", "second moment", "running maximum of the second moment")


def state_size(h: Hyper) -> int:
  """How many moment buffers a step of ``h`` takes: ``(m, v)``, or ``(m, v, vmax)``."""
  return 3 if h.amsgrad else 2


def _kernel_args(h: Hyper):
  f = _backend.native_ffi
  s = f.scalars(h.kind, b1=h.b1, b2=h.b2, eps=h.eps, lr=h.lr, wd=h.wd, bc1=h.bc1, bc2=h.bc2)
  return f.Variant(h.kind, h.nesterov, h.amsgrad, h.decoupled), s


def direction(h: Hyper, g, *moments):
  """The update direction of one leaf, in the compute dtype, from its moments ``(m, v)``
  (AMSGrad: ``(m, v, vmax)``). Returns ``(u, *new_moments)``."""
  if h.kind == "adamax":
    return adamax_direction(g, *moments, b1=h.b1, b2=h.b2, eps=h.eps, bc1=h.bc1)
  step = amsgrad_direction if h.amsgrad else adam_direction
  return step(g, *moments, b1=h.b1, b2=h.b2, eps=h.eps, bc1=h.bc1, bc2=h.bc2,
              eps_mode=h.kind, nesterov=h.nesterov)


def _decoupled(h: Hyper, u, w):
  """AdamW's ``u + wd * w``, rounded as :func:`adamkit.add_decoupled_decay` rounds it."""
  return u + (h.wd * w.astype(jnp.float32)).astype(u.dtype)


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


def _check_state(h: Hyper, state) -> tuple:
  state = tuple(state)
  if len(state) != state_size(h):
    raise ValueError(f"This step keeps {state_size(h)} moment buffers "
                     f"({', '.join(STATE_NAMES[:state_size(h)])}), got {len(state)}.")
  return state


def dense_step(h: Hyper, params: Sequence[jax.Array], grads: Sequence[jax.Array], state, *,
               at: Sequence[Sequence[int]] | None = None, decay: bool = False,
               backend: str = "auto"):
  """One dense step on consecutive leaves: decay, moments, direction, ``p - lr * u``.

  ``state``: the moment buffers ``(m, v)``, or ``(m, v, vmax)`` with AMSGrad: one leaf's
  own arrays (``at=None``), or flat buffers holding the leaves' moments, leaf ``j`` of
  buffer ``b`` from offset ``at[b][j]``; any of them may be quantized (see the module
  docstring). ``decay``: ``g + wd * w`` first (L2) or, with ``h.decoupled``, ``u + wd * w``
  before the learning rate (AdamW). Returns ``(params, state)``; the reference's rounding
  points: direction in the gradient's dtype, the decoupled decay, the learning rate, then
  the params' dtype."""
  params, grads, state = list(params), list(grads), _check_state(h, state)
  offsets = _check_dense(params, grads, state, at)
  if any(_quant.is_qarray(b) for b in state):
    return _dense_quantized(h, params, grads, state, offsets, at is not None, decay, backend)
  sizes = [p.size for p in params]
  contiguous = at is None or (all(a == offsets[0] for a in offsets) and all(
      offsets[0][j + 1] == offsets[0][j] + sizes[j] for j in range(len(params) - 1)))
  choice = _backend.use_kernel(backend, *params, *grads, *state, fits=contiguous,
                              big_enough=at is not None or sum(sizes) >= _backend.MIN_LEAF)

  def kernel():
    variant, s = _kernel_args(h)
    out, bufs = [], state
    for lo in range(0, len(params), LEAVES_PER_CALL):
      hi = min(lo + LEAVES_PER_CALL, len(params))
      ps, bufs = _backend.native_ffi.dense_step(
          variant, s, params[lo:hi], grads[lo:hi], bufs, decay=decay,
          offset=0 if at is None else offsets[0][lo])
      out += ps
    return out, bufs
  return _backend.run(choice, kernel,
                      lambda: _dense_xla(_dense_leaf, h, params, grads, state, offsets, decay))


def dense_update(h: Hyper, params: Sequence[jax.Array], grads: Sequence[jax.Array], state, *,
                 at: Sequence[Sequence[int]] | None = None, decay: bool = False):
  """:func:`dense_step`'s arithmetic, returning the optax protocol's update ``-lr * u`` of
  each leaf instead of its new params: rounded as the named optimizer's chain rounds it, so
  ``p + update`` is ``optax.apply_updates``' result bit for bit. Always XLA (the kernel
  writes params, not updates). Returns ``(updates, state)``."""
  params, grads, state = list(params), list(grads), _check_state(h, state)
  offsets = _check_dense(params, grads, state, at)
  return _dense_xla(_leaf_update, h, params, grads, state, offsets, decay)


class Rounding(NamedTuple):
  """How a rounded dense step writes its low-precision params (:mod:`adamkit._rounding`'s
  rule, ``param_rounding=`` of the fused steps)."""
  method: str  # "nearest", "stochastic" or "kahan"
  keys: tuple = ()  # stochastic: per leaf, its two uint32 key words for this step
  comps: tuple = ()  # kahan: per leaf, its compensation buffer (the param's dtype)


def rounded_dense_step(h: Hyper, r: Rounding, params: Sequence[jax.Array],
                       grads: Sequence[jax.Array], state, *,
                       at: Sequence[Sequence[int]] | None = None, decay: bool = False,
                       backend: str = "auto"):
  """:func:`dense_step` on bf16 or fp16 params, computed in float32 and rounded by
  ``r``: per leaf, :func:`_leaf_update` on the float32 views of ``p`` and ``g`` (the
  moments are float32 or quantized), then :func:`adamkit._rounding.round_sum`, writing the
  param ``optax.apply_updates`` would write from ``ak.param_rounding``'s update. The
  kernel takes bf16 params (bf16 or float32 gradients, float32 moments) and rounds in its
  pass; fp16 params, quantized moments and the other cases of :func:`dense_step` run in
  XLA. Returns ``(params, state, comps)``: ``comps`` the new Kahan buffers (``()``
  for the other methods)."""
  params, grads, state = list(params), list(grads), _check_state(h, state)
  offsets = _check_dense(params, grads, state, at)
  _check_rounding(r, params)
  sizes = [p.size for p in params]
  contiguous = at is None or (all(a == offsets[0] for a in offsets) and all(
      offsets[0][j + 1] == offsets[0][j] + sizes[j] for j in range(len(params) - 1)))
  fits = contiguous and all(p.dtype == jnp.bfloat16 for p in params) and all(
      g.dtype == grads[0].dtype for g in grads)
  choice = _backend.use_kernel(backend, *state, narrow=(*params, *grads, *r.comps), fits=fits,
                              big_enough=at is not None or sum(sizes) >= _backend.MIN_LEAF)

  def kernel():
    variant, s = _kernel_args(h)
    out, comps, bufs = [], [], state
    for lo in range(0, len(params), LEAVES_PER_CALL):
      hi = min(lo + LEAVES_PER_CALL, len(params))
      keys = jnp.stack([w for k in r.keys[lo:hi] for w in k]) if r.method == "stochastic" else None
      ps, bufs, cs = _backend.native_ffi.dense_step_rounded(
          variant, s, r.method, params[lo:hi], grads[lo:hi], bufs, keys=keys,
          comps=r.comps[lo:hi] if r.method == "kahan" else None, decay=decay,
          offset=0 if at is None else offsets[0][lo])
      out += ps
      comps += cs
    return out, bufs, tuple(comps)

  def xla():
    out, comps, bufs = [], [], state
    for j, (p, g) in enumerate(zip(params, grads)):
      olds = [_load(buf, a[j], p.shape) for buf, a in zip(bufs, offsets)]
      step, *news = _leaf_update(h, p.astype(jnp.float32), g.astype(jnp.float32), olds, decay)
      new_p, c = _round(r, j, p, step)
      out.append(new_p)
      comps.append(c)
      bufs = tuple(_store(buf, a[j], x, h.step) for buf, a, x in zip(bufs, offsets, news))
    return out, bufs, tuple(comps) if r.method == "kahan" else ()
  return _backend.run(choice, kernel, xla)


def _check_rounding(r: Rounding, params) -> None:
  """``r`` must hold what its method needs for each leaf, shaped like the params."""
  if r.method not in _rounding.METHODS:
    raise ValueError(f"Unknown rounding method {r.method!r}; expected one of {_rounding.METHODS}.")
  for p in params:
    if p.dtype not in _rounding.NARROW:
      raise TypeError(f"A rounded step takes bfloat16 or float16 params, got {p.dtype}.")
  if r.method == "stochastic" and len(r.keys) != len(params):
    raise ValueError(f"Stochastic rounding needs one key per leaf: {len(r.keys)} keys for "
                     f"{len(params)} params.")
  if r.method == "kahan":
    if len(r.comps) != len(params):
      raise ValueError(f"Kahan summation needs one buffer per leaf: {len(r.comps)} buffers "
                       f"for {len(params)} params.")
    for p, c in zip(params, r.comps):
      if np.shape(c) != np.shape(p) or getattr(c, "dtype", None) != p.dtype:
        raise ValueError(f"A Kahan buffer of shape {np.shape(c)} and dtype "
                         f"{getattr(c, 'dtype', type(c).__name__)} for a param of shape "
                         f"{np.shape(p)} and dtype {p.dtype}: it must be the param's.")


def _check_dense(params, grads, state, at) -> list:
  """The leaves' shapes against their moment buffers; returns the offsets per buffer."""
  if at is None and len(params) != 1:
    raise ValueError("Leaf-shaped moments hold one leaf; pass offsets for several.")
  offsets = [[None] * len(params)] * len(state) if at is None else [list(a) for a in at]
  for j, (p, g) in enumerate(zip(params, grads)):
    if g.shape != p.shape:
      raise ValueError(f"A gradient of shape {g.shape} for a param of shape {p.shape}.")
    for buf, a, name in zip(state, offsets, STATE_NAMES):
      if _quant.is_qarray(buf):
        _check_quantized(buf, a[j], p.shape, name)
      else:
        check_moments(buf, a[j], p.shape, name)
  return offsets


def _span(buf, size: int) -> int:
  """Elements a leaf of ``size`` takes in ``buf``: whole blocks of a quantized buffer."""
  if _quant.is_qarray(buf):
    b = buf.fmt.block_size
    return -(-size // b) * b
  return size


def _check_quantized(q, at: int | None, shape: tuple, what: str) -> None:
  """A quantized ``q`` must be stored as its format lays out its shape (codes, scales)
  and hold a leaf of ``shape``: be of that shape (``at=None``) or flat, the leaf from
  element ``at``, a multiple of the block."""
  expected = _quant.stored_layout(q.shape, q.fmt)
  got = (tuple(q.codes.shape), q.codes.dtype, tuple(q.scales.shape), q.scales.dtype)
  want = (expected.codes.shape, expected.codes.dtype, expected.scales.shape,
          expected.scales.dtype)
  if got != want:
    raise ValueError(f"The quantized {what} of shape {q.shape} ('{q.fmt.kind}', blocks of "
                     f"{q.fmt.block_size}) has codes {got[1]}{got[0]} and scales "
                     f"{got[3]}{got[2]}; its format stores codes {want[1]}{want[0]} and "
                     f"scales {want[3]}{want[2]}.")
  size = int(np.prod(shape, dtype=np.int64))
  if at is None:
    if tuple(q.shape) != tuple(shape):
      raise ValueError(f"The quantized {what} has shape {tuple(q.shape)}, expected "
                       f"{tuple(shape)} (the param's shape).")
  elif (len(q.shape) != 1 or at % q.fmt.block_size
        or not 0 <= at <= q.shape[0] - _span(q, size)):
    raise ValueError(f"The quantized {what} buffer of shape {tuple(q.shape)} (blocks of "
                     f"{q.fmt.block_size}) cannot hold {size} elements from offset {at} "
                     "(a leaf starts a block and takes whole blocks).")


def _load(buf, at: int | None, shape: tuple):
  """The leaf moment of ``shape`` held in ``buf`` (see :func:`view`), float32 if quantized."""
  if not _quant.is_qarray(buf):
    return view(buf, at, shape)
  if at is None:
    return _quant.dequantize(buf)
  size = int(np.prod(shape, dtype=np.int64))
  leaf = _leaf_codes(buf, at, size, _span(buf, size))
  return _quant.dequantize(leaf)[:size].reshape(shape)


def _leaf_codes(buf, at: int, size: int, length: int):
  """The whole blocks of the leaf of ``size`` elements held in the flat quantized ``buf``
  from element ``at``, as a flat quantized array of ``length`` elements."""
  first, blocks = at // buf.fmt.block_size, -(-size // buf.fmt.block_size)
  return _quant.QuantizedArray(lax.slice_in_dim(buf.codes, first, first + blocks),
                               lax.slice_in_dim(buf.scales, first, first + blocks),
                               (length,), buf.fmt)


def _store(buf, at: int | None, x, step):
  """``buf`` with the leaf moment ``x`` written back (see :func:`put`), quantized if
  ``buf`` is (``step``: :attr:`Hyper.step`; the positions are the leaf's own)."""
  if not _quant.is_qarray(buf):
    return put(buf, at, x)
  if at is None:
    return _quant.store(x, buf, step=step)
  return _put_codes(buf, at, _quant.quantize(x.reshape(-1), buf.fmt, step=step))


def _put_codes(buf, at: int, leaf):
  """The flat quantized ``buf`` with the quantized ``leaf``'s codes and scales written
  from element ``at`` (a block's start)."""
  first = at // buf.fmt.block_size
  codes = lax.dynamic_update_slice(buf.codes, leaf.codes.reshape((-1,) + buf.codes.shape[1:]),
                                   (first, 0))
  scales = lax.dynamic_update_slice(buf.scales, leaf.scales.reshape(-1), (first,))
  return dataclasses.replace(buf, codes=codes, scales=scales)


def _dense_quantized(h: Hyper, params, grads, state, offsets, flat: bool, decay: bool,
                     backend: str):
  """:func:`dense_step` with quantized moment buffers. The kernel takes float32 and "8bit"
  buffers of one block size, the leaves back to back in each buffer."""
  blocks = {b.fmt.block_size for b in state if _quant.is_qarray(b)}
  block = next(iter(blocks))
  contiguous = not flat or all(
      a[j + 1] == a[j] + _span(buf, params[j].size)
      for buf, a in zip(state, offsets) for j in range(len(params) - 1))
  choice = _backend.use_kernel(backend, *params, *grads, *state,
                              fits=contiguous and len(blocks) == 1, quantized=True,
                              big_enough=flat or sum(p.size for p in params) >= _backend.MIN_LEAF)

  def kernel():
    variant, s = _kernel_args(h)
    ffi = _backend.native_ffi
    kstate = tuple(ffi.Codes(b.codes, _quant.readable_scales(b.scales),
                             _quant.code_book(b.fmt.kind, b.fmt.role), _quant.kernel_midpoints(b.fmt))
                   if _quant.is_qarray(b) else b for b in state)
    out = []
    for lo in range(0, len(params), LEAVES_PER_CALL):
      hi = min(lo + LEAVES_PER_CALL, len(params))
      starts = [0 if not flat else a[lo] // block if _quant.is_qarray(b) else a[lo]
                for b, a in zip(state, offsets)]
      ps, kstate = ffi.dense_step_quantized(variant, s, params[lo:hi], grads[lo:hi], kstate,
                                            offsets=starts, block=block, decay=decay)
      out += ps
    return out, tuple(dataclasses.replace(b, codes=k.codes, scales=k.scales)
                      if _quant.is_qarray(b) else k for b, k in zip(state, kstate))
  return _backend.run(choice, kernel,
                      lambda: _dense_xla(_dense_leaf, h, params, grads, state, offsets, decay))


def _dense_xla(leaf_fn, h: Hyper, params, grads, state, offsets, decay: bool):
  """XLA's loop over the leaves: ``leaf_fn`` on each leaf's moments (dequantized), the new
  moments written back into their buffers (quantized)."""
  out = []
  for j, (p, g) in enumerate(zip(params, grads)):
    if _chunked(p, g, state):
      new_p, state = _quantized_leaf(leaf_fn, h, p, g, state, [a[j] for a in offsets], decay)
      out.append(new_p)
      continue
    olds = [_load(buf, a[j], p.shape) for buf, a in zip(state, offsets)]
    new_p, *news = leaf_fn(h, p, g, olds, decay)
    out.append(new_p)
    state = tuple(_store(buf, a[j], x, h.step) for buf, a, x in zip(state, offsets, news))
  return out, state


def _chunked(p, g, state) -> bool:
  """Whether :func:`_quantized_leaf` steps this leaf: some moment quantized, float32
  params and gradients (XLA widens a narrower param or gradient whole, or copies it at
  every iteration of the loop: those keep the one-pass form)."""
  return (any(_quant.is_qarray(b) for b in state)
          and p.dtype == jnp.float32 and g.dtype == jnp.float32)


def _quantized_leaf(leaf_fn, h: Hyper, p, g, state, at: list, decay: bool):
  """``leaf_fn`` on one leaf, held in ``state``'s buffers from offsets ``at`` (see
  :func:`dense_step`), some of them quantized, over chunks of blocks
  (:mod:`adamkit._quant_ops`), so that no full-size float32 moment is made: a one-pass
  step keeps the old and new moments of the whole leaf alive at once (16 bytes per
  parameter of temporaries at 8 bits, twice a float32 step's).

  The fused step (``leaf_fn`` :func:`_dense_leaf`) steps each chunk's params and moments
  and writes them over the old ones (:func:`adamkit._quant_ops.step_in_place`): no
  temporary of the leaf's size, donated or not. An update (``-lr * u``, which XLA fuses
  into ``optax.apply_updates``' add later) takes the chain form's two passes
  (:func:`adamkit._quant_ops.leaf_step`): ``u`` elementwise from the old moments, the new
  codes from a loop into fresh buffers (a copy of the old codes when the state is
  donated, as in the chain form)."""
  if leaf_fn is _dense_leaf:
    return _quant_ops.step_in_place(lambda pc, gc, *ocs: _dense_leaf(h, pc, gc, ocs, decay),
                                    p, g, state, at, h.step)
  n = p.size
  l2 = decay and not h.decoupled
  flat = any(a is not None for a in at)

  def leaf(buf, a):  # the leaf's old moment as the loop takes it: its own, flat if ``flat``
    if not _quant.is_qarray(buf):
      return view(buf, a, p.shape).reshape(-1) if flat else buf
    return buf if a is None else _leaf_codes(buf, a, n, n)

  olds = [leaf(buf, a) for buf, a in zip(state, at)]
  gl = g.reshape(-1) if flat else g
  new_p, *news = leaf_fn(h, p, g, [_load(buf, a, p.shape) for buf, a in zip(state, at)],
                         decay)

  def moments(gc, *ocs):
    # only L2 decay reads the param in the moments; else a zero stands in (unused)
    pc = ocs[-1] if l2 else jnp.zeros_like(gc)
    _, *nw = _leaf_update(h, pc, gc, list(ocs[:len(state)]), decay)
    return (*nw, pc) if l2 else tuple(nw)

  if l2:
    olds.append(p.reshape(-1) if flat else p)
  stored = _quant_ops._requantize(moments, gl, olds, h.step)
  return new_p, tuple(put(buf, a, x) if not _quant.is_qarray(buf) else
                      q if a is None else _put_codes(buf, a, q)
                      for q, x, buf, a in zip(stored, news, state, at))


def _dense_leaf(h: Hyper, p, g, olds, decay: bool):
  step, *news = _leaf_update(h, p, g, olds, decay)
  return ((p + step).astype(p.dtype), *news)


def _leaf_update(h: Hyper, p, g, olds, decay: bool):
  """One leaf's ``-lr * u`` and new moments: decay (L2), direction in the gradient's dtype,
  decoupled decay (AdamW), the learning rate."""
  if decay and not h.decoupled:
    g = g + (h.wd * p.astype(jnp.float32)).astype(g.dtype)
  dt = compute_dtype(g)
  u, *news = direction(h, g.astype(dt), *(x.astype(dt) for x in olds))
  u = u.astype(g.dtype)
  if decay and h.decoupled:
    u = _decoupled(h, u, p)
  return (lr_step(h.lr, u), *(n.astype(o.dtype) for n, o in zip(news, olds)))


# -------------------------------------------------------------------------- row ops


def lazy_rows(h: Hyper, g: RowSparse, state, *, table_shape: tuple,
              at: Sequence[int | None] | None = None, merge: bool = True,
              backend: str = "auto", split: _row_sharded.RowSplit | None = None):
  """Adam's direction on the rows of ``g`` only (repeated ids summed first when ``merge``).
  ``state``: the table's moment buffers (see :func:`dense_step`), buffer ``b`` from offset
  ``at[b]`` (``None``: table-shaped). ``split``: the table's row split recorded at
  ``init``, for a step traced where the moments' own is not known (see
  :mod:`adamkit._row_sharded`). Returns ``(ids, u, state)``: distinct ids (padding
  ``num_rows``, dropped by scatters), one direction row each (compute dtype on XLA,
  float32 on the kernel), the new moments."""
  state, at = _check_row_step(h, g, state, table_shape, at)

  def kernel():
    variant, s = _kernel_args(h)
    if _quant.is_qarray(state[0]):
      ids, u, new = _lazy_rows_quantized(variant, s, g, state, table_shape, merge)
    else:
      ids, u, new = _backend.native_ffi.sparse_lazy(
          variant, s, g.indices, g.values, state, row_shape=table_shape[1:],
          num_rows=g.num_rows, offset=at[0] or 0, merge=merge)
    # the same types as XLA's step (the ids' dtype is safe_ids')
    return ids.astype(safe_ids(g.indices[:0], g.num_rows).dtype), u.astype(g.values.dtype), new
  return _backend.run(_use_row_kernel(backend, g, state, at), kernel,
                      lambda: _lazy_rows_xla(h, g, state, table_shape, at, merge, split))


def _lazy_rows_quantized(variant, s, g: RowSparse, state, table_shape: tuple, merge: bool):
  """The CPU kernel's lazy step on a table's own 8-bit moments (see :func:`_use_row_kernel`)."""
  ffi = _backend.native_ffi
  codes = tuple(ffi.Codes(q.codes, q.scales, _quant.code_book(q.fmt.kind, q.fmt.role),
                          _quant.kernel_midpoints(q.fmt)) for q in state)
  ids, u, new = ffi.sparse_lazy_quantized(
      variant, s, g.indices, g.values, codes, row_shape=table_shape[1:], num_rows=g.num_rows,
      block=state[0].fmt.block_size, merge=merge)
  return ids, u, tuple(_quant.QuantizedArray(c.codes, c.scales, q.shape, q.fmt)
                       for q, c in zip(state, new))


def _lazy_rows_xla(h: Hyper, g: RowSparse, state, table_shape: tuple, at, merge: bool, split):
  """:func:`lazy_rows` in XLA: row-sharded tables shard by shard, else gather, step and
  scatter the touched rows."""
  layout = _row_layout(h, state, at, split)
  if layout is not None:  # a row-sharded table: each shard updates the rows it owns
    m, v = state
    ids, u, m, v = _row_sharded.lazy_rows(
        g, m, v, layout, merge=merge, b1=h.b1, b2=h.b2, eps=h.eps, bc1=h.bc1, bc2=h.bc2,
        eps_mode=h.kind, nesterov=h.nesterov, step=h.step)
    return ids, u, (m, v)
  if merge:
    g = g.coalesce()
  ids = safe_ids(g.indices, g.num_rows)
  dt = compute_dtype(g.values)
  olds = [_take(buf, a, table_shape, ids).astype(dt) for buf, a in zip(state, at)]
  u, *rows = direction(h, g.values.astype(dt), *olds)
  state = tuple(_put(buf, a, table_shape, ids, r, h.step) for buf, a, r in zip(state, at, rows))
  return ids, u, state


def _take(buf, at: int | None, table_shape: tuple, ids):
  """The rows ``ids`` of a table's moment held in ``buf`` (from ``at``), as stored or
  dequantized (float32): a quantized moment gathers the rows' codes and scales only."""
  if not _quant.is_qarray(buf):
    return gather_rows(view(buf, at, table_shape), ids)
  if at is None and _quant.rows_apart(buf.shape, buf.fmt):
    return _quant.dequantize(_quant.take_rows(buf, lambda x: gather_rows(x, ids)))
  rows = _quant.take_blocks(buf, _row_blocks(buf, at, table_shape, ids),
                            (ids.shape[0], *table_shape[1:]))
  return _quant.dequantize(rows)


def _put(buf, at: int | None, table_shape: tuple, ids, rows, step):
  """``buf`` with the table's ``rows`` written at ``ids``; a quantized moment requantizes
  the rows (each row its own blocks; the 4-bit dither keyed on ``step`` and each element's
  position in the table, ``id * D + column``, wherever the table lies) and scatters their
  codes and scales, nothing else of the buffer."""
  if not _quant.is_qarray(buf):
    return put(buf, at, scatter_rows(view(buf, at, table_shape), ids, rows))
  pos = _quant.row_positions(ids, rows.shape) if _quant.stochastic(buf.fmt) else None
  new = _quant.quantize(rows, buf.fmt, step=step, pos=pos)
  if at is None and _quant.rows_apart(buf.shape, buf.fmt):
    return _quant.put_rows(buf, lambda x, r: scatter_rows(x, ids, r), new)
  return _quant.put_blocks(buf, _row_blocks(buf, at, table_shape, ids), new)


def _row_blocks(buf, at: int | None, table_shape: tuple, ids):
  """The block numbers of the rows ``ids`` of a table whose moment lies in the quantized
  ``buf`` from element ``at`` (a multi-tensor buffer; ``None``: its own array), its rows
  whole blocks (see :func:`_check_row_step`)."""
  block = buf.fmt.block_size
  return _quant.row_blocks(ids, table_shape, block, (at or 0) // block,
                           int(np.prod(buf.scales.shape, dtype=np.int64)))


def lazy_row_step(h: Hyper, p, g: RowSparse, state, *, at: Sequence[int | None] | None = None,
                  merge: bool = True, decay: bool = False, backend: str = "auto"):
  """The lazy step with the table: the rows of ``g`` of ``p`` and of its moments move
  (``p - lr * u``), every other row keeps its bits. ``decay`` (``h.decoupled`` only):
  each touched row adds ``wd * w`` to its direction once (lazy AdamW; an L2 decay of
  sparse rows is the caller's, per occurrence). Returns ``(p, state)``."""
  if decay and not h.decoupled:
    raise ValueError("The lazy row step decays decoupled only; add L2 decay to the rows first.")
  state, at = _check_row_step(h, g, state, p.shape, at)

  def kernel():
    variant, s = _kernel_args(h)
    return _backend.native_ffi.sparse_lazy(
        variant, s, g.indices, g.values, state, p, row_shape=p.shape[1:], num_rows=g.num_rows,
        offset=at[0] or 0, merge=merge, decay=decay)

  def xla():
    ids, step, new = lazy_row_update(h, p, g, state, at=at, merge=merge, decay=decay,
                                     backend="xla")
    return _add_rows(p, ids, step), new
  return _backend.run(_use_row_kernel(backend, g, state, at, p), kernel, xla)


def lazy_row_update(h: Hyper, p, g: RowSparse, state, *,
                    at: Sequence[int | None] | None = None, merge: bool = True,
                    decay: bool = False, backend: str = "auto"):
  """:func:`lazy_row_step`'s arithmetic, returning the optax protocol's update rows
  ``-lr * u`` (decoupled decay included) instead of the table: ``(ids, rows, state)``.
  ``p`` is read only for the decay (a ``jax.ShapeDtypeStruct`` will do without it)."""
  if decay and not h.decoupled:
    raise ValueError("The lazy row step decays decoupled only; add L2 decay to the rows first.")
  ids, u, state = lazy_rows(h, g, state, table_shape=p.shape, at=at, merge=merge,
                            backend=backend)
  u = u.astype(g.dtype)
  if decay:
    u = _decoupled(h, u, gather_rows(p, ids))
  return ids, lr_step(h.lr, u), state


def rounded_lazy_row_step(h: Hyper, r: Rounding, p, g: RowSparse, state, *,
                          at: Sequence[int | None] | None = None, merge: bool = True,
                          decay: bool = False, backend: str = "auto"):
  """:func:`lazy_row_step` on a bf16 or fp16 table, rounded by ``r`` as
  ``ak.param_rounding`` rounds a row-sparse update: the rows' float32 update
  (:func:`lazy_row_update`) applied to the whole table, each element rounded (untouched
  rows get a zero update: nearest and stochastic rounding keep them, Kahan adds their
  buffer back). Returns ``(p, state, comps)``."""
  _check_rounding(r, [p])
  ids, rows, state = lazy_row_update(h, p, g, state, at=at, merge=merge, decay=decay,
                                     backend=backend)
  u = RowSparse.of(ids, rows, g.num_rows).todense().astype(jnp.float32)
  new_p, comp = _round(r, 0, p, u)
  return new_p, state, (comp,) if r.method == "kahan" else ()


def _round(r: Rounding, j: int, p, u):
  """Leaf ``j`` of ``r``: ``p`` moved by its float32 update ``u``, rounded as
  ``optax.apply_updates`` writes ``ak.param_rounding``'s update: ``(param, comp)``."""
  bits = _rounding.element_bits(r.keys[j], p.shape) if r.method == "stochastic" else None
  _, written, comp = _rounding.round_sum(r.method, p.dtype, p.astype(jnp.float32), u,
                                         comp=r.comps[j] if r.method == "kahan" else None,
                                         bits=bits)
  return written.astype(p.dtype), comp


def row_add(p, u: RowSparse, *, backend: str = "auto"):
  """``p[ids] += values`` (repeated ids add up, ids outside the table dropped)."""
  check_rows(u, p.shape, what="update")
  return _backend.run(
      _backend.use_kernel(backend, p, u.values, ids=u.indices, num_rows=u.num_rows),
      lambda: _backend.native_ffi.row_add(p, u.indices, u.values),
      lambda: _add_rows(p, safe_ids(u.indices, u.num_rows), u.values))


def _add_rows(p, ids, rows):
  """XLA's ``p[ids] += rows`` for safe ids; on a row-sharded table each shard adds its own."""
  layout = _row_sharded.row_layout(p)
  if layout is not None:
    return _row_sharded.scatter_add(p, ids, rows, layout)
  return scatter_rows(p, ids, rows, add=True)


def _row_layout(h: Hyper, state, at, split=None):
  """The row split of per-leaf Adam moments sharded over several devices (see
  :mod:`adamkit._row_sharded`), or ``None``: XLA's own partitioning then (flat
  multi-tensor buffers, AdaMax and AMSGrad's third buffer are not routed). A quantized
  moment (blocks within rows, see :func:`_check_row_step`) is split by its codes and
  scales, which lead with the table's rows."""
  if h.kind == "adamax" or h.amsgrad or len(state) != 2 or any(a is not None for a in at):
    return None
  arrays = [y for x in state for y in ((x.codes, x.scales) if _quant.is_qarray(x) else (x,))]
  if any(y.shape[:1] != state[0].shape[:1] for y in arrays):
    return None
  return _row_sharded.step_layout(split, *arrays)


def _check_row_step(h: Hyper, g, state, table_shape, at):
  state = _check_state(h, state)
  at = (None,) * len(state) if at is None else tuple(at)
  check_rows(g, table_shape)
  for buf, a, name in zip(state, at, STATE_NAMES):
    if not _quant.is_qarray(buf):
      check_moments(buf, a, table_shape, name)
      continue
    _check_quantized(buf, a, table_shape, name)
    if not (a is None and _quant.rows_apart(buf.shape, buf.fmt)
            or _quant.rows_in_blocks(tuple(table_shape), buf.fmt.block_size)):
      raise ValueError(
          f"The quantized {name} of a {tuple(table_shape)} table has blocks of "
          f"{buf.fmt.block_size} elements spanning several rows of "
          f"{int(np.prod(table_shape[1:], dtype=np.int64))}: a lazy row step needs each row's "
          "own blocks (a table of at least 2 dimensions whose rows are whole blocks, or one "
          "block per row, as ak.sparse_adam lays it out), or a float moment.")
  return state, at


def _use_row_kernel(backend, g, state, at, *table) -> bool:
  """The row kernels take float32 buffers, or without a table the table's own "8bit"
  moments (first moment, then the non-negative ones) in one power-of-two block size that
  divides the rows; other quantized moments stay in XLA, even when forced (rule 3 of
  :mod:`adamkit._backend`)."""
  quant = [x for x in state if _quant.is_qarray(x)]
  fits = len(set(at)) == 1 and (not quant or (
      len(quant) == len(state) and not table and at[0] is None
      and [q.fmt.role for q in quant] == ["mu"] + ["nu"] * (len(quant) - 1)
      and len({q.fmt.block_size for q in quant}) == 1
      and all(q.codes.size == q.size and _quant.rows_apart(q.shape, q.fmt) for q in quant)
      and (b := quant[0].fmt.block_size) & (b - 1) == 0
      and math.prod(quant[0].shape[1:]) % b == 0))
  return _backend.use_kernel(backend, g.values, *state, *table, ids=g.indices,
                             num_rows=g.num_rows, fits=fits, quantized=True)
