"""Block-wise quantized storage of optimizer moments: 8-bit, 4-bit and fp8.

A moment leaf of ``n`` elements is cut into blocks of ``B`` consecutive elements (C order);
each block keeps one float32 scale and one code per element, and is read back as
``value[code] * scale``. The format is chosen per moment by ``mu_dtype`` / ``nu_dtype``
(:class:`Quantized`); the arithmetic of the step stays float32.

The module has three layers: the format spec (:class:`Quantized`, resolved per moment into a
:class:`Format`), the code books (:func:`dynamic_map` etc.), and the stored array
(:class:`QuantizedArray`) with :func:`quantize` / :func:`dequantize`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adamkit import _platform

KINDS = ("8bit", "4bit", "fp8")
ROLES = ("mu", "nu")  # signed first moment; non-negative second moment (or AdaMax's norm)
SCALE_FLOOR = 1e-12  # the smallest block scale (torchao's floor), so 0/scale stays 0
DEFAULT_BLOCK = {("8bit", "mu"): 256, ("8bit", "nu"): 256, ("4bit", "mu"): 128,
                 ("4bit", "nu"): 256, ("fp8", "mu"): 256, ("fp8", "nu"): 256}
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_TINY = 2.0 ** -9  # its smallest subnormal


@dataclasses.dataclass(frozen=True)
class Quantized:
  r"""A quantized storage format for an optimizer moment, passed as ``mu_dtype`` / ``nu_dtype``.

  .. math::

    s_b = \max(\max_{i \in b} |y_i|,\ 10^{-12}), \qquad
    c_i = \mathrm{round}(y_i / s_b), \qquad
    \tilde y_i = q_{c_i}\, s_b

  for each block :math:`b` of ``block_size`` consecutive elements (C order), where
  :math:`y` is the moment itself (first moment :math:`m`, and :math:`v` at 8 bits) or
  :math:`\sqrt{v}` (second moment at 4 bits and fp8, read back as :math:`\tilde y^2`:
  its dynamic range is the gradient's, not the square of it), and the code book :math:`q`
  and the rounding depend on ``kind``:

  * ``"8bit"``: bitsandbytes' / torchao's format. 256 codes of the "dynamic" map
    (7 decades :math:`10^{-6} \dots 1`, signed for the first moment, unsigned with twice
    the resolution for the second), nearest code, ties rounded up. 2 bytes per parameter
    for both moments, plus a float32 scale per block (default 256: 2.03 bytes). One
    difference, for the second moment only: a positive :math:`r = v/s_b` under the first
    midpoint :math:`\mu_0 = 1.6\cdot 10^{-7}` is stored as the smallest non-zero code
    :math:`q_1 = 3.25\cdot 10^{-7}` instead of 0,

    .. math::

      c_i = \begin{cases} 1 & 2^{-126} \le r_i < \mu_0 \\
                          \mathrm{round}(r_i) & \text{otherwise} \end{cases}

    (:math:`2^{-126}`, the smallest normal float32, keeps 0 for values that XLA:CPU flushes
    anyway), so a non-zero :math:`v` never reads back as 0. In the anchors' arithmetic
    (``exact=True``) it does, and where its :math:`m` is not 0 (a weight whose gradient
    fell to 0 in a block whose maximum is large), :math:`m/(\sqrt{v}+\epsilon)` moves the
    weight hundreds of learning rates in one step (1,186 lr in the reduced case of the
    tests, where float32 Adam moves 1.0); with the floor a step stays within float32
    Adam's own bound. The first moment and every other code are the anchors'.
    The step's arithmetic is bitsandbytes': :math:`\beta_1 m + (1-\beta_1) g` and codes
    of :math:`x \cdot (1/s_b)`; torchao forms the moments by ``lerp`` and divides by
    :math:`s_b`, a float32 rounding apart. A code at a rounding boundary then flips, and
    a flipped code of a small :math:`v` (where the map is coarse) moves that weight's
    steps by up to a fifth of the learning rate: torchao runs of 10-20 steps (the tests'
    five, ``benchmarks/bench_torchao_replay.py``'s six) stay within 0.08 x lr of
    torchao's, longer ones drift further (the low-memory guide).
  * ``"4bit"``: adamkit's 4-bit format. The first moment: 15 evenly spaced levels
    :math:`q_k = k/7`, :math:`k = -7 \dots 7`, in blocks of 128, rounded *stochastically*
    to one of the two neighbouring levels, up with probability
    :math:`7 y/s_b - \lfloor 7 y/s_b \rfloor`, so :math:`E[\tilde m] = m`. The random
    number is a counter-based hash of integers only: the element's flat position
    :math:`i` in its leaf (C order; a table row :math:`r`'s element :math:`j` is
    :math:`i = rD + j`), the optimizer's step count :math:`t` (1 at the first step) and
    the moment's role, :math:`u_i = \lfloor h((i\cdot\mathtt{0x9E3779B9}) \oplus
    h(t \oplus \mathtt{0x5BD1E995}))/2^8\rfloor\, 2^{-24}` with :math:`h` the
    "lowbias32" integer hash, arithmetic modulo :math:`2^{32}`; rounded up when
    :math:`u_i < 7 y/s_b - \lfloor 7 y/s_b \rfloor`. Never the value's bits: so the
    codes are the same eager and under ``jit``, on any sharding and number of processes
    (a float32 :math:`m` that differs by a rounding, from another reduction order, picks
    the other level only where :math:`7 m/s_b` lies within that rounding of the
    threshold), fresh at each step, and without state. A fused step's multi-tensor
    buffer numbers each leaf's elements from 0 too. Nearest rounding instead lets a
    small :math:`m` stick to a level that :math:`\beta_1 m` rounds back to, a bias that
    left the loss of the guide's MLP at 3-4x float32's with any 16-level map (and
    torchao's 4-bit map at 13x). The
    second moment: :math:`\sqrt{v}` on the zero-free logarithmic map
    :math:`q_k = 2^{-(15-k)/2}`, :math:`k = 0 \dots 15` (nearest in :math:`\log_2`, so
    within a factor :math:`2^{1/4}` of :math:`\sqrt{v}`), blocks of 256: a small
    :math:`v` is rounded up to :math:`2^{-15}` of its block's maximum, never down to zero,
    so :math:`m/(\sqrt{v}+\epsilon)` cannot explode. 1.05 bytes per parameter
    (:math:`\tfrac12 + \tfrac{4}{128} + \tfrac12 + \tfrac{4}{256}`).
  * ``"fp8"``: float8 e4m3 codes (3 mantissa bits, round to nearest even) of
    :math:`y/s_b \cdot 448`, read back times :math:`s_b/448`; for the second moment
    :math:`y = \sqrt{v}`, and a non-zero value never rounds to zero (it is raised to the
    smallest subnormal, :math:`2^{-9}/448` of the block's maximum). 2.03 bytes per
    parameter.

  The second-moment tricks are where adamkit differs from torchao's ``AdamW4bit`` (linear
  map for :math:`v` in blocks of 128) and ``AdamWFp8`` (e4m3 codes of :math:`v` itself):
  both lose the small entries of :math:`v` of a block whose maximum is large, which
  stalls (4-bit) or blows up (fp8) training; see the low-memory guide's quality table.

  A leaf with fewer than ``min_size`` elements keeps a float32 moment (the scales would
  cost more than they save). A leaf whose size is not a multiple of the block is padded
  to whole blocks (``pad=True``, the default, as bitsandbytes): the last block's padding
  is zeros, never read back, and costs at most one block, where float32 moments would cost
  6-7 bytes more per element. torchao keeps such a leaf's moments in float32 instead; pass
  ``pad=False`` for its rule and its trajectories (a lazy sparse table whose blocks are
  whole rows is never padded, so it is quantized either way). When the last axis
  is a multiple of the block, codes and scales keep the leaf's leading axes (shape
  ``leaf.shape[:-1] + (blocks per row, block)``), so a row- or column-sharded parameter
  shards its codes and scales alike.

  Args:
    kind: ``"8bit"``, ``"4bit"`` or ``"fp8"``.
    block_size: elements per scale, a power of two (default: see above; ``"4bit"`` needs
      at least 2).
    min_size: leaves with fewer elements keep float32 moments (default 4096, as
      bitsandbytes and torchao), an integer >= 0.
    pad: whether a leaf whose size is not a multiple of the block is padded to whole
      blocks (``True``, bitsandbytes' rule) or keeps float32 moments (``False``,
      torchao's).
    exact: ``"8bit"`` only: ``True`` stores the second moment with bitsandbytes' and
      torchao's arithmetic bit for bit (a small :math:`v` may round to 0), for ports and
      replays of their runs; ``False`` (the default) floors a non-zero :math:`v` at the
      smallest non-zero code (see above).

  Examples:
    >>> import adamkit as ak
    >>> ak.Quantized("8bit")
    Quantized(kind='8bit', block_size=None, min_size=4096, pad=True, exact=False)
    >>> ak.Quantized("4bit", block_size=64).block_size
    64
    >>> q = ak.Quantized("8bit", pad=False)  # torchao's AdamW8bit: 4900 % 256 != 0
    >>> q.quantizes((70, 70), "mu"), q.quantizes((32, 256), "mu")
    (False, True)

  References:
    Dettmers, Lewis, Shleifer & Zettlemoyer, "8-bit Optimizers via Block-wise
    Quantization", ICLR 2022. Li, Chen & Zhu, "Memory Efficient Optimizers with 4-bit
    States", NeurIPS 2023.
  """

  kind: str
  block_size: int | None = None
  min_size: int = 4096
  pad: bool = True
  exact: bool = False

  def __post_init__(self):
    if not isinstance(self.kind, str) or self.kind not in KINDS:
      raise ValueError(f"Quantized `kind` must be one of {KINDS}, got {self.kind!r}.")
    b = self.block_size
    if b is not None:
      if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b <= 0 or b & (b - 1):
        raise ValueError(f"Quantized `block_size` must be a power of two >= 1 (or None for "
                         f"the kind's default), got {b!r}.")
      if self.kind == "4bit" and b < 2:
        raise ValueError(f"Quantized `block_size` must be a power of two >= 2 for '4bit' "
                         f"(two codes per byte), got {b!r}.")
    m = self.min_size
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
      raise ValueError(f"Quantized `min_size` must be an integer >= 0, got {m!r}.")
    if not isinstance(self.pad, (bool, np.bool_)):
      raise ValueError(f"Quantized `pad` must be True or False, got {self.pad!r}.")
    if not isinstance(self.exact, (bool, np.bool_)) or (self.exact and self.kind != "8bit"):
      raise ValueError(f"Quantized `exact` must be True or False, and True for '8bit' only "
                       f"(bitsandbytes' and torchao's arithmetic), got {self.exact!r} for "
                       f"{self.kind!r}.")

  def quantizes(self, shape: tuple, role: str, fmt: Format | None = None) -> bool:
    """Whether a moment (``role`` "mu" or "nu") of a leaf of ``shape`` is stored in this
    format (else float32): at least ``min_size`` elements and, with ``pad=False``, a
    multiple of the block (``fmt``'s, where a sparse table's layout sets it)."""
    size = math.prod(shape)
    if size < self.min_size:
      return False
    return self.pad or size % (fmt or resolve(self, role)).block_size == 0


@dataclasses.dataclass(frozen=True)
class Format:
  """A :class:`Quantized` resolved for one moment (``role`` "mu" or "nu"): the static part
  of a :class:`QuantizedArray`, so a state of another format is another tree structure."""

  kind: str
  role: str
  block_size: int
  exact: bool = False  # "8bit": no floor of the second moment (Quantized's `exact`)

  @property
  def packed(self) -> bool:  # two 4-bit codes per byte
    return self.kind == "4bit"


def as_format(name: str, value: Any) -> Any:
  """``None``, a ``jnp.dtype``, or a :class:`Quantized` for a ``mu_dtype``-like argument.

  Strings ``"8bit"``, ``"4bit"``, ``"fp8"`` stand for ``Quantized(kind)``. Other values go
  through the float-dtype check, with an error naming ``name``.
  """
  if isinstance(value, Quantized):
    return value
  if isinstance(value, str) and value in KINDS:
    return Quantized(value)
  from adamkit import _validate  # noqa: PLC0415 - _validate imports the lower modules

  return _validate.check_moment_format(name, value)


def is_quantized(fmt: Any) -> bool:
  return isinstance(fmt, Quantized)


def resolve(q: Quantized, role: str) -> Format:
  return Format(q.kind, role, q.block_size or DEFAULT_BLOCK[(q.kind, role)], bool(q.exact))


# ----------------------------------------------------------------------------- code books
#
# Each kind has an encoder (float32 r = x / scale -> uint8 codes) and a decoder (codes ->
# float32 r), both elementwise and without table lookups: a gather per element runs at about a
# fifth of the speed of an elementwise pass on XLA:CPU and far slower on TPU, so each format's
# codes are computed from the float's bits, comparisons and selects.


def _dynamic_map(signed: bool, total_bits: int, exponent_bits: int) -> np.ndarray:
  """The sorted "dynamic" code book (Dettmers et al. 2021): per decade ``10^-(E-1) .. 1``
  the midpoints of an even split of [0.1, 1], more points in higher decades, plus 0 and 1,
  in float32 as bitsandbytes and torchao form it."""
  non_sign = total_bits - 1
  values: list[float] = []
  for i in range(exponent_bits):
    n = 2 ** (i + non_sign - exponent_bits) + 1 if signed else 2 ** (i + non_sign - exponent_bits + 1) + 1
    edges = np.linspace(0.1, 1.0, n, dtype=np.float32)
    means = (edges[:-1] + edges[1:]) / np.float32(2.0)
    decade = 10.0 ** (-(exponent_bits - 1) + i)
    values += (np.float32(decade) * means).astype(np.float32).tolist()
    if signed:
      values += (-np.float32(decade) * means).astype(np.float32).tolist()
  values += [0.0, 1.0]
  values += [0.0] * (2 ** total_bits - len(values))
  return np.sort(np.asarray(values, np.float32))


MU4_LEVELS = 7  # the 4-bit first moment's codes stand for k / 7, k = -7 .. 7
SQRT2 = np.float32(math.sqrt(2.0))


@functools.cache
def code_book(kind: str, role: str) -> np.ndarray:
  """The sorted float32 values a code stands for: code ``c`` reads back ``code_book[c]``
  (``"fp8"``: none, the code is a float8 e4m3 number)."""
  if kind == "8bit":
    return _dynamic_map(role == "mu", 8, 7)
  if kind == "4bit" and role == "mu":
    return np.arange(-MU4_LEVELS, MU4_LEVELS + 1).astype(np.float32) * np.float32(1 / MU4_LEVELS)
  if kind == "4bit":
    return (2.0 ** (-(15 - np.arange(16)) / 2.0)).astype(np.float32)
  raise ValueError(f"the '{kind}' format has no code book")


@functools.cache
def _midpoints(kind: str, role: str) -> np.ndarray:
  q = code_book(kind, role).astype(np.float32)
  return ((q[:-1] + q[1:]) / np.float32(2.0)).astype(np.float32)


NU_FLOOR = np.float32(2.0**-126)  # 8-bit v / scale from here up never gets the code of 0


def floors(fmt: Format) -> bool:
  """Whether ``fmt`` stores a positive ``v / scale`` under the first midpoint as the
  smallest non-zero code (the 8-bit second moment without ``exact``; see :class:`Quantized`)."""
  return fmt.kind == "8bit" and fmt.role == "nu" and not fmt.exact


def kernel_midpoints(fmt: Format) -> np.ndarray:
  """The 255 midpoints the C++ kernels encode ``fmt`` with (the code of ``r`` is the
  number of midpoints ``<= r``): the code book's, with the floor's (:func:`floors`) first
  midpoint lowered to :data:`NU_FLOOR`, so that the kernels' codes are the JAX encoder's."""
  mids = _midpoints(fmt.kind, fmt.role)
  if floors(fmt):
    mids = mids.copy()
    mids[0] = NU_FLOOR  # code 0 (the value 0) below it, code 1 from it up
  return mids


# 8-bit without tables (a gather per element is slow on every backend, and on TPU by far the
# most costly op of the step). The positive values of the dynamic map are, per decade
# i = 0 .. 6, n_i = K 2^i levels (K = 1 signed, 2 unsigned); level j of decade i is
#
#   q = f32(D_i f32((e_g + e_(g+s)) / 2)),  e_g = f32(0.1 + 0.9 g / 128),  g = j s,  s = 128 / n_i,
#
# with D_i = f32(10^(i-6)): the code book's own float32 arithmetic (np.linspace's edges are the
# float32 roundings of 0.1 + 0.9 g / 128 for the grid of 129 edges that every decade samples).
# 256 e_g = f32(N / 5) for the integer N = 128 + 9 g, computed as N h + N l with 0.2 = h + l,
# h of 12 bits: N h is exact, so an FMA contracting the sum rounds as the plain sum does, and
# both give f32(N / 5) for every N used (the tests decode all 256 codes on each backend's jit).
# Levels are numbered P = K .. 128 K - 1 (0 is P = K - 1, 1.0 is P = 128 K), so decade i holds
# P in [K 2^i, K 2^(i+1)): the decade of a level is given by P's leading bit.
_FIFTH_HI = np.float32(np.round(0.2 * 2**12) / 2**12)
_FIFTH_LO = np.float32(0.2 - float(_FIFTH_HI))
_DECADES = 7


def _fifth(n: jax.Array) -> jax.Array:
  """``f32(n / 5)`` for integers ``0 <= n <= 2^11`` (int32), without a division."""
  x = n.astype(jnp.float32)
  return x * _FIFTH_HI + x * _FIFTH_LO


@functools.cache
def _map_shape(role: str) -> tuple[int, int, tuple, tuple, tuple, tuple]:
  """``(K, zero, scale, alpha, beta, thresholds)`` of the 8-bit map of ``role``: levels per
  decade are ``K 2^i``, ``zero`` is the code of 0; per decade, ``scale = D_i / 512``
  (``q = scale (f(N) + f(N + 9 s))``, ``f(N) = 256 e``) and ``x = alpha |r| - beta``, about
  the index of the decade's midpoint nearest ``|r|``; ``thresholds`` (int32 bits): the
  midpoints just under each decade's first level and under 1.0."""
  k, zero = (1, 127) if role == "mu" else (2, 0)
  d = [np.float32(10.0 ** (i - 6)) for i in range(_DECADES)]
  scale = tuple(np.float32(x / np.float32(512)) for x in d)
  alpha = tuple(np.float32((k << i) / (0.9 * float(d[i]))) for i in range(_DECADES))
  beta = tuple(np.float32(0.1 * (k << i) / 0.9 + 1.0) for i in range(_DECADES))
  mids = _midpoints("8bit", role)
  under = tuple(int(mids[zero + (k << i) - k].view(np.int32)) for i in range(_DECADES + 1))
  return k, zero, scale, alpha, beta, under


def _by_decade(masks: list, values: tuple, shape: tuple) -> jax.Array:
  """``values[i]`` where ``i`` is the number of true ``masks`` (nested: each implies the
  previous), by selects."""
  out = jnp.full(shape, values[0])
  for m, v in zip(masks, values[1:]):
    out = jnp.where(m, v, out)
  return out


def _level(p: jax.Array, i: jax.Array, scale: jax.Array, k: int) -> jax.Array:
  """The value of level ``p`` (int32) of decade ``i``, bit for bit the code book's."""
  s = (128 // k) >> i
  n = 128 + 9 * s * (p - (k << i))
  return scale * (_fifth(n) + _fifth(n + 9 * s))


def _decode_8bit(codes: jax.Array, role: str) -> jax.Array:
  k, zero, scale, *_ = _map_shape(role)
  c = codes.astype(jnp.int32)
  neg = c < zero  # the signed map's negative codes mirror the positive ones: 126 - c <-> 128 + c
  p = jnp.where(neg, zero - c, c - zero) - 1 + k
  masks = [p >= (k << i) for i in range(1, _DECADES)]
  i = sum(m.astype(jnp.int32) for m in masks)
  v = _level(p, i, _by_decade(masks, scale, c.shape), k)
  v = jnp.where(c == zero, np.float32(0), jnp.where(c == 255, np.float32(1), v))
  return jnp.where(neg, -v, v)


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.int32)


def _half_sum_bits(x: jax.Array, y: jax.Array) -> jax.Array:
  """The int32 bits of ``f32(x + y) / 2`` for positive normal floats ``x <= y`` whose
  exponents differ by at most 6, by integer ops: the exact sum of the two significands,
  rounded to nearest even by its conversion to float32. Never a float add, so no compiler
  contracts the products ``x``, ``y`` into it (an FMA rounds once where the code book's
  midpoints are rounded three times)."""
  bx, by = _bits(x), _bits(y)
  ex = bx >> 23
  shift = jnp.clip((by >> 23) - ex, 0, 6)
  t = (((by & 0x7FFFFF) | 0x800000) << shift) + ((bx & 0x7FFFFF) | 0x800000)
  return _bits(t.astype(jnp.float32)) + ((ex - 151) << 23)  # t 2^(ex - 150) / 2


def _encode_8bit(r: jax.Array, role: str) -> jax.Array:
  """The nearest code of ``r`` (ties up): the number of midpoints ``<= r``, the table's
  ``searchsorted(midpoints, r, side="right")``. ``|r|``'s decade comes from comparisons
  with the midpoints between decades; in it, the midpoint next to ``|r|`` is found by
  arithmetic and rebuilt exactly from its two levels, and one comparison settles the
  count. Bits of non-negative floats compare as integers; a negative ``r`` counts the
  midpoints ``< |r|`` (its code mirrors) by comparing ``|r|``'s bits minus one. NaN: as
  +-inf (255 for +NaN, 0 for -NaN, as the bucket tables gave)."""
  k, zero, scale, alpha, beta, under = _map_shape(role)
  ab = jnp.minimum(_bits(jnp.abs(r)), 0x7F800000)
  a = jax.lax.bitcast_convert_type(ab, jnp.float32)
  neg = jnp.signbit(r)
  if role == "mu":
    ab = ab - neg.astype(jnp.int32)
  above = [ab >= t for t in under]  # |r| at or past the midpoint under decade i (i = 7: 1.0)
  region = sum(m.astype(jnp.int32) for m in above)  # 0: the code of 0; 8: of 1.0
  i = jnp.clip(region - 1, 0, _DECADES - 1)
  n = k << i  # levels in the decade
  x = a * _by_decade(above[1:-1], alpha, r.shape) - _by_decade(above[1:-1], beta, r.shape)
  j = jnp.clip(jnp.floor(x + np.float32(0.5)).astype(jnp.int32), 0, jnp.maximum(n - 2, 0))
  d = _by_decade(above[1:-1], scale, r.shape)
  mid = _half_sum_bits(_level(n + j, i, d, k), _level(n + j + 1, i, d, k))
  j = jnp.where(n > 1, j + (ab >= mid).astype(jnp.int32), 0)
  count = jnp.where(region == 0, 0, jnp.where(region == _DECADES + 1, 127 * k + 1, n + j - k + 1))
  if role == "mu":
    code = jnp.where(neg, zero - jnp.minimum(count, zero), zero + count)
  else:
    code = jnp.where(neg, 0, count)
  return code.astype(jnp.uint8)


# On a CPU the 8-bit code is counted with two look-ups. |r| is cut into buckets: each binade
# [2^e, 2^(e+1)) in 2^7 by the top 7 bits of its mantissa, and everything under 2^-24 in the
# first bucket. No bucket holds two midpoints, so the count of midpoints <= |r| is the
# bucket's count under it plus one comparison with the bucket's first midpoint.
_BUCKET_BITS = 7
_BUCKET_E0 = 127 - 24  # the biased exponent of the first binade cut into buckets
_BUCKET_LOW = 23 - _BUCKET_BITS  # the mantissa bits under a bucket's


@functools.cache
def _bucket_tables(role: str) -> tuple[np.ndarray, np.ndarray, int]:
  """``(below, first, zero)``: per bucket, the number of positive midpoints under its lower
  end and its first midpoint at or above that end (inf if none); ``zero``: the code of 0
  (the number of negative midpoints)."""
  mids = _midpoints("8bit", role)
  pos = mids[mids > 0]
  b = np.arange((127 - _BUCKET_E0 + 1) << _BUCKET_BITS, dtype=np.uint32)
  low_bits = ((((b >> _BUCKET_BITS) + _BUCKET_E0) << 23)
              | ((b & ((1 << _BUCKET_BITS) - 1)) << _BUCKET_LOW))
  low = low_bits.view(np.float32).copy()
  low[b < (1 << _BUCKET_BITS)] = 0.0  # the first binade's buckets start at 0
  high = (low_bits | ((1 << _BUCKET_LOW) - 1)).view(np.float32)
  below = np.searchsorted(pos, low, side="left")
  if np.any(np.searchsorted(pos, high, side="right") - below > 1):  # pragma: no cover
    raise AssertionError("an 8-bit bucket holds two midpoints")
  first = np.append(pos, np.float32(np.inf)).astype(np.float32)[below]
  return below.astype(np.uint8), first, int(mids.size - pos.size)


def _encode_8bit_by_table(r: jax.Array, role: str) -> jax.Array:
  """:func:`_encode_8bit`'s codes by the bucket tables (two gathers per element), which
  XLA:CPU runs faster than the arithmetic (the pure-XLA 8-bit step of a 4096 x 4096 leaf:
  see docs/accelerators.md). A negative ``r`` counts the negative midpoints ``<= r``, the
  mirror images of the positive ones ``>= |r|``."""
  below, first, zero = _bucket_tables(role)
  a = jnp.minimum(jnp.abs(r), np.float32(1.0))  # +inf: 1.0's code, not past the last bucket
  bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
  e = bits >> 23
  bucket = (((jnp.clip(e, _BUCKET_E0, 127) - _BUCKET_E0) << _BUCKET_BITS)
            | ((bits >> _BUCKET_LOW) & ((1 << _BUCKET_BITS) - 1)))
  bucket = jnp.where(e < _BUCKET_E0, 0, bucket).astype(jnp.int32)
  n_below = jnp.asarray(below)[bucket].astype(jnp.int32)
  m = jnp.asarray(first)[bucket]
  n_le = n_below + (a >= m).astype(jnp.int32)  # positive midpoints <= |r|
  n_lt = n_below + (a > m).astype(jnp.int32)  # positive midpoints < |r|
  code = jnp.where(jnp.signbit(r), zero - jnp.minimum(n_lt, zero), zero + n_le)
  return code.astype(jnp.uint8)


def _hash32(h: jax.Array) -> jax.Array:
  """A 32-bit integer hash (Wellons' "lowbias32"): each input bit flips about half of the
  output bits."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


# The 4-bit first moment's dither: a pure function of integers (counter-based), so that the
# rounding of an element depends on its value only through the comparison with the dither,
# never through the value's bits. Runs whose m differ by a float32 rounding (eager against
# jit, one device against a mesh, another reduction order) pick the same level but where
# 7 m / s lies within that rounding of the threshold.
DITHER_SALT = {"mu": 0x5BD1E995, "nu": 0x27D4EB2F}  # per role: other moments, other numbers
_GOLDEN = np.uint32(0x9E3779B9)


def dither_key(step: Any, role: str) -> jax.Array:
  """The dither's key of one step: ``lowbias32(t ^ salt[role])`` (uint32 scalar), for the
  optimizer's step count ``t`` (the count of the moments being stored: 1 at the first step)."""
  t = jnp.asarray(step)
  if not jnp.issubdtype(t.dtype, jnp.integer) or t.ndim:
    raise TypeError(f"The 4-bit dither's step must be an integer scalar (the optimizer's "
                    f"count), got {t.dtype}{tuple(t.shape)}.")
  return _hash32(t.astype(jnp.uint32) ^ np.uint32(DITHER_SALT[role]))


def dither(pos: jax.Array, key: jax.Array) -> jax.Array:
  """A number in [0, 1) per element, a multiple of 2^-24:
  ``(lowbias32((i * 0x9E3779B9) ^ key) >> 8) * 2^-24`` for the element's position ``i``
  (uint32, arithmetic modulo 2^32) and the step's :func:`dither_key`."""
  h = _hash32((pos.astype(jnp.uint32) * _GOLDEN) ^ key)
  return (h >> 8).astype(jnp.float32) * np.float32(2.0 ** -24)


def positions(shape: tuple, start: Any = 0, strides: tuple | None = None) -> jax.Array:
  """uint32 ``start + sum_a index_a * strides[a]`` for each element of an array of
  ``shape`` (modulo 2^32); ``strides`` default to C order's, so that the positions are the
  flat indices of a leaf of ``shape`` (shifted by ``start``). Made of iotas over the global
  shape: under ``jit`` on a mesh each shard gets its own global positions."""
  shape = tuple(shape)
  if strides is None:
    strides = tuple(math.prod(shape[a + 1:]) for a in range(len(shape)))
  out = jnp.full(shape, jnp.asarray(start).astype(jnp.uint32), jnp.uint32)
  for a, stride in enumerate(strides):
    if shape[a] > 1:
      out = out + jax.lax.broadcasted_iota(jnp.uint32, shape, a) * np.uint32(stride % 2 ** 32)
  return out


def _encode_4bit_mu(r: jax.Array, u: jax.Array) -> jax.Array:
  y = r * np.float32(MU4_LEVELS)
  lo = jnp.floor(y)
  k = lo + (u < y - lo).astype(jnp.float32)  # up with probability y - lo
  return (jnp.clip(k, -MU4_LEVELS, MU4_LEVELS) + MU4_LEVELS).astype(jnp.uint8)


def _decode_4bit_mu(codes: jax.Array) -> jax.Array:
  return (codes.astype(jnp.int32) - MU4_LEVELS).astype(jnp.float32) * np.float32(1 / MU4_LEVELS)


# The 4-bit second moment (of sqrt(v)): code k stands for 2^((k-15)/2); r rounds to the
# nearest in log2, that is 15 + 2 e + [m >= 2^(1/4)] + [m >= 2^(3/4)] for r = m 2^e,
# m in [1, 2), read from the float32 bits (no log, the same on every backend).
_NU4_QUARTER = int(np.float32(2.0 ** 0.25).view(np.uint32)) & 0x7FFFFF
_NU4_THREE_QUARTERS = int(np.float32(2.0 ** 0.75).view(np.uint32)) & 0x7FFFFF


def _encode_4bit_nu(r: jax.Array) -> jax.Array:
  bits = jax.lax.bitcast_convert_type(jnp.maximum(r, 0.0), jnp.uint32)
  e = (bits >> 23).astype(jnp.int32) - 127
  mant = bits & 0x7FFFFF
  k = 15 + 2 * e + (mant >= _NU4_QUARTER).astype(jnp.int32) + (mant >= _NU4_THREE_QUARTERS).astype(jnp.int32)
  return jnp.clip(k, 0, 15).astype(jnp.uint8)


def _decode_4bit_nu(codes: jax.Array) -> jax.Array:
  half = codes.astype(jnp.int32) - 15  # 2 log2 of the value
  power = jax.lax.bitcast_convert_type(((half >> 1) + 127) << 23, jnp.float32)  # 2^floor(half/2)
  return jnp.where((half & 1) == 1, power * SQRT2, power)


# fp8: float8 e4m3fn (4 exponent bits, bias 7; 3 mantissa bits; no infinities), rounded to
# nearest even. Written with integer ops: XLA:CPU's own conversion is four times slower.
def _encode_fp8(y: jax.Array) -> jax.Array:
  """e4m3fn codes of ``y`` in [-448, 448]."""
  a = jnp.abs(y)
  bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
  rounded = bits + 0x7FFFF + ((bits >> 20) & 1)  # to 3 mantissa bits, ties to even
  normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
  subnormal = jnp.round(a * np.float32(512.0)).astype(jnp.uint32)  # multiples of 2^-9 (8: 2^-6)
  code = jnp.where(a < np.float32(2.0 ** -6), subnormal, normal)
  sign = (jax.lax.bitcast_convert_type(y, jnp.uint32) >> 31) << 7
  return (code | sign).astype(jnp.uint8)


def _decode_fp8(codes: jax.Array) -> jax.Array:
  c = codes.astype(jnp.uint32)
  e, m = (c >> 3) & 15, c & 7
  normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
  value = jnp.where(e == 0, m.astype(jnp.float32) * np.float32(2.0 ** -9), normal)
  return jnp.where(c >= 128, -value, value)


# ----------------------------------------------------------------------------- the array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """A quantized moment: ``codes`` and one float32 scale per block; reads back with
  :func:`dequantize` to ``shape``.

  ``codes`` is uint8 (``"8bit"``, ``"fp8"``: one code per byte; ``"4bit"``: two, the
  even element in the low nibble). When the leaf has two axes or more and its last axis is
  a multiple of the block, the codes keep the leaf's shape (the last axis halved for 4-bit) and ``scales`` is
  ``shape[:-1] + (blocks,)``: block ``j`` of a row is its elements ``[j B, (j + 1) B)``,
  so an elementwise step reads the codes in the leaf's own layout (on a TPU, whose arrays
  are tiled over their last two axes, a ``(rows, blocks, block)`` array is a different
  layout and every reshape to the leaf's shape is a copy). A vector whose length is a
  multiple of the block keeps codes ``(blocks, block_size)`` (``block_size // 2`` bytes
  for 4-bit) and scales ``(blocks,)``; any other leaf is flattened and padded to whole
  blocks, laid out the same way. Either way the bytes are the same, in C order;
  :func:`code_blocks` views the codes as one row per scale.
  """

  codes: jax.Array
  scales: jax.Array
  shape: tuple = dataclasses.field(metadata=dict(static=True))
  fmt: Format = dataclasses.field(metadata=dict(static=True))

  @property
  def dtype(self):  # what it reads back as
    return jnp.dtype(jnp.float32)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return int(self.codes.size * self.codes.dtype.itemsize + self.scales.size * 4)


def is_qarray(x: Any) -> bool:
  return isinstance(x, QuantizedArray)


def blocked_shape(shape: tuple, block: int) -> tuple:
  """The ``(lead..., blocks, block)`` view of a leaf of ``shape`` in blocks of ``block``."""
  n = math.prod(shape)
  if shape and shape[-1] % block == 0 and shape[-1] > 0:
    return tuple(shape[:-1]) + (shape[-1] // block, block)
  return (-(-n // block), block)


def leaf_layout(shape: tuple, block: int) -> bool:
  """Whether a moment of ``shape`` keeps its codes in the leaf's shape: a matrix or more
  whose last axis is a multiple of ``block`` (see :class:`QuantizedArray`)."""
  return len(shape) >= 2 and shape[-1] > 0 and shape[-1] % block == 0


def code_width(fmt: Format) -> int:
  """Bytes of codes per block."""
  return (fmt.block_size + 1) // 2 if fmt.packed else fmt.block_size


def code_blocks(q: QuantizedArray) -> jax.Array:
  """``q``'s codes with one row of :func:`code_width` bytes per scale (``scales.shape +
  (width,)``): a reshape of the same bytes."""
  return q.codes.reshape(q.scales.shape + (code_width(q.fmt),))


def flat_blocks(q: QuantizedArray) -> tuple[jax.Array, jax.Array]:
  """``q``'s codes as ``(blocks, width)``, one row per block, and its scales ``(blocks,)``,
  in C order: the contiguous loops' view (a reshape, which on a TPU copies codes kept in
  a matrix's shape)."""
  return code_blocks(q).reshape(q.scales.size, -1), q.scales.reshape(-1)


def from_code_blocks(codes: jax.Array, scales: jax.Array, shape: tuple,
                     fmt: Format) -> QuantizedArray:
  """The :class:`QuantizedArray` of ``shape`` whose codes (one row per block, any leading
  axes) and scales are given, reshaped to the layout ``fmt`` stores ``shape`` in."""
  layout = stored_layout(tuple(shape), fmt)
  return QuantizedArray(codes.reshape(layout.codes.shape), scales.reshape(layout.scales.shape),
                        tuple(shape), fmt)


def _to_blocks(x: jax.Array, block: int) -> jax.Array:
  bshape = blocked_shape(x.shape, block)
  if x.ndim and bshape[:-2] == x.shape[:-1] and bshape[-2] * bshape[-1] == x.shape[-1]:
    return x.reshape(bshape)
  flat = x.reshape(-1)
  pad = bshape[0] * block - flat.shape[0]
  if pad:
    flat = jnp.pad(flat, (0, pad))
  return flat.reshape(bshape)


def _from_blocks(xb: jax.Array, shape: tuple) -> jax.Array:
  n = math.prod(shape)
  if xb.size == n:
    return xb.reshape(shape)
  return xb.reshape(-1)[:n].reshape(shape)


def _encode(r: jax.Array, fmt: Format, u: Callable[[], jax.Array] | None = None) -> jax.Array:
  """Codes (uint8) of ``r = x / scale`` in [-1, 1] (``"mu"``) or [0, 1] (``"nu"``); ``u()``
  gives the dither of a stochastically rounded format (the 4-bit first moment)."""
  if fmt.kind == "8bit":
    # The same codes either way (test_8bit_encode_equals_midpoint_count): a CPU counts the
    # midpoints by two table look-ups, cheaper there than the arithmetic (the XLA loop's
    # 8-bit step of a 4096 x 4096 leaf: see _encode_8bit_by_table); TPUs and GPUs, where
    # a per-element gather is slow, take the arithmetic.
    codes = _platform.on_cpu(lambda: _encode_8bit_by_table(r, fmt.role),
                             lambda: _encode_8bit(r, fmt.role))
    if floors(fmt):  # a non-zero v never reads back as 0 (code 0 of "nu" is the value 0)
      codes = jnp.where((codes == 0) & (r >= NU_FLOOR), jnp.uint8(1), codes)
    return codes
  if fmt.kind == "4bit":
    return _encode_4bit_mu(r, u()) if fmt.role == "mu" else _encode_4bit_nu(r)
  y = jnp.clip(r * np.float32(FP8_MAX), -FP8_MAX, FP8_MAX)
  if fmt.role == "nu":  # never round a positive value to zero
    y = jnp.where(y > 0, jnp.maximum(y, FP8_TINY), y)
  return _encode_fp8(y)


def _decode(codes: jax.Array, fmt: Format) -> jax.Array:
  if fmt.kind == "8bit":
    # The same floats either way (test_8bit_decode_is_the_code_book_bit_for_bit). A CPU reads
    # them from the table: XLA:CPU's gather from 256 floats in cache is cheaper than the
    # arithmetic (the 8-bit chain step of a 4096 x 4096 leaf with the CPU kernel: 26.7
    # against 39.8 ms, 2026-12-02). TPUs and GPUs, where a per-element gather is slow,
    # take the arithmetic.
    return _platform.on_cpu(
        lambda: jnp.asarray(code_book(fmt.kind, fmt.role))[codes.astype(jnp.int32)],
        lambda: _decode_8bit(codes, fmt.role))
  if fmt.kind == "4bit":
    return _decode_4bit_mu(codes) if fmt.role == "mu" else _decode_4bit_nu(codes)
  return _decode_fp8(codes) * np.float32(1 / FP8_MAX)


def _pack4(codes: jax.Array) -> jax.Array:
  if codes.shape[-1] % 2:
    codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
  pairs = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
  return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack4(packed: jax.Array, block: int) -> jax.Array:
  # A broadcast shift, not a stack of two slices: XLA fuses it into its consumer, where a
  # concatenate would be materialized (a byte per parameter of temporaries).
  both = (packed[..., None] >> jnp.array([0, 4], jnp.uint8)) & jnp.uint8(0xF)
  return both.reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))[..., :block]


def stochastic(fmt: Format) -> bool:
  """Whether ``fmt`` rounds stochastically (the 4-bit first moment): its encoder needs the
  step count and each element's position (see :func:`encode_blocks`)."""
  return fmt.kind == "4bit" and fmt.role == "mu"


def encode_blocks(xb: jax.Array, fmt: Format, *, step: Any = None,
                  pos: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """``(codes, scales)`` of float32 blocks ``xb`` (last axis: a block). Non-finite values
  are stored as 0 and left out of the scale, so no block keeps a NaN or Inf scale.

  The 4-bit first moment's stochastic rounding takes its random numbers from :func:`dither`
  of ``step`` (the optimizer's count of the moment stored, an integer scalar; required
  there, ignored by the other formats) and ``pos``: each element's flat position in its
  leaf (uint32, ``xb``'s shape; default: ``xb``'s own C-order flat index, that is, ``xb``
  is a whole leaf cut into blocks)."""
  if stochastic(fmt) and step is None:
    raise ValueError("The 4-bit first moment's stochastic rounding needs the step count "
                     "(`step`, the optimizer state's count).")
  finite = jnp.isfinite(xb)
  xb = jnp.where(finite, xb, 0.0)
  if fmt.role == "nu":
    xb = jnp.maximum(xb, 0.0)
    if fmt.kind != "8bit":
      xb = jnp.sqrt(xb)
  scale = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), SCALE_FLOOR)
  # x * (1 / scale), written out: XLA rewrites a division by a broadcast scale so under
  # jit, and eager, jitted and kernel codes must agree bit for bit.
  u = lambda: dither(positions(xb.shape) if pos is None else pos,  # noqa: E731
                     dither_key(step, fmt.role))
  codes = _encode(xb * (np.float32(1.0) / scale)[..., None], fmt, u)
  if fmt.packed:
    codes = _pack4(codes)
  return codes, scale


def readable_scales(scales: jax.Array) -> jax.Array:
  """``scales`` with each negative, NaN or infinite one (a corrupted state: the encoder
  writes none) read as 0, so that its block reads back as zeros, as a fresh moment does,
  instead of flipping signs or spreading NaN into the params. Elementwise on the scales
  only (one per block)."""
  return jnp.where(readable(scales), scales, 0.0)


def readable(scales: jax.Array) -> jax.Array:
  """Whether each scale is one the encoder writes: finite and >= 0 (see
  :func:`readable_scales`)."""
  return (scales >= 0) & (scales <= np.finfo(np.float32).max)


def decode_blocks(codes: jax.Array, scales: jax.Array, fmt: Format) -> jax.Array:
  """Float32 blocks from ``codes`` and ``scales`` (the inverse of :func:`encode_blocks`)."""
  if fmt.packed:
    codes = _unpack4(codes, fmt.block_size)
  xb = _decode(codes, fmt) * scales[..., None]
  # after the product, not on the scales: XLA then fuses (and contracts) the step as before
  xb = jnp.where(readable(scales)[..., None], xb, 0.0)
  if fmt.role == "nu" and fmt.kind != "8bit":
    xb = xb * xb
  return xb


def quantize(x: jax.Array, fmt: Format, *, step: Any = None,
             pos: jax.Array | None = None) -> QuantizedArray:
  """Stores float ``x`` in ``fmt`` (see :class:`Quantized` for the maths). ``step`` and
  ``pos`` (``x``'s shape; default: ``x`` is a whole leaf, its flat indices) key the 4-bit
  first moment's dither (see :func:`encode_blocks`)."""
  block = fmt.block_size
  if pos is not None:
    pos = _to_blocks(pos.astype(jnp.uint32), block)
  codes, scales = encode_blocks(_to_blocks(x.astype(jnp.float32), block), fmt, step=step,
                                pos=pos)
  return from_code_blocks(codes, scales, tuple(x.shape), fmt)


def dequantize(q: QuantizedArray) -> jax.Array:
  """The float32 values ``q`` stands for, in the leaf's shape. Compiled for a TPU, a leaf
  whose codes keep its shape is decoded in that shape (see :func:`_decode_in_place`)."""
  blocked = lambda: _from_blocks(decode_blocks(code_blocks(q), q.scales, q.fmt), q.shape)  # noqa: E731
  if (not leaf_layout(q.shape, q.fmt.block_size) or q.fmt.packed
      or q.shape[-1] ** 2 // q.fmt.block_size > SPREAD_MAX):
    return blocked()
  return _platform.on_tpu(lambda: _decode_in_place(q), blocked)


# The largest 0/1 matrix (elements) that _decode_in_place spreads scales with: rows of up to
# 16384 elements in blocks of 256 (a 4 MiB constant of the program); longer rows, whose
# matrix grows as the square of the row, are decoded in blocks.
SPREAD_MAX = 1 << 20
# Leaves of at least SELECT_MIN_SIZE elements whose rows are at most SELECT_MAX_BLOCKS blocks
# take their scales by compare and select (one select per block after the first), the
# others by the matmul (see _decode_in_place).
SELECT_MIN_SIZE = 1 << 24
SELECT_MAX_BLOCKS = 16


def _decode_in_place(q: QuantizedArray) -> jax.Array:
  """:func:`decode_blocks` in the leaf's own layout, for a TPU: each code decoded where it
  lies, times its block's scale spread over the block's elements. A broadcast and reshape
  of the scales, as elsewhere, is a relayout on a TPU that XLA materializes for the whole
  leaf (8 bytes per parameter of temporaries for two 8-bit moments of a 4096x4096 leaf on
  a v5e chip). The scales are multiplied by a 0/1 matrix, ``scales @ E``, ``E[j, c] =
  (c // B == j)``, at full float32 precision (exact: one scale times 1.0 plus zeros),
  except in a leaf of :data:`SELECT_MIN_SIZE` elements or more whose rows are at most
  :data:`SELECT_MAX_BLOCKS` blocks: there each element's scale is picked by comparing its
  block number with each block's (a column of the scales broadcast along the row, then
  selects). On a v5e chip XLA keeps the matmul's output whole for such a leaf (a 50257x768
  one: 4 bytes per parameter; a 4096x4096 bf16 one under ``ak.param_rounding``: 4-6) and
  fuses the selects (0); in a tree of smaller leaves the selects moved XLA's schedule so
  that it copied the loops' codes (the 23.1M transformer tree: 1.69 against 0 with the
  matmul; compiled on 2026-12-02). A scale the encoder never writes (negative, NaN,
  infinite) reads as 0 first, as :func:`readable_scales` does, so it cannot spread past
  its block."""
  block, width = q.fmt.block_size, q.shape[-1]
  scales = readable_scales(q.scales)
  if width // block <= SELECT_MAX_BLOCKS and q.size >= SELECT_MIN_SIZE:
    which = jax.lax.broadcasted_iota(jnp.int32, q.shape, q.ndim - 1) // block
    spread = jnp.broadcast_to(scales[..., :1], q.shape)
    for j in range(1, width // block):
      spread = jnp.where(which == j, scales[..., j:j + 1], spread)
  else:
    eye = np.kron(np.eye(width // block, dtype=np.float32), np.ones((1, block), np.float32))
    spread = jnp.matmul(scales, eye, precision=jax.lax.Precision.HIGHEST)
  x = _decode(q.codes, q.fmt) * spread
  if q.fmt.role == "nu" and q.fmt.kind != "8bit":
    x = x * x
  return x


def zeros(shape: tuple, fmt: Format) -> QuantizedArray:
  """The quantized zeros of ``shape`` (every code reads back 0, every scale the floor)."""
  bshape = blocked_shape(tuple(shape), fmt.block_size)
  zero = quantize(jnp.zeros(bshape[-1:], jnp.float32),
                  dataclasses.replace(fmt, block_size=bshape[-1]),
                  step=0)  # zeros: every dither gives the code of 0
  code0 = zero.codes.reshape(-1)[0]
  layout = stored_layout(shape, fmt)
  codes = jnp.full(layout.codes.shape, code0, jnp.uint8)
  scales = jnp.full(layout.scales.shape, SCALE_FLOOR, jnp.float32)
  return QuantizedArray(codes, scales, tuple(shape), fmt)


def stored_layout(shape: tuple, fmt: Format) -> QuantizedArray:
  """The codes and scales ``fmt`` stores a leaf of ``shape`` in, as shapes and dtypes
  (``jax.ShapeDtypeStruct``: what ``jax.eval_shape`` of :func:`zeros` gives, without a
  trace)."""
  bshape = blocked_shape(tuple(shape), fmt.block_size)
  cshape = bshape[:-1] + (code_width(fmt),)
  if leaf_layout(tuple(shape), fmt.block_size):  # the leaf's shape, by whole blocks
    cshape = bshape[:-2] + (bshape[-2] * code_width(fmt),)
  return QuantizedArray(jax.ShapeDtypeStruct(cshape, jnp.uint8),
                        jax.ShapeDtypeStruct(bshape[:-1], jnp.float32), tuple(shape), fmt)


def init_moment(p: Any, fmt: Any, role: str) -> Any:
  """A zero moment for param leaf ``p``: ``p``'s dtype (``fmt=None``), ``fmt`` (a dtype),
  or a :class:`QuantizedArray` (``fmt`` a :class:`Quantized` and ``p.size >= min_size``;
  smaller leaves keep float32)."""
  if fmt is None or not is_quantized(fmt):
    return jnp.zeros_like(p, dtype=fmt)
  if not fmt.quantizes(p.shape, role):
    return jnp.zeros_like(p, dtype=jnp.float32)
  return zeros(tuple(p.shape), resolve(fmt, role))


def load(m: Any) -> jax.Array:
  """A moment leaf as float32 (dequantized), or as stored for a plain array."""
  return dequantize(m) if is_qarray(m) else m


def store(x: jax.Array, like: Any, *, step: Any = None) -> Any:
  """``x`` stored as ``like`` is (quantized in ``like``'s format, ``step`` keying the 4-bit
  dither, see :func:`encode_blocks`; or cast to its dtype)."""
  if is_qarray(like):
    return quantize(x, like.fmt, step=step)
  return x.astype(like.dtype)


# ----------------------------------------------------------------------------- table rows
#
# A table ``(N, *row)`` that takes row-sparse gradients is updated a row at a time, so its
# moments' blocks must never span two rows: then codes and scales both lead with the N
# rows, and the k touched rows are gathered, updated and scattered back with their scales
# while every other row keeps its bits.


def rows_apart(shape: tuple, fmt: Format) -> bool:
  """Whether a moment of ``shape`` stored in ``fmt`` has no block spanning two rows (its
  codes and scales lead with ``shape[0]``): the last axis is a multiple of the block, or
  the block is one whole row."""
  if len(shape) < 2:
    return False
  return (shape[-1] > 0 and shape[-1] % fmt.block_size == 0) or \
      fmt.block_size == math.prod(shape[1:])


def table_format(q: Quantized, role: str, shape: tuple) -> Format:
  """The format of a moment of a table of ``shape`` in a sparse optimizer: ``q``'s block
  when it divides the last axis (blocks within rows, as :func:`quantize` lays them out
  anyway), else one block per row (``prod(shape[1:])`` elements, any count). A 1-D leaf,
  or an empty row, keeps ``q``'s own format."""
  fmt = resolve(q, role)
  row = math.prod(shape[1:])
  if len(shape) >= 2 and row > 0 and not rows_apart(shape, fmt):
    return dataclasses.replace(fmt, block_size=row)
  return fmt


def init_table_moment(p: Any, fmt: Any, role: str) -> Any:
  """:func:`init_moment` with :func:`table_format`'s layout (see there)."""
  if not is_quantized(fmt):
    return init_moment(p, fmt, role)
  shape = tuple(np.shape(p))
  layout = table_format(fmt, role, shape)
  if not fmt.quantizes(shape, role, layout):
    return jnp.zeros_like(p, dtype=jnp.float32)
  return place_like(zeros(shape, layout), p)


def place_like(q: QuantizedArray, p: Any) -> QuantizedArray:
  """``q`` placed where param ``p`` is, as ``jnp.zeros_like(p)`` would be: on its device
  when ``p`` is committed there, or over its mesh, the codes and scales split along the
  param's leading axes (a row-sharded table keeps its rows' codes and scales on the rows'
  device); a split last axis carries over to the blocks' axis when it divides the blocks,
  else the blocks are replicated. Traced or abstract params: ``q`` as it is."""
  sharding = getattr(p, "sharding", None)
  if not isinstance(p, jax.Array) or isinstance(p, jax.core.Tracer) or not p.committed:
    return q
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (len(q.shape) - len(sharding.spec))
    size = lambda axes: math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple)  # noqa: E731
                                                          else (axes,)))
    lead = q.scales.ndim - 1  # the leaf's axes that codes and scales keep
    if q.shape and q.shape[-1] > 0 and q.shape[-1] % q.fmt.block_size == 0:
      blocks = spec[-1] if spec[-1] is not None and q.scales.shape[-1] % size(spec[-1]) == 0 \
          else None
      s_spec = spec[:lead] + (blocks,)
      # codes in the leaf's shape split as the scales; a vector's (blocks, block) by blocks
      c_spec = s_spec if leaf_layout(q.shape, q.fmt.block_size) else s_spec + (None,)
    else:
      # (rows, one block each) or the flattened leaf
      s_spec = spec[:1] if rows_apart(q.shape, q.fmt) else (None,) * q.scales.ndim
      c_spec = s_spec + (None,)
    named = lambda s: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*s),  # noqa: E731
                                                 memory_kind=sharding.memory_kind)
    return QuantizedArray(jax.device_put(q.codes, named(c_spec)),
                          jax.device_put(q.scales, named(s_spec)), q.shape, q.fmt)
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return jax.device_put(q, sharding)
  return q


def row_positions(ids: jax.Array, shape: tuple) -> jax.Array:
  """uint32 flat positions in the table of the rows ``ids`` (global row numbers; shape
  ``(k, *row)``): ``id * prod(row) + the element's flat index in its row``, the positions
  that key the 4-bit dither of a table's rows wherever they are stored (one device, or the
  shard that owns them)."""
  row = tuple(shape[1:])
  in_row = positions(shape, 0, (0,) + tuple(math.prod(row[a + 1:]) for a in range(len(row))))
  first = ids.astype(jnp.uint32) * np.uint32(math.prod(row) % 2 ** 32)
  return in_row + first.reshape((-1,) + (1,) * len(row))


def take_rows(q: QuantizedArray, take) -> QuantizedArray:
  """The rows of a table moment that ``take`` selects: ``take`` (an op on the leading
  axis, a gather) is applied to the codes and the scales alike (see :func:`rows_apart`)."""
  codes, scales = take(q.codes), take(q.scales)
  return QuantizedArray(codes, scales, (codes.shape[0], *q.shape[1:]), q.fmt)


def put_rows(q: QuantizedArray, put, rows: QuantizedArray) -> QuantizedArray:
  """``q`` with ``rows`` (from :func:`take_rows`, then updated) written back by ``put(x,
  new)`` (an op on the leading axis, a scatter) into the codes and the scales alike."""
  return QuantizedArray(put(q.codes, rows.codes), put(q.scales, rows.scales), q.shape, q.fmt)


def rows_in_blocks(shape: tuple, block: int) -> bool:
  """Whether each row of a table of ``shape`` (at least 2-D) is whole blocks of ``block``
  elements: ``prod(shape[1:])`` a multiple of the block. Laid out from a block's start (its
  own array, or a multi-tensor buffer), no block then spans two rows, and row ``r`` is the
  blocks ``r * R/B`` to ``(r + 1) * R/B - 1`` of the table (see :func:`row_blocks`)."""
  row = math.prod(shape[1:])
  return len(shape) >= 2 and row > 0 and row % block == 0


def row_blocks(ids: jax.Array, shape: tuple, block: int, first: int, total: int) -> jax.Array:
  """The block numbers, ``(k, R/B)``, of the rows ``ids`` (safe ids: an id outside the
  table is ``shape[0]``) of a table of ``shape`` whose rows are whole blocks
  (:func:`rows_in_blocks`), stored from block ``first`` of a run of ``total`` blocks:
  ``first + id * R/B + j``. An id outside the table maps to ``total``, past the last
  block, which :func:`take_blocks` reads as zeros and :func:`put_blocks` skips."""
  per_row = math.prod(shape[1:]) // block
  dt = jnp.int32 if total < 2**31 else jnp.int64
  ids = ids.astype(dt)
  blocks = first + ids[:, None] * per_row + jnp.arange(per_row, dtype=dt)
  return jnp.where((ids < shape[0])[:, None], blocks, jnp.asarray(total, dt))


def take_blocks(q: QuantizedArray, blocks: jax.Array, shape: tuple) -> QuantizedArray:
  """The blocks numbered ``blocks`` of ``q`` (its codes and scales read as one run of
  blocks, whatever its shape), as the :class:`QuantizedArray` of ``shape`` they hold
  (whole blocks, C order): a gather of their codes and scales only. A number past the last
  block reads as zeros."""
  at = blocks.reshape(-1)
  codes = code_blocks(q).reshape(-1, code_width(q.fmt)).at[at].get(mode="fill", fill_value=0)
  scales = q.scales.reshape(-1).at[at].get(mode="fill", fill_value=0)
  return from_code_blocks(codes, scales, tuple(shape), q.fmt)


def put_blocks(q: QuantizedArray, blocks: jax.Array, new: QuantizedArray) -> QuantizedArray:
  """``q`` with the codes and scales of ``new`` (from :func:`take_blocks`, then updated)
  written into its blocks numbered ``blocks``, a scatter (in place when ``q`` is donated);
  a number past the last block is skipped."""
  at = blocks.reshape(-1)
  width = code_width(q.fmt)
  codes = q.codes.reshape(-1, width).at[at].set(new.codes.reshape(-1, width), mode="drop")
  scales = q.scales.reshape(-1).at[at].set(new.scales.reshape(-1), mode="drop")
  return QuantizedArray(codes.reshape(q.codes.shape), scales.reshape(q.scales.shape), q.shape,
                        q.fmt)
