"""The kernels' calling convention: one function per XLA custom-call target.

Each function checks every buffer it passes against that buffer's own shape and dtype
(``ValueError`` naming the buffer), and the C++ handler checks again from the buffers it
receives, and its attributes against their ranges without sums that could overflow (an
``InvalidArgument`` error naming the attribute, never a read or write outside a buffer;
tests/kernel_attrs.py). Sizes are never taken from one buffer and applied to another.

A kernel variant is a :class:`Variant` (static: it becomes the call's attributes) plus the
nine float32 :func:`scalars`; the optimizer state is a tuple of buffers
(:func:`state_buffers` of them: first and second moment, and AMSGrad's running maximum of
the second moment). Bias correction off (MindSpore ``AdamWeightDecay``) is ``bc1 = bc2 =
1`` in the scalars, not a variant. In :func:`dense_step_quantized` a state buffer may be
:class:`Codes`: 8-bit codes and per-block scales, with the format's code book. In
:func:`dense_step_rounded` the params (and Kahan buffers) are bfloat16, rounded in the pass.
:func:`requantize` steps one leaf's :class:`Codes` moments alone (the chain form's new codes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

KINDS = {"hat": 0, "corrected": 1, "adamax": 2}  # the `Kind` enum of adam_kernels.cc
NO_DECAY, L2, DECOUPLED = 0, 1, 2  # the `Decay` enum of adam_kernels.cc
STATE_NAMES = ("first moment", "second moment", "running maximum")  # the state buffers
ID_DTYPE = jnp.int32  # the kernels' row ids (and their padding id, ``num_rows``)


class Variant(NamedTuple):
  """The update rule a kernel call runs (static)."""
  kind: str  # "hat" / "corrected" (Adam's two eps placements) or "adamax"
  nesterov: bool = False
  amsgrad: bool = False  # a third state buffer, max(vmax, v), replaces v in the denominator
  decoupled: bool = False  # a decaying leaf adds wd * w to its direction (AdamW), not to g


def state_buffers(variant: Variant) -> int:
  """The number of state buffers of ``variant`` (``StateBuffers`` of adam_kernels.cc)."""
  return 3 if variant.amsgrad else 2


def _attrs(variant: Variant, decay: bool, state) -> dict:
  """The attributes every handler checks: the variant and the number of state buffers."""
  mode = (DECOUPLED if variant.decoupled else L2) if decay else NO_DECAY
  return dict(kind=np.int64(KINDS[variant.kind]), nesterov=bool(variant.nesterov),
              decay=np.int64(mode), amsgrad=bool(variant.amsgrad), state=np.int64(len(state)))


def scalars(kind: str, *, b1, b2, eps, lr, wd, bc1, bc2) -> jax.Array:
  """The kernels' nine float32 scalars ``b1, 1-b1, b2, 1-b2, eps, lr, wd, c1, c2``.

  Computed in JAX with the reference's own arithmetic: XLA turns ``x / c`` into
  ``x * (1 / c)`` for a scalar ``c``, so the kernels receive the reciprocals ``c1``, ``c2``
  (Adam "hat": ``sqrt(bc2) / bc1``; "corrected": ``1 / bc1``, ``1 / bc2``; AdaMax: ``bc1``).
  """
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  bc1, bc2 = f32(bc1), f32(bc2)
  if kind == "hat":
    c1, c2 = jnp.sqrt(bc2) / bc1, jnp.float32(1.0)
  elif kind == "corrected":
    c1, c2 = 1.0 / bc1, 1.0 / bc2
  else:
    c1, c2 = bc1, jnp.float32(1.0)
  b1, b2 = f32(b1), f32(b2)
  return jnp.stack([b1, 1.0 - b1, b2, 1.0 - b2, f32(eps), f32(lr), f32(wd), c1, c2])


def _need(ok: bool, what: str) -> None:
  if not ok:
    raise ValueError(f"adamkit CPU kernel: {what}.")


def _f32(name: str, x) -> None:
  _need(x.dtype == jnp.float32, f"{name} must be float32, got {x.dtype}")


def _check_state(variant: Variant, state, size: int, offset: int) -> None:
  n = state_buffers(variant)
  _need(len(state) == n, f"expected {n} state buffers, got {len(state)}")
  _need(offset >= 0, f"negative offset {offset}")
  for name, buf in zip(STATE_NAMES, state):
    _f32(name, buf)
    _need(offset + size <= buf.size, f"the {name} ({buf.size} elements) is smaller than the "
          f"{size} elements it must hold from offset {offset}")


def _check_params_grads(params, grads) -> int:
  """float32 params and gradients of matching shapes, at least one: returns their count."""
  n = len(params)
  _need(n == len(grads) and n > 0, "one gradient per param, at least one")
  for p, g in zip(params, grads):
    _f32("a param", p)
    _f32("a gradient", g)
    _need(p.shape == g.shape, f"gradient of shape {g.shape} for a param of shape {p.shape}")
  return n


def dense_step(variant: Variant, s: jax.Array, params: Sequence[jax.Array],
               grads: Sequence[jax.Array], state: tuple[jax.Array, ...], *, offset: int = 0,
               decay: bool = False) -> tuple[list[jax.Array], tuple[jax.Array, ...]]:
  """One call of the dense step on ``params`` and ``grads`` (float32 leaves) whose state
  lies in the buffers of ``state`` back to back from element ``offset``. With ``decay``,
  ``g + wd * p`` (L2) first. Returns the new params and state, aliased to the inputs."""
  n = _check_params_grads(params, grads)
  _check_state(variant, state, sum(p.size for p in params), offset)
  outs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*params, *state)]
  aliases = {1 + i: i for i in range(n)}  # operand 0 is the scalars, then params, grads
  aliases.update({1 + 2 * n + j: n + j for j in range(len(state))})
  call = jax.ffi.ffi_call("adamkit_cpu_step", outs, input_output_aliases=aliases,
                          vmap_method="sequential")
  out = call(s, *params, *grads, *state, offset=np.int64(offset), **_attrs(variant, decay, state))
  return list(out[:n]), tuple(out[n:])


ROUNDINGS = {"nearest": 0, "stochastic": 1, "kahan": 2}  # the `Rounding` enum of adam_kernels.cc


def _bf16(name: str, x) -> None:
  _need(x.dtype == jnp.bfloat16, f"{name} must be bfloat16, got {x.dtype}")


def dense_step_rounded(variant: Variant, s: jax.Array, method: str, params: Sequence[jax.Array],
                       grads: Sequence[jax.Array], state: tuple[jax.Array, ...], *,
                       keys: jax.Array | None = None, comps: Sequence[jax.Array] | None = None,
                       offset: int = 0, decay: bool = False):
  """One call of the dense step on bfloat16 ``params`` (gradients all bfloat16 or all
  float32; float32 state laid out as in :func:`dense_step`), computed in float32 and
  written back rounded by ``method`` (``adamkit._rounding.round_sum``'s rule):
  ``"stochastic"`` takes ``keys`` (uint32, two words per leaf: the leaf's key of this
  step), ``"kahan"`` the leaves' bfloat16 buffers ``comps``. Returns the new params,
  state and (``"kahan"``) buffers, aliased to the inputs."""
  n = len(params)
  _need(method in ROUNDINGS, f"unknown rounding {method!r}")
  _need(n == len(grads) and n > 0, "one gradient per param, at least one")
  g_f32 = grads[0].dtype == jnp.float32
  for p, g in zip(params, grads):
    _bf16("a param", p)
    (_f32 if g_f32 else _bf16)("a gradient (all of one dtype)", g)
    _need(p.shape == g.shape, f"gradient of shape {g.shape} for a param of shape {p.shape}")
    _need((p.shape[0] if p.ndim else 1) <= 2**32 and
          int(np.prod(p.shape[1:], dtype=np.int64)) <= 2**32,
          f"a param of shape {p.shape}: its counters (index along axis 0, index within the "
          "others) must fit 32 bits")
  _check_state(variant, state, sum(p.size for p in params), offset)
  extra = []
  if method == "stochastic":
    _need(keys is not None and keys.dtype == jnp.uint32 and keys.shape == (2 * n,),
          f"stochastic rounding takes uint32 keys of shape {(2 * n,)}, got "
          f"{None if keys is None else (keys.dtype, keys.shape)}")
    extra = [keys]
  else:
    _need(keys is None, "keys are for stochastic rounding only")
  if method == "kahan":
    _need(comps is not None and len(comps) == n, "one Kahan buffer per param")
    for p, c in zip(params, comps):
      _bf16("a Kahan buffer", c)
      _need(c.shape == p.shape, f"a Kahan buffer of shape {c.shape} for a param of shape {p.shape}")
    extra = list(comps)
  else:
    _need(comps is None, "Kahan buffers are for method 'kahan' only")
  outs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*params, *state)]
  aliases = {1 + i: i for i in range(n)}  # operand 0 is the scalars, then params, grads
  aliases.update({1 + 2 * n + j: n + j for j in range(len(state))})
  if method == "kahan":
    outs += [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in comps]
    aliases.update({1 + 2 * n + len(state) + i: n + len(state) + i for i in range(n)})
  call = jax.ffi.ffi_call("adamkit_cpu_step_rounded", outs, input_output_aliases=aliases,
                          vmap_method="sequential")
  out = call(s, *params, *grads, *state, *extra, offset=np.int64(offset),
             rounding=np.int64(ROUNDINGS[method]), grads_f32=bool(g_f32),
             **_attrs(variant, decay, state))
  k = n + len(state)
  return list(out[:n]), tuple(out[n:k]), list(out[k:])


class Codes(NamedTuple):
  """A state buffer stored in 8-bit codes: ``codes`` (uint8, ``block`` per scale, any
  shape), ``scales`` (float32, one per block), and the format's sorted ``book`` (256
  float32 values, ``value = book[code] * scale``) and its ``midpoints`` (255)."""
  codes: jax.Array
  scales: jax.Array
  book: np.ndarray
  midpoints: np.ndarray


def _check_codes(name: str, c: Codes, blocks: int, offset: int, block: int) -> None:
  _need(c.codes.dtype == jnp.uint8, f"the {name}'s codes must be uint8, got {c.codes.dtype}")
  _f32(f"the {name}'s scales", c.scales)
  _need(c.codes.size == c.scales.size * block, f"the {name} has {c.codes.size} codes for "
        f"{c.scales.size} scales of blocks of {block}")
  _need(np.shape(c.book) == (256,) and np.shape(c.midpoints) == (255,),
        f"the {name}'s code book must be 256 values and 255 midpoints")
  _need(offset + blocks <= c.scales.size, f"the {name} ({c.scales.size} blocks) is smaller "
        f"than the {blocks} blocks it must hold from block {offset}")


def dense_step_quantized(variant: Variant, s: jax.Array, params: Sequence[jax.Array],
                         grads: Sequence[jax.Array], state: tuple, *, offsets: Sequence[int],
                         block: int, decay: bool = False) -> tuple[list[jax.Array], tuple]:
  """One call of the dense step whose state buffers are float32 arrays or :class:`Codes`
  in blocks of ``block`` elements. The leaves lie back to back in each buffer from
  ``offsets[k]``: elements of a float32 buffer, blocks of a :class:`Codes` one (a leaf
  starts a block; its last block is padded). Returns the new params and state (the
  :class:`Codes` with new codes and scales), aliased to the inputs."""
  n = _check_params_grads(params, grads)
  nstate = state_buffers(variant)
  _need(len(state) == nstate and len(offsets) == nstate,
        f"expected {nstate} state buffers and offsets, got {len(state)} and {len(offsets)}")
  _need(block >= 1 and block & (block - 1) == 0, f"block size {block} is not a power of two")
  size = sum(p.size for p in params)
  blocks = sum(-(-p.size // block) for p in params)
  operands, outs, aliases = [s, *params, *grads], [], {1 + i: i for i in range(n)}
  for name, buf, at in zip(STATE_NAMES, state, offsets):
    _need(at >= 0, f"negative offset {at}")
    if isinstance(buf, Codes):
      _check_codes(name, buf, blocks, at, block)
      parts = [buf.codes, buf.scales]
      extra = [jnp.asarray(buf.book, jnp.float32), jnp.asarray(buf.midpoints, jnp.float32)]
    else:
      _f32(name, buf)
      _need(at + size <= buf.size, f"the {name} ({buf.size} elements) is smaller than the "
            f"{size} elements it must hold from offset {at}")
      parts, extra = [buf], []
    for x in parts:
      aliases[len(operands)] = n + len(outs)
      operands.append(x)
      outs.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
    operands += extra
  call = jax.ffi.ffi_call("adamkit_cpu_step_quantized",
                          [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in params] + outs,
                          input_output_aliases=aliases, vmap_method="sequential")
  attrs = _attrs(variant, decay, state)
  out = call(*operands, quantized=np.array([isinstance(b, Codes) for b in state], np.int64),
             offsets=np.array(offsets, np.int64), block=np.int64(block), **attrs)
  new_state, at = [], n
  for buf in state:
    if isinstance(buf, Codes):
      new_state.append(buf._replace(codes=out[at], scales=out[at + 1]))
      at += 2
    else:
      new_state.append(out[at])
      at += 1
  return list(out[:n]), tuple(new_state)


def requantize(variant: Variant, s: jax.Array, g: jax.Array, state: tuple, *,
               block: int) -> tuple:
  """The new moments of one leaf, from its gradient ``g`` (float32) and its old moments
  ``state`` (each :class:`Codes` in blocks of ``block`` consecutive elements of ``g``, the
  last padded): the moment rows of ``variant`` (Adam's ``m``, ``v`` and, with AMSGrad,
  ``max(vmax, v)``; AdaMax's ``m`` and norm), stored as :class:`Codes` again, in fresh
  buffers (the old ones stay valid). No direction, no param: the chain form computes those
  in XLA. ``s``: :func:`scalars` (the moment rows read ``b1, 1-b1, b2, 1-b2``)."""
  _f32("the gradient", g)
  _need(block >= 1 and block & (block - 1) == 0, f"block size {block} is not a power of two")
  nstate = state_buffers(variant)
  _need(len(state) == nstate and all(isinstance(b, Codes) for b in state),
        f"expected {nstate} state buffers of 8-bit codes, got {len(state)}")
  blocks = -(-g.size // block)
  operands, outs = [s, g], []
  for name, buf in zip(STATE_NAMES, state):
    _check_codes(name, buf, blocks, 0, block)
    _need(buf.scales.size == blocks, f"the {name} has {buf.scales.size} blocks, the gradient "
          f"{blocks}")
    operands += [buf.codes, buf.scales, jnp.asarray(buf.book, jnp.float32),
                 jnp.asarray(buf.midpoints, jnp.float32)]
    outs += [jax.ShapeDtypeStruct(buf.codes.shape, buf.codes.dtype),
             jax.ShapeDtypeStruct(buf.scales.shape, buf.scales.dtype)]
  call = jax.ffi.ffi_call("adamkit_cpu_requantize", outs, vmap_method="sequential")
  out = call(*operands, kind=np.int64(KINDS[variant.kind]), amsgrad=bool(variant.amsgrad),
             state=np.int64(nstate), block=np.int64(block))
  return tuple(buf._replace(codes=out[2 * k], scales=out[2 * k + 1])
               for k, buf in enumerate(state))


def kernel_ids(ids: jax.Array) -> jax.Array:
  """Row ids as the kernels take them: int32 (narrower integer ids widen losslessly)."""
  _need(jnp.issubdtype(ids.dtype, jnp.integer) and jnp.iinfo(ids.dtype).bits <= 32
        and (jnp.issubdtype(ids.dtype, jnp.signedinteger) or jnp.iinfo(ids.dtype).bits < 32),
        f"row ids must fit int32, got {ids.dtype}")
  _need(ids.ndim == 1, f"row ids must be 1-D, got shape {ids.shape}")
  return ids.astype(ID_DTYPE)


def _check_rows(ids, rows, num_rows: int, row_shape) -> int:
  _need(0 <= num_rows <= np.iinfo(np.int32).max, f"{num_rows} rows do not fit int32 ids")
  _f32("the gradient rows", rows)
  _need(rows.ndim >= 1 and rows.shape[0] == ids.shape[0],
        f"{ids.shape[0]} ids but gradient rows of shape {rows.shape}")
  _need(tuple(rows.shape[1:]) == tuple(row_shape),
        f"gradient rows of shape {tuple(rows.shape[1:])} for table rows of shape {tuple(row_shape)}")
  return int(np.prod(row_shape, dtype=np.int64))


def sparse_lazy(variant: Variant, s: jax.Array, ids: jax.Array, rows: jax.Array,
                state: tuple[jax.Array, ...], table: jax.Array | None = None, *,
                row_shape, num_rows: int, offset: int = 0, merge: bool = True,
                decay: bool = False):
  """One call of the lazy row step on the rows ``ids`` of a ``num_rows``-row table of
  rows ``row_shape``, whose state lies in the buffers of ``state`` from element ``offset``.

  With ``table``: returns ``(table, state)``, the rows moved by ``-lr * u``. Without:
  ``(ids, u, state)``, the distinct ids (``num_rows`` in unused slots) and the direction of
  each. ``merge``: sum repeated ids first (otherwise each occurrence is its own row).
  """
  ids = kernel_ids(ids)
  width = _check_rows(ids, rows, num_rows, row_shape)
  _check_state(variant, state, num_rows * width, offset)
  k = ids.shape[0]
  outs = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in state]
  operands = [s, ids, rows, *state]
  aliases = {3 + j: j for j in range(len(state))}
  if table is not None:
    _f32("the table", table)
    _need(table.shape == (num_rows, *row_shape),
          f"table of shape {table.shape}, expected {(num_rows, *row_shape)}")
    aliases[3 + len(state)] = len(state)
    outs.append(jax.ShapeDtypeStruct(table.shape, table.dtype))
    operands.append(table)
  else:
    outs += [jax.ShapeDtypeStruct((k,), ID_DTYPE), jax.ShapeDtypeStruct(rows.shape, rows.dtype)]
  call = jax.ffi.ffi_call("adamkit_cpu_sparse_lazy", outs, input_output_aliases=aliases,
                          vmap_method="sequential")
  out = call(*operands, apply=table is not None, merge=bool(merge), offset=np.int64(offset),
             num_rows=np.int64(num_rows), **_attrs(variant, decay, state))
  new_state = tuple(out[:len(state)])
  if table is not None:
    return out[len(state)], new_state
  return out[len(state)], out[len(state) + 1], new_state


def sparse_lazy_quantized(variant: Variant, s: jax.Array, ids: jax.Array, rows: jax.Array,
                          state: tuple, *, row_shape, num_rows: int, block: int,
                          merge: bool = True):
  """:func:`sparse_lazy` without a table, the state :class:`Codes` of the table's own
  moments (``num_rows`` rows, each whole blocks of ``block``): returns ``(ids, u,
  state)``, the touched rows' codes and scales rewritten, in place when donated. A scale
  that is negative or not finite reads as 0 (see ``adamkit._quant.readable_scales``)."""
  ids = kernel_ids(ids)
  width = _check_rows(ids, rows, num_rows, row_shape)
  nstate = state_buffers(variant)
  _need(len(state) == nstate and all(isinstance(b, Codes) for b in state),
        f"expected {nstate} state buffers of 8-bit codes, got {len(state)}")
  _need(block >= 1 and block & (block - 1) == 0 and width % block == 0,
        f"block size {block} is not a power of two dividing the rows ({width} elements)")
  operands, outs, aliases = [s, ids, rows], [], {}
  for name, buf in zip(STATE_NAMES, state):
    _check_codes(name, buf, num_rows * width // block, 0, block)
    _need(buf.codes.size == num_rows * width, f"the {name} has {buf.codes.size} codes for a "
          f"table of {num_rows} rows of {width}")
    for x in (buf.codes, buf.scales):
      aliases[len(operands)] = len(outs)
      operands.append(x)
      outs.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
    operands += [jnp.asarray(buf.book, jnp.float32), jnp.asarray(buf.midpoints, jnp.float32)]
  outs += [jax.ShapeDtypeStruct(ids.shape, ID_DTYPE), jax.ShapeDtypeStruct(rows.shape, rows.dtype)]
  call = jax.ffi.ffi_call("adamkit_cpu_sparse_lazy_quantized", outs,
                          input_output_aliases=aliases, vmap_method="sequential")
  out = call(*operands, kind=np.int64(KINDS[variant.kind]), nesterov=bool(variant.nesterov),
             amsgrad=bool(variant.amsgrad), state=np.int64(nstate), merge=bool(merge),
             num_rows=np.int64(num_rows), block=np.int64(block))
  new_state = tuple(buf._replace(codes=out[2 * j], scales=out[2 * j + 1])
                    for j, buf in enumerate(state))
  return out[-2], out[-1], new_state


def row_add(table: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
  """``table[ids] += rows`` (repeated ids add up, ids outside the table skipped), one call,
  in place when ``table`` is donated."""
  ids = kernel_ids(ids)
  _f32("the table", table)
  _need(table.ndim >= 1, f"the table must have at least 1 dimension, got shape {table.shape}")
  _check_rows(ids, rows, table.shape[0], table.shape[1:])
  call = jax.ffi.ffi_call("adamkit_cpu_row_add", jax.ShapeDtypeStruct(table.shape, table.dtype),
                          input_output_aliases={2: 0}, vmap_method="sequential")
  return call(ids, rows, table)
