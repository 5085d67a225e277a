"""Low-precision params without a float32 master copy: stochastic rounding and Kahan updates.

* :func:`stochastic_round`: float32 to bf16 or fp16, rounding up with probability
  equal to the dropped fraction, with random bits from a counter-based hash of the key and
  each element's global position (the same numbers whatever the sharding).
* :func:`param_rounding`: wraps any transform whose params may be bf16 or fp16; the wrapped
  transform works in float32 and the new params are the rounded float32 sum, by round to
  nearest, stochastic rounding or a Kahan-compensated sum with a buffer in the params' dtype.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adamkit import _platform, _quant, _quant_ops, _validate
from adamkit._sparse_types import is_row_sparse, map_values
from adamkit._tree import path_name, place_scalars_like

METHODS = ("nearest", "stochastic", "kahan")

# ------------------------------------------------------------------ the random bits

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl(x, r: int):
  return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0, k1, c0, c1):
  """Threefry-2x32 with 20 rounds (Salmon et al. 2011; JAX's ``threefry2x32`` primitive),
  written out in ``uint32`` arithmetic so the formula is explicit and elementwise: it
  partitions like any elementwise op, and a C++ kernel can reproduce it. Returns the two
  output words for key ``(k0, k1)`` and counter ``(c0, c1)`` (arrays broadcast)."""
  ks = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
  x0, x1 = c0 + ks[0], c1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x0, x1


def _counters(shape: tuple[int, ...]):
  """Each element's global position as two ``uint32`` words: its index along axis 0 and
  its row-major index within the trailing axes. Built from ``iota``s, so a sharded array
  computes its own block's positions with no communication."""
  if any(d > 2**32 for d in shape[:1]) or int(np.prod(shape[1:], dtype=np.int64)) > 2**32:
    raise ValueError(
        f"stochastic_round numbers elements by (index along axis 0, index within the other "
        f"axes), each below 2**32; an array of shape {shape} has more. Reshape it first.")
  if not shape:
    return np.uint32(0), np.uint32(0)
  c0 = jax.lax.broadcasted_iota(jnp.uint32, shape, 0)
  c1 = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in range(len(shape) - 1, 0, -1):
    c1 = c1 + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
    stride *= shape[axis]
  return c0, c1


def _key_words(key: Any, name: str):
  """The two ``uint32`` words of a key: a threefry key's data; for a key of another
  implementation (``"rbg"``) two words drawn from it; a raw ``uint32[2]`` key as is."""
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if np.shape(key) != ():
      raise ValueError(f"`{name}` must be one key, got an array of keys of shape {np.shape(key)}.")
    if "threefry" in str(jax.random.key_impl(key)):
      data = jax.random.key_data(key)
    else:
      data = jax.random.bits(key, (2,), jnp.uint32)
    return data[0], data[1]
  if dtype is not None and np.dtype(dtype) == np.uint32 and np.shape(key) == (2,):
    data = jnp.asarray(key)
    return data[0], data[1]
  raise TypeError(
      f"`{name}` must be a JAX key (jax.random.key(0)) or a raw uint32[2] key "
      f"(jax.random.PRNGKey(0)), got {type(key).__name__}"
      + (f" of dtype {dtype} and shape {np.shape(key)}." if dtype is not None else "."))


NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check_narrow(dtype: Any, name: str = "dtype") -> np.dtype:
  dtype = _validate.check_dtype(name, dtype, complex_ok=False)
  if dtype not in NARROW:
    raise ValueError(f"`{name}` must be jnp.bfloat16 or jnp.float16, got {dtype}.")
  return dtype


def round_nearest(x32: jax.Array, dtype: np.dtype) -> jax.Array:
  """``x32`` rounded to the nearest value of ``dtype`` (ties to even), kept in float32.

  Not ``x.astype(dtype).astype(float32)``: XLA may drop such a pair of converts when it
  allows excess precision (its default on GPU), and the rounding with it; it keeps
  ``lax.reduce_precision``. That op flushes float16's subnormals (below ``2**-14``), which
  are multiples of ``2**-24`` rounded here with ``round`` (ties to even) instead.
  """
  info = jnp.finfo(dtype)
  r = jax.lax.reduce_precision(x32, exponent_bits=info.nexp, mantissa_bits=info.nmant)
  if dtype == jnp.float16:
    scale = np.float32(2.0**24)
    r = jnp.where(jnp.abs(x32) < np.float32(2.0**-14), jnp.round(x32 * scale) / scale, r)
  return r


def _in_space_of(x: jax.Array, bits: jax.Array) -> jax.Array:
  """``bits`` in ``x``'s memory space. Under ``ak.offload(mode="compute")`` the update is
  traced on host-resident arrays, and arrays made from ``iota`` are typed device memory,
  which JAX will not combine with host ones."""
  space = jax.typeof(x).memory_space
  return bits if jax.typeof(bits).memory_space == space else jax.device_put(bits, space)


_BF16_LAST = 0x7F7F  # the bit pattern of bfloat16's largest finite magnitude


def _bf16_pattern(x32: jax.Array, bits: jax.Array) -> jax.Array:
  """Stochastic rounding to bfloat16 on the bit patterns (uint32, the result's float32
  bits): ``|x|``'s pattern truncated to its top 16 bits is the lower neighbour, plus 1 the
  upper one (the next magnitude, also across a binade), chosen when ``bits >> 16`` is below
  the 16 dropped bits, so with probability (dropped bits) / 2^16, exactly the dropped
  fraction: E[SR(x)] = x for every finite float32, subnormals included.
  No float arithmetic, so nothing is flushed (XLA:CPU flushes float32 subnormals, the gap
  between the neighbours of an ``|x|`` under about 3e-36). The C++ kernel's rule."""
  xb = jax.lax.bitcast_convert_type(x32, jnp.uint32)
  mag = xb & np.uint32(0x7FFFFFFF)
  up = (bits >> np.uint32(16)) < (mag & np.uint32(0xFFFF))
  rounded = ((mag >> np.uint32(16)) + up.astype(jnp.uint32)) << np.uint32(16)
  # NaN, infinities and magnitudes past the largest bfloat16 round to nearest, as astype
  special = (mag >> np.uint32(16)) >= np.uint32(_BF16_LAST)
  nearest = jax.lax.bitcast_convert_type(round_nearest(jnp.abs(x32), jnp.bfloat16), jnp.uint32)
  return jnp.where(special, nearest, rounded) | (xb & np.uint32(0x80000000))


def _round_with_bits(x32: jax.Array, dtype: np.dtype, bits: jax.Array) -> jax.Array:
  """Stochastic rounding of float32 ``x32`` to ``dtype`` given 32 random bits per element;
  the result is a float32 array of values of ``dtype``."""
  bits = _in_space_of(x32, bits)
  if dtype == jnp.bfloat16:
    return jax.lax.bitcast_convert_type(_bf16_pattern(x32, bits), jnp.float32)
  a = jnp.abs(x32)
  y32 = round_nearest(a, dtype)  # the nearest value of `dtype` to |x|: one neighbour
  # The other neighbour is one step of the bit pattern away: for a non-negative float,
  # the next representable magnitude is the next integer of its bits.
  ybits = jax.lax.bitcast_convert_type(y32.astype(dtype), jnp.uint16)
  one = np.uint16(1)
  other = jax.lax.bitcast_convert_type(jnp.where(y32 > a, ybits - one, ybits + one),
                                       dtype).astype(jnp.float32)
  lo32 = jnp.where(y32 > a, other, y32)
  hi32 = jnp.where(y32 > a, y32, other)
  # Both differences are exact in float32 (Sterbenz: lo <= |x| < hi <= 2 lo, or lo = 0), and
  # hi - lo is a power of two, so p is the dropped fraction exactly.
  p = (a - lo32) / (hi32 - lo32)
  u = (bits >> np.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)  # in [0, 1), 24 bits
  r = jnp.where(u < p, hi32, lo32)
  # Exact values, NaN and infinities keep the nearest value (and so does a value beyond the
  # largest finite number of `dtype`, whose upper neighbour is inf: as astype does).
  r = jnp.where((y32 == a) | jnp.isnan(a) | jnp.isinf(hi32), y32, r)
  return jnp.where(jnp.signbit(x32), -r, r)


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
  r"""Rounds ``x`` to ``dtype`` up or down at random, unbiased: :math:`E[\mathrm{SR}(x)] = x`.

  For each element, with :math:`\ell \le |x| < h` the two neighbouring magnitudes of
  ``dtype`` and :math:`u \in [0, 1)` its random number,

  .. math::

    \mathrm{SR}(x) &= \mathrm{sign}(x) \cdot \begin{cases}
        h & u < p \\ \ell & \text{otherwise} \end{cases}, \qquad
        p = \frac{|x| - \ell}{h - \ell} \\
    (b, \cdot) &= \mathrm{threefry2x32}\big(\mathrm{key},\ (i_0,\ j)\big), \qquad
    u = \lfloor b / 2^8 \rfloor \cdot 2^{-24}

  where :math:`(i_0, j)` is the element's global position: its index along axis 0 and
  its row-major index within the other axes. The random bits depend on the key and the
  position only, never on the device or the sharding, so a sharded ``x`` gives the same
  numbers as an unsharded one, each device computing its own block. Exact values, NaN and
  infinities round as ``x.astype(dtype)`` does, and so do values beyond ``dtype``'s
  largest finite number.

  :math:`p` is computed exactly and :math:`u` has 24 bits, so for bfloat16 (16 dropped
  bits) and float16 normals (13) the probability of rounding up is exactly the dropped
  fraction; for float16 subnormals within :math:`2^{-24}` of it. For bfloat16 the same
  decision is made on the bit patterns, up when ``b >> 16`` is below the 16 bits of
  :math:`|x|` that bfloat16 drops (:math:`h` is then the next bit pattern after
  :math:`\ell`'s), with no float arithmetic: :math:`E[\mathrm{SR}(x)] = x` holds for every
  finite float32 :math:`x`, subnormals included (computed in floats, :math:`h - \ell`
  under float32's smallest normal number, for :math:`|x|` below about 3e-36, is flushed to
  zero on CPU). The C++ kernel's rounded step uses the same rule.

  .. warning::
    torchao's ``bf16_stochastic_round`` adds 16 random bits to the float32 bit pattern and
    truncates (bfloat16 only, random bits from the device's generator). This one rounds to
    float16 too, by the rule above; for bfloat16 it rounds up with the same probability,
    but the draws differ from torchao's.

  Args:
    x: a floating-point array of at most 32 bits (computed in float32).
    dtype: ``jnp.bfloat16`` or ``jnp.float16``.
    key: a JAX key (``jax.random.key(0)``, the same draws for the same key) or a raw
      ``uint32[2]`` key (``jax.random.PRNGKey(0)``).

  Returns:
    ``x`` rounded to ``dtype``, same shape (and sharding).

  Examples:
    >>> import jax, jax.numpy as jnp, adamkit as ak
    >>> x = jnp.full(100_000, 1.0 + 2.0**-9)  # a quarter of the way from 1 to 1 + 2**-7
    >>> y = ak.stochastic_round(x, jnp.bfloat16, jax.random.key(0))
    >>> sorted(set(y.tolist()))
    [1.0, 1.0078125]
    >>> print(f"{float(jnp.mean(y.astype(jnp.float32))):.4f}")  # x.astype rounds to 1.0
    1.0020

  References:
    Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015; Salmon et
    al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011 (Threefry).
  """
  dtype = _check_narrow(dtype)
  xdtype = getattr(x, "dtype", None)
  if xdtype is None or not jnp.issubdtype(xdtype, jnp.floating) or jnp.finfo(xdtype).bits > 32:
    raise TypeError(f"`x` must be a floating-point array of at most 32 bits, got "
                    f"{xdtype if xdtype is not None else type(x).__name__}.")
  k0, k1 = _key_words(key, "key")
  c0, c1 = _counters(np.shape(x))
  bits, _ = threefry2x32(k0, k1, c0, c1)
  x32 = jnp.asarray(x).astype(jnp.float32)
  if dtype == jnp.bfloat16:  # from the bits, never through a float conversion (subnormals)
    pattern = _bf16_pattern(x32, _in_space_of(x32, bits)) >> np.uint32(16)
    return jax.lax.bitcast_convert_type(pattern.astype(jnp.uint16), jnp.bfloat16)
  return _round_with_bits(x32, dtype, bits).astype(dtype)


# ------------------------------------------------------------------ one leaf's rule


def leaf_key(key: tuple[jax.Array, jax.Array], step: jax.Array, index: int):
  """The two key words of leaf ``index`` (its place in ``jax.tree.leaves(params)``) at
  step ``step``: ``threefry2x32(key, (step, index))``."""
  return threefry2x32(key[0], key[1], jnp.asarray(step).astype(jnp.uint32), np.uint32(index))


def element_bits(words, shape: tuple[int, ...]) -> jax.Array:
  """32 random bits per element of an array of ``shape``: ``threefry2x32(words, (i0, j))``
  of each element's global position (see :func:`stochastic_round`)."""
  bits, _ = threefry2x32(words[0], words[1], *_counters(tuple(shape)))
  return bits


def round_sum(method: str, dtype: np.dtype, w: jax.Array, u: jax.Array, *, comp=None,
              bits=None):
  """One low-precision leaf's rule (see :func:`param_rounding`), all in float32: ``w`` the
  param and ``u`` its update (float32 arrays), ``comp`` the Kahan buffer, ``bits`` the
  random bits of stochastic rounding.

  Returns ``(update, written, comp)``: the update in ``dtype`` (the new value minus ``w``),
  the param ``optax.apply_updates`` writes from it (float32 values of ``dtype``: ``w +
  update`` rounded, the new value itself whenever Sterbenz holds) and the new Kahan buffer,
  computed against the written param (``None`` for the other methods). The fused steps
  write ``written`` themselves, so the two forms give the same bits."""
  if method == "kahan":
    s = w + (u + comp.astype(jnp.float32))
    new = round_nearest(s, dtype)
  elif method == "stochastic":
    s = w + u
    new = _round_with_bits(s, dtype, bits)
  else:
    s = w + u
    new = round_nearest(s, dtype)
  d = new - w  # exact when new is within a factor of two of w (Sterbenz)
  written = round_nearest(w + round_nearest(d, dtype), dtype)
  return d.astype(dtype), written, (s - written).astype(dtype) if method == "kahan" else None


def _apart_on_tpu(u: jax.Array) -> jax.Array:
  """``u`` computed in its own buffer where the step is compiled for a TPU. There the
  decode of quantized moments, the inner step and stochastic rounding's threefry bits
  make one fusion too large for XLA:TPU, which then keeps dozens of leaf-sized broadcasts
  in device memory (237 bytes per parameter of temporaries for a bf16 4096x4096 leaf with
  8-bit moments on a v5e chip, compiled 2026-12-02); ``u`` apart keeps 4."""
  return _platform.on_tpu(lambda: jax.lax.optimization_barrier(u), lambda: u)


def check_state(method: str, state: Any, what: str) -> None:
  """``state`` must be the rounding state of ``method``: the error names the method a
  state of another rounding came from. ``what`` names the call (``{!r}``: the method)."""
  want = _STATES[method]
  if not isinstance(state, want):
    other = next((m for m, t in _STATES.items() if isinstance(state, t)), None)
    came = (f"a state from param_rounding(method={other!r})" if other else
            f"a {type(state).__name__}")
    raise TypeError(f"{what.format(method)} takes the {want.__name__} its own init returns, "
                    f"got {came} as `state`.")


def check_leaves(method: str, state: Any, params: Any, what: str) -> None:
  """The per-leaf part of a rounding state must fit ``params``: a Kahan buffer per
  low-precision leaf of its shape and dtype (``None`` for wider leaves); a stochastic key
  of two uint32 scalars and an integer step count. Errors name the leaf and ``what``
  (the call)."""
  if method == "kahan":
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    try:
      comps = treedef.flatten_up_to(state.compensation)
    except (ValueError, TypeError):
      raise ValueError(f"{what}: state.compensation does not match the params tree (a state "
                       "made for other params?).") from None
    for (path, p), c in zip(flat, comps):
      want = (tuple(np.shape(p)), jnp.dtype(p.dtype).name) if is_low(p) else None
      got = None if c is None else (tuple(np.shape(c)), jnp.dtype(c.dtype).name
                                    if hasattr(c, "dtype") else type(c).__name__)
      if got != want:
        raise ValueError(
            f"{what}: the Kahan buffer of '{path_name(path) or '<root>'}' is "
            f"{'None' if got is None else f'{got[1]}{got[0]}'}; the param is "
            f"{jnp.dtype(p.dtype).name}{tuple(np.shape(p))}, whose buffer is "
            f"{'None (no buffer for a float32/float64 param)' if want is None else f'{want[1]}{want[0]}'}: "
            "make the state with this transform's `init`.")
  elif method == "stochastic":
    key, step = state.key, state.step
    words = tuple(key) if isinstance(key, (tuple, list)) else (key,)
    if len(words) != 2 or any(_word_type(w) != ("uint32", ()) for w in words):
      raise TypeError(
          f"{what}: state.key must be two uint32 scalars (the raw threefry key's words), got "
          f"{[_word_type(w) for w in words]}: make the state with this transform's `init`.")
    if not jnp.issubdtype(getattr(step, "dtype", np.float64), jnp.integer) or np.ndim(step):
      raise TypeError(f"{what}: state.step must be an integer scalar (the updates made), got "
                      f"{_word_type(step)}.")


def _word_type(x) -> tuple:
  dtype = getattr(x, "dtype", None)
  return (jnp.dtype(dtype).name if dtype is not None else type(x).__name__, tuple(np.shape(x)))


# ------------------------------------------------------------------ the wrapper


class NearestRoundingState(NamedTuple):
  inner: optax.OptState  # the wrapped transform's state, built on the float32 view of params


class StochasticRoundingState(NamedTuple):
  step: jax.Array  # int32 scalar: updates made (saturating); selects the step's random bits
  # the raw threefry key the random bits come from (fixed): jax.random.key_data's two
  # words, as two uint32 scalars (0-d, so they are placed and compiled for as the step is)
  key: tuple[jax.Array, jax.Array]
  inner: optax.OptState  # the wrapped transform's state, built on the float32 view of params


class KahanState(NamedTuple):
  # per low-precision leaf, in its dtype: what the last rounding of the param dropped (added
  # back at the next step); float32/float64 leaves: None
  compensation: optax.Params
  inner: optax.OptState  # the wrapped transform's state, built on the float32 view of params


_STATES = {"nearest": NearestRoundingState, "stochastic": StochasticRoundingState,
           "kahan": KahanState}


def is_low(leaf) -> bool:
  """A leaf narrower than float32 (bf16, fp16): rounded; wider ones pass straight through."""
  return jnp.finfo(leaf.dtype).bits < 32


def _seed_words(seed: Any) -> np.ndarray | jax.Array:
  """``seed`` as a raw ``uint32[2]`` key; an int ``s`` gives ``jax.random.key(s)``'s."""
  if isinstance(seed, numbers.Integral) and not isinstance(seed, (bool, np.bool_)):
    s = int(seed)
    if not 0 <= s < 2**64:
      raise ValueError(f"`seed` must be an int in [0, 2**64) or a JAX key, got {s}.")
    return np.array([s >> 32, s & 0xFFFFFFFF], np.uint32)
  try:
    k0, k1 = _key_words(seed, "seed")
  except TypeError:
    raise TypeError("`seed` must be an int in [0, 2**64) or a JAX key (jax.random.key(0), or "
                    f"a raw uint32[2] jax.random.PRNGKey(0)), got {type(seed).__name__}"
                    + (f" of dtype {seed.dtype}." if hasattr(seed, "dtype") else ".")) from None
  except ValueError as e:
    raise ValueError(str(e)) from None
  words = jnp.stack([k0, k1])
  return words if _validate._is_tracer(words) else np.asarray(words)


def param_rounding(tx: optax.GradientTransformation, method: str, *,
                   seed: Any = 0) -> optax.GradientTransformationExtraArgs:
  r"""Low-precision params (bf16, fp16) updated in float32 and rounded without a master copy.

  ``tx`` sees float32 gradients and a float32 view of the params (its state, e.g. Adam's
  moments, is float32 unless it asks otherwise). For each low-precision leaf :math:`w`
  with ``tx``'s float32 update :math:`u`:

  .. math::

    \text{nearest:}\quad & w' = \mathrm{RN}(w + u) \\
    \text{stochastic:}\quad & w' = \mathrm{SR}_{k_{t,l}}(w + u), \qquad
        k_{t,l} = \mathrm{threefry2x32}(\mathrm{key},\ (t,\ l)) \\
    \text{kahan:}\quad & s = w + (u + c), \quad w' = \mathrm{RN}(s), \quad
        c' = \mathrm{RN}(s - w')

  all sums in float32; RN rounds to the nearest value of the param's dtype, SR is
  :func:`adamkit.stochastic_round` with the key :math:`k_{t,l}` of step :math:`t` (updates
  made so far) and leaf :math:`l` (its index in ``jax.tree.leaves(params)``), and :math:`c`
  is the Kahan buffer: what the last rounding dropped, kept in the param's dtype (2 bytes
  per bf16 parameter) and added back at the next step. float32 and float64 leaves pass
  straight through (``"kahan"`` keeps no buffer for them: a documented no-op).

  The returned update is :math:`\Delta = w' - w` in the param's dtype, so the unchanged
  ``optax.apply_updates`` (or ``ak.apply_updates``) gives :math:`w'`. The difference of two
  values of one format within a factor of two of each other is exact in that format
  (Sterbenz), which covers every step that moves a weight by less than half its
  magnitude; a larger step (a weight crossing zero) gives :math:`w'` within one rounding,
  and the Kahan buffer is computed against the param actually written, so it still
  carries what was dropped.

  Why: an update smaller than half a bf16 unit in the last place of :math:`w` (8 bits of
  mantissa) is rounded away by round to nearest, so with a decayed learning rate bf16
  params stop moving. Stochastic rounding makes the rounding unbiased (it costs no memory,
  but adds noise); Kahan compensation keeps the dropped part (deterministic, 2 bytes per
  parameter). :func:`adamkit.master_weights` keeps a float32 copy instead (4 bytes).

  .. warning::
    Differences from the anchors. torchao's low-bit optimizers (``bf16_stochastic_round=
    True``) round by adding random bits to the float32 pattern, from the device's
    generator; here the bits come from a counter-based hash of (key, step, leaf,
    position), the same on any sharding or number of processes. optimi's Kahan
    summation computes in the param's dtype; here the sums are float32 and only the buffer
    is stored in the param's dtype. ``"nearest"`` rounds the float32 sum once; ``tx``
    without this wrapper on bf16 params returns a bf16 update that
    ``optax.apply_updates`` rounds a second time, in the sum.

  A row-sparse update (:class:`adamkit.RowSparse`, from ``ak.sparse_adam``) of a
  low-precision leaf is applied to the whole table (its untouched rows get a zero
  update; ``"kahan"`` adds their buffer back), so the returned update is dense. A
  :class:`adamkit.FusedStep` is wrapped in its optax form (``update``; its one-pass
  ``step`` is not kept).

  Args:
    tx: any optax transformation (adamkit's or optax's).
    method: ``"nearest"`` (round to nearest, for comparison), ``"stochastic"`` or
      ``"kahan"``.
    seed: for ``"stochastic"``: an int (``seed=s`` uses the key ``jax.random.key(s)``), a
      JAX key, or a raw ``uint32[2]`` key. Kept in the state, so a restored checkpoint
      goes on with its own random bits.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`NearestRoundingState`,
    :class:`StochasticRoundingState` or :class:`KahanState`.

  Raises:
    ValueError: an unknown ``method``, a ``seed`` int outside ``[0, 2**64)``.
    TypeError: a ``seed`` that is not an int or a key; integer params, or low-precision
      params other than bfloat16 and float16 (at ``init``); a state from another method or
      another transform (at ``update``).

  Examples:
    >>> import jax.numpy as jnp, optax, adamkit as ak
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> g = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> for method in ("nearest", "kahan"):
    ...   tx = ak.param_rounding(optax.sgd(1e-3), method)  # 1e-3: under half a bf16
    ...   p, state = params, tx.init(params)             # unit at 1.0 (2**-8)
    ...   for _ in range(10):
    ...     updates, state = tx.update(g, state, p)
    ...     p = optax.apply_updates(p, updates)
    ...   print(method, p["w"][0])
    nearest 1
    kahan 0.988281
    >>> print(f"{float(p['w'][0]) + float(state.compensation['w'][0]):.4f}")  # 1 - 10 * 1e-3
    0.9900

  References:
    Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015 (stochastic
    rounding); Kahan, "Further remarks on reducing truncation errors", CACM 1965; Zamirai
    et al., "Revisiting BFloat16 Training", 2020 (both for bf16 weights).
  """
  _validate.check_choice("method", method, METHODS)
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"`tx` must be an optax GradientTransformation, got {type(tx).__name__}.")
  key_words = _seed_words(seed) if method == "stochastic" else None
  inner = optax.with_extra_args_support(tx)

  def view32(params):
    return jax.tree.map(lambda p: p.astype(jnp.float32) if is_low(p) else p, params)

  def init_fn(params):
    _validate.check_float_params(params)
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
      if is_low(p) and jnp.dtype(p.dtype) not in NARROW:
        raise TypeError(f"param_rounding rounds bfloat16 and float16 params; params leaf "
                        f"'{path_name(path) or '<root>'}' has dtype {p.dtype}.")
    inner_state = inner.init(view32(params))
    if method == "nearest":
      return NearestRoundingState(inner=inner_state)
    if method == "kahan":
      comp = jax.tree.map(lambda p: jnp.zeros_like(p) if is_low(p) else None, params)
      return KahanState(compensation=comp, inner=inner_state)
    key = (jnp.asarray(key_words[0], jnp.uint32), jnp.asarray(key_words[1], jnp.uint32))
    state = StochasticRoundingState(step=jnp.zeros([], jnp.int32), key=key, inner=inner_state)
    return place_scalars_like(state, params)

  def update_fn(updates, state, params=None, **extra):
    if params is None:
      raise ValueError("param_rounding needs `params`: call `update(grads, state, params)`.")
    check_state(method, state, "param_rounding(method={!r}).update")
    _validate.check_matching_trees(updates, params)
    check_leaves(method, state, params, f"param_rounding(method={method!r}).update")
    p_flat, treedef = jax.tree.flatten(params)
    g_flat = treedef.flatten_up_to(updates)
    low = [is_low(p) for p in p_flat]
    to32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    wide = [map_values(to32, g) if lo else g for g, lo in zip(g_flat, low)]
    # the inner step's quantized moments read the narrow gradient chunk by chunk
    narrow = [(w, g) for w, g, lo in zip(wide, g_flat, low) if lo and not is_row_sparse(g)]
    with _quant_ops.widened_from(narrow):
      u32, inner_state = inner.update(treedef.unflatten(wide), state.inner, view32(params),
                                      **extra)
    u_flat = treedef.flatten_up_to(u32)
    comp_flat = (treedef.flatten_up_to(state.compensation) if method == "kahan"
                 else [None] * len(p_flat))

    quantized = any(map(_quant.is_qarray, jax.tree.leaves(inner_state, is_leaf=_quant.is_qarray)))
    out_u, out_c = [], []
    for index, (p, u, c, lo) in enumerate(zip(p_flat, u_flat, comp_flat, low)):
      if not lo:
        out_u.append(u)
        out_c.append(None)
        continue
      if is_row_sparse(u):
        u = u.todense()
      bits = (element_bits(leaf_key(state.key, state.step, index), p.shape)
              if method == "stochastic" else None)
      if bits is not None and quantized:
        u = _apart_on_tpu(u)
      d, _, c = round_sum(method, p.dtype, p.astype(jnp.float32), u.astype(jnp.float32),
                          comp=c, bits=bits)
      out_u.append(d)
      out_c.append(c)
    new_updates = treedef.unflatten(out_u)
    if method == "nearest":
      return new_updates, NearestRoundingState(inner=inner_state)
    if method == "kahan":
      return new_updates, KahanState(compensation=treedef.unflatten(out_c), inner=inner_state)
    return new_updates, StochasticRoundingState(
        step=optax.safe_int32_increment(state.step), key=state.key, inner=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
