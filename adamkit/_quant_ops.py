"""The step of a leaf whose moments may be stored quantized, and the checks around it.

A quantized moment is read by :func:`adamkit._quant.dequantize` and written by
:func:`adamkit._quant.quantize`, but a step written that way keeps full-size float32
copies of the old and new moments alive at once under ``jit`` (16 bytes per parameter
of temporaries at 16M parameters, more than the state it saves). :func:`leaf_step` splits
the step in two, each of which XLA keeps small:

* the direction ``u`` from the gradient and the *old* codes, elementwise: under ``jit``
  it fuses into ``optax.apply_updates``' add and is never materialized;
* the *new* codes and scales in a ``lax.fori_loop`` over chunks of about
  :data:`CHUNK` elements, which decodes, steps and encodes one chunk at a time into
  fresh output buffers (compiled for a GPU or a TPU: over the old codes and scales, each
  chunk read by the iteration that overwrites it); or, on one CPU device with the compiled
  kernel, in one kernel
  call that does the same block by block (the leaf's step names its moment rows, a
  :class:`MomentRule`, and every moment is "8bit" in blocks of one size).

Both compute the moments with the same function (the kernel: the same float32
operations in the same order), so the stored state is ``quantize(m_t, step=t)``, as the
one-pass form would give: exactly when run eagerly; under ``jit`` XLA may contract a
multiply and an add into one FMA, differently in the two passes, so ``m_t`` may differ by
a rounding between the direction and the stored codes (the kernel never contracts). Each
chunk hands the encoder its elements' flat positions in the leaf, which with the step
count key the 4-bit first moment's dither (:func:`adamkit._quant.dither`).

The chunks of a leaf whose codes keep its leading axes (the last axis a multiple of every
block) are strided over axis 0: chunk ``k`` holds the rows ``k, k + K, k + 2K, ...``, so a
row- or column-sharded parameter, whose codes and scales are sharded alike, is stepped
shard by shard with no collective. Other leaves are cut into contiguous chunks of their
flattened elements, the last (shorter) chunk stepped on its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from adamkit import _backend, _compat, _platform, _quant, _validate
from adamkit._dtypes import compute_dtype
from adamkit._tree import is_tracer
from adamkit._validate import path_name

CHUNK = 1 << 16  # elements encoded per loop iteration: float32 temporaries of 256 KiB
# The fused step's in-place loop (step_in_place) takes chunks of twice CHUNK elements: each
# iteration has a fixed cost in XLA, which the larger chunks halve (on this project's CPU
# the 8-bit step takes 0.75x the time it takes with CHUNK)
IN_PLACE_CHUNKS = 2
# A TPU tiles an array's last two axes, the second-to-last by 8 (32-bit values) to 32 (one
# byte); the strided loops' chunk count is a multiple of this where the rows allow.
TILE_ROWS = 32


# ----------------------------------------------------------------------- the leaf step


class MomentRule(NamedTuple):
  """The moment rows of a leaf's ``step``, which the CPU kernel can run in its place to
  store the new moments: ``"adam"`` (``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2)
  g^2`` and, with a third moment, AMSGrad's ``max(vmax, v)``) or ``"adamax"`` (``m`` and
  the norm ``max(b2 v, |g|)``), with the float32 decays ``step`` uses."""

  kind: str
  b1: jax.Array
  b2: jax.Array


def leaf_step(step: Callable, g: jax.Array, olds, count: jax.Array,
              rule: MomentRule | None = None) -> tuple:
  """``step(g, *moments) -> (u, *new_moments)`` on one leaf whose moments ``olds`` are
  stored as plain arrays (any dtype) or :class:`adamkit._quant.QuantizedArray`.

  ``step`` sees the moments in the compute dtype (dequantized where stored quantized) and
  must be elementwise. ``count``: the optimizer's step count of the new moments (int32
  scalar, 1 at the first step), for the 4-bit first moment's dither. Returns ``u`` in the
  gradient's dtype and each new moment stored as its old one is. ``rule``: ``step``'s
  moment rows, if they are one of :class:`MomentRule`'s (then the CPU kernel may store
  the new 8-bit moments)."""
  dt = compute_dtype(g)
  u, *news = step(g.astype(dt), *(_quant.load(o).astype(dt) for o in olds))
  u = u.astype(g.dtype)
  if not any(_quant.is_qarray(o) for o in olds):
    return (u, *(n.astype(o.dtype) for n, o in zip(news, olds)))
  # The loop converts each chunk of a low-precision g to the compute dtype (converted whole
  # before the loop, a bf16 g took 4 bytes per parameter of temporaries), also where the
  # caller widened it (see widened_from)
  narrow = _narrow_of(g)
  stored = _backend.run(
      _on_kernel(rule, g, olds), lambda: _kernel_requantize(rule, g, olds),
      lambda: _requantize(lambda gc, *oc: step(gc, *oc)[1:], narrow, olds, count))
  return (u, *(s if _quant.is_qarray(o) else n.astype(o.dtype)
               for s, n, o in zip(stored, news, olds)))


_NARROW: contextvars.ContextVar[dict | None] = contextvars.ContextVar("adamkit_narrow", default=None)


@contextlib.contextmanager
def widened_from(pairs: list[tuple[Any, Any]]):
  """Within: a gradient leaf that is ``wide`` of one of the ``(wide, narrow)`` pairs
  (``wide`` exactly ``narrow.astype(float32)``, the very array) is read by the loop
  that stores new quantized moments from ``narrow``, each chunk widened in the loop, so
  no float32 copy of the whole gradient is kept (``ak.param_rounding`` widens bf16
  gradients for its inner step; the values are the same)."""
  token = _NARROW.set({id(w): (w, n) for w, n in pairs})
  try:
    yield
  finally:
    _NARROW.reset(token)


def _narrow_of(g: jax.Array) -> jax.Array:
  """``g``'s narrow origin under :func:`widened_from`, else ``g``."""
  pair = (_NARROW.get() or {}).get(id(g))
  return pair[1] if pair is not None and pair[0] is g else g


def _on_kernel(rule: MomentRule | None, g: jax.Array, olds) -> bool:
  """Whether the CPU kernel stores this leaf's new moments (the rule of
  :func:`adamkit._backend.decide`, backend "auto"): a known rule, a float32 gradient,
  every moment "8bit" in blocks of one size, in the rule's order (first moment, then the
  non-negative ones), the leaf big enough, on one CPU device."""
  if rule is None or not all(_quant.is_qarray(o) and o.fmt.kind == "8bit" for o in olds):
    return False
  roles = ["mu"] + ["nu"] * (len(olds) - 1)
  fits = (len(olds) in ((2,) if rule.kind == "adamax" else (2, 3))
          and [o.fmt.role for o in olds] == roles
          and len({o.fmt.block_size for o in olds}) == 1 and g.size > 0)
  return _backend.use_kernel("auto", g, *olds, fits=fits, quantized=True,
                             big_enough=g.size >= _backend.MIN_LEAF)


def _kernel_requantize(rule: MomentRule, g: jax.Array, olds) -> list:
  """The new moments of ``rule`` stored as ``olds`` are, by the CPU kernel in one call."""
  ffi = _backend.native_ffi
  variant = ffi.Variant("adamax" if rule.kind == "adamax" else "hat", amsgrad=len(olds) == 3)
  s = ffi.scalars(variant.kind, b1=rule.b1, b2=rule.b2, eps=0.0, lr=0.0, wd=0.0, bc1=1.0,
                  bc2=1.0)
  codes = tuple(ffi.Codes(o.codes, _quant.readable_scales(o.scales),
                          _quant.code_book(o.fmt.kind, o.fmt.role), _quant.kernel_midpoints(o.fmt))
                for o in olds)
  new = ffi.requantize(variant, s, g, codes, block=olds[0].fmt.block_size)
  return [_quant.QuantizedArray(k.codes, k.scales, o.shape, o.fmt) for k, o in zip(new, olds)]


def _requantize(moments: Callable, g: jax.Array, olds, count) -> list:
  """The new moments of ``moments(g, *olds)`` stored as ``olds`` are, chunk by chunk
  (``count`` keys the 4-bit dither): written over the old codes and scales where the
  program is compiled for a GPU or a TPU, into fresh buffers on a CPU (see
  :func:`_strided`).
  Plain moments come back as ``None`` (the caller has them from the elementwise pass)."""
  quant = [o for o in olds if _quant.is_qarray(o)]
  block = max(q.fmt.block_size for q in quant)
  if g.size == 0:
    return [o if _quant.is_qarray(o) else None for o in olds]
  rows = _strided_rows(g, quant, block, CHUNK)
  loop = (functools.partial(_strided, moments, g, olds, rows, count) if rows is not None
          else functools.partial(_contiguous, moments, g, olds, block, count))
  gathered = _GatheredRows.plan_for(g, quant, rows, CHUNK)
  tpu = functools.partial(_strided, moments, g, olds, gathered, count) if gathered else loop
  return _platform.on_tpu(lambda: tpu(in_place=True), lambda: _platform.on_gpu(
      lambda: loop(in_place=True), lambda: loop(in_place=False)))


def _strided_rows(g: jax.Array, quant: list, block: int, chunk: int) -> _Rows | None:
  """How a leaf is cut into strided chunks of rows of about ``chunk`` elements, where
  every quantized moment in ``quant`` keeps the leaf's leading axes and the rows divide
  into such chunks; else ``None`` (contiguous chunks)."""
  if not g.ndim or not all(_lead_layout(q) for q in quant):
    return None
  rows = _Rows(g.shape, block, chunk)
  return rows if rows.plan is not None else None


def _lead_layout(q) -> bool:
  """Whether ``q``'s codes keep the leaf's leading axes (no padding): the leaf's shape,
  or a vector's ``(blocks, block)``."""
  return len(q.shape) >= 1 and q.shape[-1] > 0 and q.shape[-1] % q.fmt.block_size == 0


def _divisors(n: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))


class _Rows:
  """A leaf seen as ``(rows, *row)``: its axis 0 (a 1-D leaf: runs of ``block`` elements,
  the largest block of its moments), and how to cut the rows into strided chunks."""

  def __init__(self, shape: tuple, block: int, chunk: int):
    self.ndim = len(shape)
    if self.ndim >= 2:
      self.rows, self.row = shape[0], tuple(shape[1:])
    else:
      self.rows, self.row = shape[0] // block, (block,)
    row_size = math.prod(self.row)
    # ``K`` chunks of ``r`` rows, ``r`` the divisor of the rows nearest ``chunk`` elements
    # from below; none when that leaves chunks under an eighth of it (few long rows,
    # a prime number of rows) or over eight times it (one long row): those leaves take
    # contiguous chunks instead.
    fits = lambda r: (8 * r * row_size >= min(chunk, self.rows * row_size)  # noqa: E731
                      and r * row_size <= 8 * chunk)
    divisors = _divisors(self.rows)
    r = max(d for d in divisors if d * row_size <= chunk) if row_size <= chunk else 1
    # Where it fits, ``K`` a multiple of TILE_ROWS: the chunks' axis is then the
    # second-to-last of a leaf's codes seen as ``(r, K, row)``, which a TPU tiles, and the
    # view is the same tiled bytes (otherwise XLA copies the whole codes into it).
    tiled = [d for d in divisors if (self.rows // d) % TILE_ROWS == 0
             and d * row_size <= chunk and fits(d)]
    r = max(tiled) if tiled and len(self.row) == 1 else r
    self.plan = (r, self.rows // r) if fits(r) else None
    self.tiled = bool(tiled) and len(self.row) == 1 and r in tiled

  def of(self, x: jax.Array) -> jax.Array:
    """A leaf-shaped array as ``(rows, *row)``."""
    return x.reshape((self.rows,) + self.row)

  def codes(self, q) -> tuple[jax.Array, jax.Array]:
    """``q``'s codes and scales with axis 0 the leaf's rows (the codes in the leaf's
    shape; a vector's ``(blocks, block)``, one row a block)."""
    if self.ndim >= 2:
      return q.codes, q.scales
    return q.codes.reshape(self.rows, -1), q.scales.reshape(self.rows, -1)

  @staticmethod
  def decode(codes: jax.Array, scales: jax.Array, fmt, shape: tuple) -> jax.Array:
    """A chunk's moment (``shape``) from its codes and scales as :meth:`codes` lays them
    out, viewed as one row of bytes per block (a chunk-sized reshape)."""
    return _quant.decode_blocks(codes.reshape(scales.shape + (-1,)), scales, fmt).reshape(shape)

  def encode(self, x: jax.Array, fmt, count, i) -> tuple[jax.Array, jax.Array]:
    """Chunk ``i``'s codes and scales of ``x`` (``(r, *row)``), laid out as :meth:`codes`."""
    codes, scales = _encode(x, fmt, count, lambda: self.positions(i))
    return codes.reshape(codes.shape[:-2] + (-1,)), scales

  def split(self, x: jax.Array) -> jax.Array:
    """``x`` (axis 0 the rows) as ``(r, K, ...)``: chunk ``i`` is ``[:, i]``, the rows
    ``i, i + K, i + 2K, ...``."""
    r, k = self.plan
    return x.reshape((r, k) + x.shape[1:])

  def view(self, x: jax.Array) -> jax.Array:
    """An array whose axis 0 is the rows (:meth:`of`, :meth:`codes`) as the loop indexes
    it: :meth:`split`."""
    return self.split(x)

  @staticmethod
  def take(a: jax.Array, i) -> jax.Array:
    """Chunk ``i`` of a :meth:`view` (a dynamic slice)."""
    return lax.dynamic_index_in_dim(a, i, 1, keepdims=False)

  @staticmethod
  def read(a: jax.Array, i) -> jax.Array:
    """Chunk ``i`` of a :meth:`view` that the loop overwrites in place (a gather, see
    :func:`_read_column`)."""
    return _read_column(a, i)

  @staticmethod
  def put(a: jax.Array, x: jax.Array, i) -> jax.Array:
    """A :meth:`view` with chunk ``i`` written (a dynamic update slice)."""
    return lax.dynamic_update_index_in_dim(a, x, i, 1)

  def positions(self, i: jax.Array) -> jax.Array:
    """The flat positions in the leaf of chunk ``i``'s elements, shaped ``(r, *row)``:
    row ``j`` of the chunk is the leaf's row ``jK + i``."""
    r, k = self.plan
    row_size = math.prod(self.row)
    strides = (k * row_size,) + tuple(math.prod(self.row[a + 1:]) for a in range(len(self.row)))
    start = jnp.asarray(i).astype(jnp.uint32) * np.uint32(row_size % 2 ** 32)
    return _quant.positions((r,) + self.row, start, strides)


class _GatheredRows(_Rows):
  """Strided chunks of a matrix's rows where no view ``(r, K, row)`` is whole tiles of a
  TPU (the rows have no divisor that leaves ``K`` a multiple of :data:`TILE_ROWS`, such
  as a GPT-2 embedding's 50257 = 29 x 1733; XLA:TPU then copies the leaf into the view's
  layout): chunk ``i`` is the rows ``i, i + K, ...`` below the leaf's end, read by a
  gather and written by a scatter on the leaf's own ``(rows, row)`` arrays, ``r`` rows
  each (the last ones past the end: read as zeros, their writes dropped)."""

  def __init__(self, shape: tuple, block: int, chunk: int):
    super().__init__(shape, block, chunk)
    row_size = math.prod(self.row)
    k = -(-self.rows // max(1, min(self.rows, chunk // row_size)))
    self.plan = (-(-self.rows // k), k)

  @classmethod
  def plan_for(cls, g: jax.Array, quant: list, rows: _Rows | None,
               chunk: int) -> _GatheredRows | None:
    """The plan for a matrix whose moments keep its rows (:func:`_lead_layout`), whose
    rows are at most 8 chunks long (as :class:`_Rows` takes them) and whose strided view
    is no whole tiles; else ``None``."""
    if (g.ndim != 2 or not all(_lead_layout(q) for q in quant) or g.shape[1] > 8 * chunk
        or (rows is not None and rows.tiled)):
      return None
    return cls(g.shape, max(q.fmt.block_size for q in quant), chunk)

  def view(self, x: jax.Array) -> jax.Array:
    return x

  def _rows_of(self, i) -> jax.Array:
    r, k = self.plan
    return (jnp.arange(r, dtype=jnp.int32) * k + jnp.asarray(i, jnp.int32))[:, None]

  def _dims(self, a: jax.Array, scatter: bool = False):
    window = tuple(range(1, a.ndim))
    if scatter:
      return lax.ScatterDimensionNumbers(update_window_dims=window, inserted_window_dims=(0,),
                                         scatter_dims_to_operand_dims=(0,))
    return lax.GatherDimensionNumbers(offset_dims=window, collapsed_slice_dims=(0,),
                                      start_index_map=(0,))

  def take(self, a: jax.Array, i) -> jax.Array:
    return lax.gather(a, self._rows_of(i), self._dims(a), (1,) + a.shape[1:],
                      indices_are_sorted=True, unique_indices=True,
                      mode=lax.GatherScatterMode.FILL_OR_DROP, fill_value=0)

  read = take

  def put(self, a: jax.Array, x: jax.Array, i) -> jax.Array:
    return lax.scatter(a, self._rows_of(i), x.astype(a.dtype), self._dims(a, scatter=True),
                       indices_are_sorted=True, unique_indices=True,
                       mode=lax.GatherScatterMode.FILL_OR_DROP)


def _strided(moments, g, olds, rows: _Rows, count, in_place: bool) -> list:
  """:func:`_requantize` over strided chunks of rows (see :class:`_Rows`), written into
  fresh buffers or, ``in_place``, over the old codes and scales, each chunk read (by a
  gather, see :func:`_read_column`) by the iteration that overwrites it. In place, XLA:GPU
  keeps no buffer of the leaf's size (with params and state donated, 0.03 bytes per
  parameter of a 4096x4096 leaf against 2.06 for 8-bit moments, and 0.03 against 6.06 with
  bf16 params, whose gradient each chunk widens), and so does XLA:TPU for codes in the
  leaf's shape (a v5e chip, the 23.1M-parameter transformer tree with 8-bit moments: none,
  against 1.40 B/param in fresh buffers, 2026-12-02). CPUs take fresh buffers: XLA:CPU
  copies the old codes before an in-place loop (more temporaries than fresh buffers)."""
  gs = rows.view(rows.of(g))
  ins = [tuple(map(rows.view, rows.codes(o))) if _quant.is_qarray(o)
         else rows.view(rows.of(o)) for o in olds]

  def body(i, outs):
    take = lambda a: rows.take(a, i)  # noqa: E731
    gc = take(gs).astype(compute_dtype(gs))
    # in place, a chunk's old codes are read from the buffers the loop writes
    read, olds_in = ((lambda a: rows.read(a, i)), outs) if in_place else (take, ins)
    ocs = [rows.decode(*map(read, src), o.fmt, gc.shape)
           if _quant.is_qarray(o) else take(x).astype(gc.dtype)
           for o, x, src in zip(olds, ins, olds_in)]
    news = moments(gc, *ocs)
    return [None if out is None else tuple(
        rows.put(a, x, i) for a, x in zip(out, rows.encode(n, o.fmt, count, i)))
        for out, n, o in zip(outs, news, olds)]

  carry = [None if not _quant.is_qarray(o) else x if in_place
           else tuple(map(_compat.zeros_like, x)) for o, x in zip(olds, ins)]
  return _stored(olds, lax.fori_loop(0, rows.plan[1], body, carry))


def _contiguous(moments, g, olds, block: int, count, in_place: bool) -> list:
  """:func:`_requantize` over contiguous chunks of the flattened leaf, each a whole number
  of every block, then the tail (the leaf's last elements, short of a chunk), whose last
  block is padded with zeros as :func:`adamkit._quant.quantize` pads it. Written as
  :func:`_strided` writes (``in_place``: each chunk read by :func:`_read` from the buffers
  the loop writes; on an H100 target a 4096x4000 leaf with 8-bit moments keeps 0.03 bytes
  per parameter of temporaries, against 2.06 in fresh buffers, compiled on 2026-12-01)."""
  n = g.size
  size = max(block, CHUNK // block * block)
  flat_g = g.reshape(-1)
  ins = [_quant.flat_blocks(o) if _quant.is_qarray(o) else o.reshape(-1) for o in olds]

  def part(lo, length: int, outs):
    """The new codes and scales of the elements ``[lo, lo + length)``."""
    gc = lax.dynamic_slice_in_dim(flat_g, lo, length).astype(compute_dtype(flat_g))
    ocs = []
    read, olds_in = (_read, outs) if in_place else (lax.dynamic_slice_in_dim, ins)
    for o, x, src in zip(olds, ins, olds_in):
      if _quant.is_qarray(o):
        b = o.fmt.block_size
        codes, scales = (read(a, lo // b, -(-length // b)) for a in src)
        ocs.append(_quant.decode_blocks(codes, scales, o.fmt).reshape(-1)[:length])
      else:
        ocs.append(lax.dynamic_slice_in_dim(x, lo, length).astype(gc.dtype))
    out = []
    for nw, o in zip(moments(gc, *ocs), olds):
      if _quant.is_qarray(o):
        b = o.fmt.block_size
        nw = jnp.pad(nw, (0, -length % b)) if length % b else nw
        out.append(_encode(nw, o.fmt, count, lambda nw=nw: _quant.positions(
            nw.shape, jnp.asarray(lo).astype(jnp.uint32))))
      else:
        out.append(None)
    return out

  def write(outs, lo, news):
    return [None if out is None else tuple(
        lax.dynamic_update_slice_in_dim(a, x, lo // o.fmt.block_size, 0) for a, x in zip(out, nw))
        for out, nw, o in zip(outs, news, olds)]

  outs = [(x if in_place else tuple(map(_compat.zeros_like, x))) if _quant.is_qarray(o)
          else None for o, x in zip(olds, ins)]
  k = n // size
  if k:
    outs = lax.fori_loop(0, k, lambda i, outs: write(outs, i * size, part(i * size, size, outs)),
                         outs)
  if n - k * size:
    outs = write(outs, k * size, part(k * size, n - k * size, outs))
  return _stored(olds, outs)


def step_in_place(step: Callable, p: jax.Array, g: jax.Array, bufs, at, count) -> tuple:
  """A fused step of one leaf over chunks, everything written in place: each chunk's
  params, gradients and old moments are read, ``step(p, g, *moments) -> (p, *moments)``
  (elementwise) runs on them, and the new params and moments (quantized where stored
  quantized) are written over the old ones in the same buffers. No array of the leaf's
  size is made, so under ``jit`` the step keeps no temporaries of that size, and none
  are copied when params and state are donated: every old value is read once, by the
  chunk that overwrites it (a gather, see :func:`_read`).

  ``bufs``: the moment buffers, whole, each a plain array or a
  :class:`~adamkit._quant.QuantizedArray`; ``at``: per buffer, the leaf's element offset
  in it (a multi-tensor buffer; a quantized one's at a block's start) or ``None`` (the
  leaf's own moment). ``count`` keys the 4-bit dither, the positions being the leaf's
  own. Returns the new param and buffers. The chunks are :func:`_requantize`'s, of
  :data:`IN_PLACE_CHUNKS` times the size: strided rows where every buffer is the leaf's
  own and keeps its leading axes (a row- or column-sharded param steps shard by shard,
  no collective), contiguous runs of the flattened leaf otherwise."""
  quant = [b for b in bufs if _quant.is_qarray(b)]
  block = max(q.fmt.block_size for q in quant)
  if p.size == 0:
    return p, tuple(bufs)
  rows = (_strided_rows(p, quant, block, IN_PLACE_CHUNKS * CHUNK)
          if all(a is None for a in at) else None)
  if rows is not None:
    return _strided_in_place(step, p, g, bufs, rows, count)
  return _contiguous_in_place(step, p, g, bufs, at, block, count)


def _read(a: jax.Array, start, length: int) -> jax.Array:
  """``a[start:start + length]`` (axis 0) by a gather, which XLA makes once, chunk-sized,
  where it would copy a slice into every fusion that needs the chunk: one of those
  writes the buffer in place while another still reads it, and XLA then copies the whole
  buffer at every iteration to keep the old values."""
  idx = (jnp.asarray(start, jnp.int32) + jnp.arange(length, dtype=jnp.int32))[:, None]
  dims = lax.GatherDimensionNumbers(offset_dims=tuple(range(1, a.ndim)),
                                    collapsed_slice_dims=(0,), start_index_map=(0,))
  return lax.gather(a, idx, dims, (1,) + a.shape[1:], indices_are_sorted=True,
                    unique_indices=True, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _read_column(a: jax.Array, i) -> jax.Array:
  """``a[:, i]`` by a gather along axis 1 (see :func:`_read`), the chunks' axis: a chunk
  takes rows from every shard of a row-sharded param, and each shard gathers its own (no
  collective). The index is given twice: XLA turns a gather of one slice back into a
  dynamic slice."""
  idx = jnp.full((2, 1), jnp.asarray(i, jnp.int32))
  dims = lax.GatherDimensionNumbers(offset_dims=(1,) + tuple(range(2, a.ndim)),
                                    collapsed_slice_dims=(1,), start_index_map=(1,))
  return lax.gather(a, idx, dims, (a.shape[0], 1) + a.shape[2:], indices_are_sorted=True,
                    mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)[0]


def _strided_in_place(step, p, g, bufs, rows: _Rows, count) -> tuple:
  """:func:`step_in_place` over strided chunks of rows (see :class:`_Rows`)."""
  gs = rows.split(rows.of(g))
  split = lambda b: (tuple(map(rows.split, rows.codes(b))) if _quant.is_qarray(b)  # noqa: E731
                     else rows.split(rows.of(b)))

  def body(i, carry):
    ps, outs = carry
    take = lambda a: _read_column(a, i)  # noqa: E731
    put = lambda a, x: lax.dynamic_update_index_in_dim(a, x, i, 1)  # noqa: E731
    pc = take(ps)
    olds = [rows.decode(*map(take, x), b.fmt, pc.shape)
            if _quant.is_qarray(b) else take(x) for b, x in zip(bufs, outs)]
    new_p, *news = step(pc, lax.dynamic_index_in_dim(gs, i, 1, keepdims=False), *olds)
    outs = [tuple(put(a, y) for a, y in zip(x, rows.encode(n, b.fmt, count, i)))
            if _quant.is_qarray(b) else put(x, n.astype(x.dtype))
            for b, x, n in zip(bufs, outs, news)]
    return put(ps, new_p.astype(ps.dtype)), outs

  ps, outs = lax.fori_loop(0, rows.plan[1], body, (rows.split(rows.of(p)), list(map(split, bufs))))
  return _in_place_result(p, bufs, ps, outs)


def _contiguous_in_place(step, p, g, bufs, at, block: int, count) -> tuple:
  """:func:`step_in_place`'s loop: chunks of a whole number of every block, then the
  tail, whose last block is padded with zeros as :func:`adamkit._quant.quantize` pads
  it."""
  n = p.size
  chunk = IN_PLACE_CHUNKS * CHUNK
  size = max(block, chunk // block * block)
  flat_g = g.reshape(-1)
  at = [0 if a is None else a for a in at]
  starts = [a // b.fmt.block_size if _quant.is_qarray(b) else a for b, a in zip(bufs, at)]
  flat = lambda b: _quant.flat_blocks(b) if _quant.is_qarray(b) else b.reshape(-1)  # noqa: E731

  def part(lo, length: int, carry):
    """The chunk of the elements ``[lo, lo + length)`` stepped and written back."""
    ps, outs = carry
    pc = _read(ps, lo, length)
    olds = []
    for b, x, s0 in zip(bufs, outs, starts):
      if _quant.is_qarray(b):
        k = b.fmt.block_size
        codes, scales = (_read(a, s0 + lo // k, -(-length // k)) for a in x)
        olds.append(_quant.decode_blocks(codes, scales, b.fmt).reshape(-1)[:length])
      else:
        olds.append(_read(x, s0 + lo, length))
    new_p, *news = step(pc, lax.dynamic_slice_in_dim(flat_g, lo, length), *olds)
    written = []
    for b, x, s0, nw in zip(bufs, outs, starts, news):
      if _quant.is_qarray(b):
        k = b.fmt.block_size
        nw = jnp.pad(nw, (0, -length % k)) if length % k else nw
        enc = _encode(nw, b.fmt, count, lambda nw=nw: _quant.positions(
            nw.shape, jnp.asarray(lo).astype(jnp.uint32)))
        written.append(tuple(lax.dynamic_update_slice_in_dim(a, y, s0 + lo // k, 0)
                             for a, y in zip(x, enc)))
      else:
        written.append(lax.dynamic_update_slice_in_dim(x, nw.astype(x.dtype), s0 + lo, 0))
    return lax.dynamic_update_slice_in_dim(ps, new_p.astype(ps.dtype), lo, 0), written

  carry = (p.reshape(-1), list(map(flat, bufs)))
  k = n // size
  if k:
    carry = lax.fori_loop(0, k, lambda i, c: part(i * size, size, c), carry)
  if n - k * size:
    carry = part(k * size, n - k * size, carry)
  return _in_place_result(p, bufs, *carry)


def _in_place_result(p, bufs, ps, outs) -> tuple:
  """An in-place loop's param and buffers, shaped as ``p`` and ``bufs`` were."""
  stored = _stored(bufs, [x if _quant.is_qarray(b) else None for b, x in zip(bufs, outs)])
  return ps.reshape(p.shape), tuple(
      q if _quant.is_qarray(b) else x.reshape(b.shape) for b, q, x in zip(bufs, stored, outs))


def _stored(olds, outs) -> list:
  """The loop's codes and scales as the olds' :class:`~adamkit._quant.QuantizedArray`."""
  return [None if out is None else _quant.QuantizedArray(
      out[0].reshape(o.codes.shape), out[1].reshape(o.scales.shape), o.shape, o.fmt)
      for o, out in zip(olds, outs)]


def _blocked(x: jax.Array, block: int) -> jax.Array:
  """A chunk of whole rows in blocks: ``(..., last // block, block)``."""
  return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _encode(x: jax.Array, fmt, count, positions: Callable) -> tuple[jax.Array, jax.Array]:
  """Codes and scales of a chunk ``x`` of whole blocks (its last axis), its elements at
  flat positions ``positions()`` (``x``'s shape) of the leaf, built only for a format
  that reads them (the 4-bit first moment's dither)."""
  b = fmt.block_size
  pos = _blocked(positions(), b) if _quant.stochastic(fmt) else None
  return _quant.encode_blocks(_blocked(x, b), fmt, step=count, pos=pos)


# --------------------------------------------------------------- init and state checks


def zero_moments(params: Any, fmt: Any, role: str) -> Any:
  """A zero moment per param leaf in ``fmt`` (``None``: the param's dtype; a dtype; a
  :class:`adamkit.Quantized`: codes and scales placed as the param is where it is a
  concrete array, float32 for leaves under ``min_size``). Complex leaves refuse a
  quantized format, naming the leaf."""
  if not _quant.is_quantized(fmt):
    return jax.tree.map(lambda p: jnp.zeros_like(p, dtype=fmt), params)

  def zero(path, p):
    # A Flax NNX variable (nnx.Optimizer's params) gives its value: the moment must be the
    # QuantizedArray itself, whose codes and scales nnx then keeps as two variables (a
    # variable holding the whole moment would be updated with a dict of the two).
    if is_nnx_variable(p):
      p = p.get_value()
      if not hasattr(p, "shape"):  # a parameter group's masked leaf (optax.MaskedNode)
        return p
    if jnp.iscomplexobj(p):
      raise TypeError(
          f"param '{path_name(path) or '<root>'}' is complex ({jnp.asarray(p).dtype}); the "
          f"quantized moment formats ({fmt.kind!r}) store real values only. Keep complex "
          "params' moments in a float dtype (mu_dtype/nu_dtype=None) or train them apart "
          "with optax.partition.")
    return placed_like(_quant.init_moment(p, fmt, role), p)

  return jax.tree_util.tree_map_with_path(zero, params, is_leaf=is_nnx_variable)


def is_nnx_variable(x: Any) -> bool:
  """A Flax NNX ``Variable`` (duck-typed: adamkit does not import flax)."""
  return type(x).__module__.startswith("flax.") and hasattr(x, "get_value")


def placed_like(m: Any, p: Any) -> Any:
  """A new quantized moment ``m`` placed as its param ``p`` is, where ``p`` is a concrete,
  committed array (see :func:`shardings_like`)."""
  if not _quant.is_qarray(m) or is_tracer(p) or not isinstance(p, jax.Array) or not p.committed:
    return m
  return jax.device_put(m, shardings_like(m, p.sharding))


def shardings_like(m, sharding: jax.sharding.Sharding, memory_kind: str | None = None):
  """The shardings of quantized moment ``m``'s codes and scales for a param placed with
  ``sharding`` (a :class:`~adamkit._quant.QuantizedArray` of shardings, for
  ``jax.device_put``): over a mesh, codes and scales split as the param's axes when they
  keep its leading axes (else replicated); on one device, that device. ``memory_kind``:
  the param's unless given."""
  kind = memory_kind or sharding.memory_kind
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh = sharding.mesh

    def named(s, shape):  # an axis the mesh cannot split evenly (a row's one block) stays whole
      size = lambda a: int(np.prod([mesh.shape[n] for n in (a if isinstance(a, tuple) else (a,))]))  # noqa: E731
      s = tuple(a if a is None or d % size(a) == 0 else None for a, d in zip(s, shape))
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*s), memory_kind=kind)

    if not _lead_layout(m):
      return _quant.QuantizedArray(named((None, None), m.codes.shape),
                                   named((None,), m.scales.shape), m.shape, m.fmt)
    # split as the scales are (whole blocks to a device): codes in the leaf's shape, or
    # a vector's (blocks, block) by blocks
    spec = tuple(sharding.spec) + (None,) * (len(m.shape) - len(sharding.spec))
    scales = named(spec, m.scales.shape)
    return _quant.QuantizedArray(scales, scales, m.shape, m.fmt)
  if len(sharding.device_set) == 1:
    one = jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)), memory_kind=kind)
    return _quant.QuantizedArray(one, one, m.shape, m.fmt)
  raise ValueError(f"Cannot lay out a quantized moment for a param placed with {sharding}: "
                   "use a NamedSharding.")


def check_moments(updates: Any, moments: Any, fmt: Any, role: str, what: str) -> None:
  """``moments`` (one moment tree of a state) must match the gradient tree and be stored
  as this optimizer stores them (``fmt``); a ValueError names the leaf, what it holds and
  what was expected (e.g. a state quantized with another block size)."""
  from adamkit._sparse_types import is_row_sparse  # noqa: PLC0415 - imports _validate

  u_flat, u_def = jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_row_sparse)
  m_def = jax.tree.structure(moments, is_leaf=_quant.is_qarray)
  if u_def != m_def:
    raise ValueError(f"The gradient tree does not match the optimizer state's {what} tree.\n"
                     f"  gradients: {u_def}\n  {what}: {m_def}")
  for (path, g), m in zip(u_flat, m_def.flatten_up_to(moments)):
    name = path_name(path) or "<root>"
    if np.shape(g) != tuple(m.shape):
      raise ValueError(f"Gradient '{name}' has shape {np.shape(g)} but the optimizer state's "
                       f"{what} has shape {tuple(m.shape)}.")
    want = _quant.resolve(fmt, role) if _quant.is_quantized(fmt) and \
        fmt.quantizes(tuple(m.shape), role) else None
    have = m.fmt if _quant.is_qarray(m) else None
    if want != have:
      raise ValueError(
          f"The optimizer state's {what} of '{name}' is stored as {_describe(have, m)}, but "
          f"this optimizer stores it as {_describe(want, m)} ({role}_dtype={fmt!r}): a state "
          "from an optimizer with another moment format. Convert it with "
          "ak.load_state_dict(ak.state_dict(state), tx.init(params)).")
    if have is not None:  # the fused steps' check (adamkit._fused): codes and scales too
      _validate.check_quantized_layout(m, name, f"The optimizer state's {what}")


def _describe(fmt, m) -> str:
  if fmt is None:
    return "an unquantized array" if not _quant.is_qarray(m) else f"{m.dtype} values"
  book = "a first moment's (signed)" if fmt.role == "mu" else "a second moment's (unsigned)"
  return f"{fmt.kind!r} codes of {book} code book in blocks of {fmt.block_size}"


# ------------------------------------------------------------- named float32 views


def to_numpy(q, gather=np.asarray) -> np.ndarray:
  """The float32 values a quantized moment stands for, as NumPy (``gather`` fetches its
  codes and scales whole, e.g. across processes)."""
  codes, scales = jnp.asarray(gather(q.codes)), jnp.asarray(gather(q.scales))
  return np.asarray(_quant.dequantize(_quant.QuantizedArray(codes, scales, q.shape, q.fmt)))


def quantized_like(value: Any, like, step: Any, name: str = "the moment") -> Any:
  """Float ``value`` (``like``'s shape) stored in ``like``'s format, its codes and scales
  placed as ``like``'s are (device, sharding, memory kind; under ``jax.distributed`` each
  process places only its own shards). ``step``: the step count of the state it joins,
  which keys the 4-bit first moment's dither. Non-finite values (and negative second
  moments) raise a ValueError naming ``name``: the format cannot store them."""
  value = np.asarray(value, np.float32)
  if value.shape != tuple(like.shape):
    raise ValueError(f"shape {value.shape} does not match the moment's {tuple(like.shape)}")
  _validate.check_moment_values(value, like.fmt, name)
  step = jnp.asarray(np.asarray(step).astype(np.int64).clip(0, np.iinfo(np.int32).max), jnp.int32)
  q = _quant.quantize(jnp.asarray(value), like.fmt, step=step)
  return _quant.QuantizedArray(_placed(q.codes, like.codes), _placed(q.scales, like.scales),
                               q.shape, q.fmt)


def _placed(x: jax.Array, like: Any) -> jax.Array:
  if not isinstance(like, jax.Array) or is_tracer(like):
    return x
  if not like.is_fully_addressable:
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, like.sharding, lambda idx: host[idx])
  return jax.device_put(x, like.sharding) if like.committed else x
