"""The low-bit storage formats of adamkit._quant: code books, encoders, round trips, layout.

References are independent float64 / NumPy computations: the code book from its defining
formula, the nearest code by brute force over the book, the float8 e4m3 numbers from
``ml_dtypes`` (NumPy's float8 type that JAX itself uses).
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from reference import round_4bit_mu

from adamkit import _quant as Q

KIND_ROLES = [(k, r) for k in Q.KINDS for r in Q.ROLES]


def fmt(kind, role, block=None):
  return Q.resolve(Q.Quantized(kind, block), role)


# ----------------------------------------------------------------------------- code books


@pytest.mark.parametrize("role", Q.ROLES)
def test_8bit_code_book_is_the_dynamic_map(role):
  book = Q.code_book("8bit", role)
  assert book.dtype == np.float32 and book.shape == (256,)
  assert np.all(np.diff(book) > 0)  # sorted, 256 distinct values
  assert book[-1] == 1.0 and 0.0 in book
  # Independent float64 formula: per decade 10^-6 .. 1, the centres of an even split of
  # [0.1, 1] in 2^i (signed) or 2^(i+1) (unsigned) parts, i = 0 .. 6.
  signed = role == "mu"
  pos = [10.0 ** (i - 6) * (0.1 + 0.9 * (j + 0.5) / n)
         for i in range(7) for n in [2 ** i if signed else 2 ** (i + 1)] for j in range(n)]
  want = np.sort(np.concatenate([pos, [0.0, 1.0]] + ([np.negative(pos)] if signed else [])))
  np.testing.assert_allclose(book, want, rtol=3e-7, atol=0)
  if signed:  # 127 negative codes, the mirror images of the positive ones but 1
    assert np.sum(book < 0) == 127 and np.sum(book > 0) == 128
    np.testing.assert_array_equal(-book[:127][::-1], book[128:255])
  else:
    assert book[0] == 0.0


def test_4bit_code_books():
  mu = Q.code_book("4bit", "mu")
  np.testing.assert_allclose(mu, np.arange(-7, 8) / 7.0, rtol=1e-7, atol=0)
  assert mu[7] == 0.0 and mu[-1] == 1.0 and mu[0] == -1.0
  nu = Q.code_book("4bit", "nu")
  assert nu.shape == (16,) and np.all(nu > 0) and nu[-1] == 1.0  # zero-free
  np.testing.assert_allclose(nu, 2.0 ** ((np.arange(16) - 15) / 2.0), rtol=1e-7)
  with pytest.raises(ValueError, match="fp8"):
    Q.code_book("fp8", "mu")


@pytest.mark.parametrize("kind,role", [("8bit", "mu"), ("8bit", "nu"), ("4bit", "mu"), ("4bit", "nu")])
def test_decode_reads_the_code_book(kind, role):
  book = Q.code_book(kind, role)
  codes = jnp.arange(book.size, dtype=jnp.uint8)
  np.testing.assert_array_equal(np.asarray(Q._decode(codes, fmt(kind, role))), book)


def test_fp8_decode_is_e4m3():
  codes = np.arange(256, dtype=np.uint8)
  want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = np.asarray(Q._decode_fp8(jnp.asarray(codes)))
  finite = np.isfinite(want)  # 0x7f and 0xff are NaN, never written
  np.testing.assert_array_equal(got[finite], want[finite])
  assert finite.sum() == 254


# ----------------------------------------------------------------------------- encoders


def codec_points(role):
  """Where the 8-bit encoder can go wrong: every midpoint and its float32 neighbours (3
  ulps each side), every code's value and its neighbours, the midpoints between decades,
  random magnitudes over 12 decades, 0, subnormals, 1 and past it; both signs for the
  signed map. (Every float32 in [-2, 2] was also checked against the bucket tables that
  this encoder replaced, outside the suite: a few minutes.)"""
  mids = Q._midpoints("8bit", role).view(np.int32)
  book = Q.code_book("8bit", role)
  pts = np.concatenate([mids + d for d in range(-3, 4)]).view(np.float32)
  rng = np.random.default_rng(7)
  mag = np.exp(rng.uniform(np.log(1e-12), np.log(2.0), 200000)).astype(np.float32)
  tiny = np.float32([0.0, 1e-45, 1e-40, 2.0 ** -126, 1e-38, 2.0 ** -30, 2.0 ** -24, 1e-8,
                     1.0, np.nextafter(np.float32(1), np.float32(2)), 1.5, 2.0, 1e30, 3e38])
  pts = np.concatenate([pts, book, np.nextafter(book, np.float32(2)),
                        np.nextafter(book, np.float32(-2)), mag, tiny])
  pts = np.abs(pts[np.isfinite(pts)])
  return np.concatenate([pts, -pts]) if role == "mu" else pts


ENCODERS_8BIT = {"arithmetic": Q._encode_8bit, "tables": Q._encode_8bit_by_table}  # TPU/GPU, CPU


@pytest.mark.parametrize("encoder", ENCODERS_8BIT)
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("role", Q.ROLES)
def test_8bit_encode_equals_midpoint_count(role, jit, encoder):
  r = codec_points(role)
  want = np.searchsorted(Q._midpoints("8bit", role), r, side="right")  # midpoints <= r
  enc = ENCODERS_8BIT[encoder]
  enc = jax.jit(enc, static_argnums=1) if jit else enc
  got = np.asarray(enc(jnp.asarray(r), role))
  bad = np.flatnonzero(got != want)
  assert bad.size == 0, (r[bad][:5], got[bad][:5], want[bad][:5])


@pytest.mark.parametrize("role", Q.ROLES)
def test_8bit_encode_equals_midpoint_count_everywhere(role):
  """The code is the number of midpoints <= r: the code book's (exact=True), and with the
  second moment's floor (the default) the kernels' midpoints, whose first is 2^-126."""
  floor = np.float32(2.0**-126)
  r = np.concatenate([codec_points(role), [floor, np.nextafter(floor, np.float32(0)),
                                           np.nextafter(floor, np.float32(1)), 1e-30]])
  r = r.astype(np.float32)
  for exact in (True, False):
    f = Q.resolve(Q.Quantized("8bit", exact=exact), role)
    mids = Q._midpoints("8bit", role).astype(np.float64)
    if role == "nu" and not exact:
      mids[0] = floor  # a positive v / scale from 2^-126 up never gets the code of 0
    np.testing.assert_array_equal(Q.kernel_midpoints(f), mids.astype(np.float32))
    want = np.searchsorted(mids, r.astype(np.float64), side="right")  # midpoints <= r
    got = np.asarray(Q._encode(jnp.asarray(r), f))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (exact, r[bad][:5], got[bad][:5], want[bad][:5])


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("role", Q.ROLES)
def test_8bit_decode_is_the_code_book_bit_for_bit(role, jit):
  """The arithmetic decoder gives the code book's float32 bits for all 256 codes, eager
  and under jit (where XLA may contract a multiply and an add into an FMA)."""
  dec = jax.jit(Q._decode_8bit, static_argnums=1) if jit else Q._decode_8bit
  got = np.asarray(dec(jnp.arange(256, dtype=jnp.uint8), role))
  np.testing.assert_array_equal(got.view(np.uint32), Q.code_book("8bit", role).view(np.uint32))
  codes = np.random.default_rng(3).integers(0, 256, (64, 256)).astype(np.uint8)  # any shape
  np.testing.assert_array_equal(np.asarray(dec(jnp.asarray(codes), role)),
                                Q.code_book("8bit", role)[codes])


@pytest.mark.parametrize("encoder", ENCODERS_8BIT)
@pytest.mark.parametrize("role", Q.ROLES)
def test_8bit_encode_of_non_finite_values(role, encoder):
  """+-inf: the end codes; NaN as +-inf by its sign bit (the bucket tables' rule; a step
  never encodes either: encode_blocks stores non-finite values as 0)."""
  nan = np.uint32([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001]).view(np.float32)
  r = np.concatenate([np.float32([np.inf, -np.inf]), nan])
  got = np.asarray(ENCODERS_8BIT[encoder](jnp.asarray(r), role))
  np.testing.assert_array_equal(got, [255, 0, 255, 255, 255, 0, 0])
  codes, _ = Q.encode_blocks(jnp.float32([[np.inf, np.nan, -np.inf, 0.5]]), fmt("8bit", role))
  zero = np.searchsorted(Q._midpoints("8bit", role), 0.0, side="right")
  assert list(np.asarray(codes)[0, :3]) == [zero] * 3


@pytest.mark.parametrize("role", Q.ROLES)
def test_8bit_encode_is_nearest_ties_up(role):
  """Against a float64 brute force over the book: the code is a nearest value, and of two
  equally near values (up to the float32 rounding of their midpoint) the larger (exact=True:
  the default floors a small second moment, test_quant_floor.py)."""
  rng = np.random.default_rng(0)
  mag = np.exp(rng.uniform(np.log(1e-8), 0.0, 20000))
  r = (mag * (rng.choice([-1, 1], mag.size) if role == "mu" else 1)).astype(np.float32)
  r = np.concatenate([r, Q._midpoints("8bit", role), Q.code_book("8bit", role)])
  book = Q.code_book("8bit", role).astype(np.float64)
  exact = Q.resolve(Q.Quantized("8bit", exact=True), role)
  got = np.asarray(Q._encode(jnp.asarray(r), exact)).astype(np.int64)
  dist = np.abs(r.astype(np.float64)[:, None] - book[None, :])
  best = dist.min(axis=1)
  # The midpoint is rounded to float32 (by up to half an ulp, 2^-24 |r|), which moves the
  # distances to its two sides apart by twice that.
  slack = 2.0 ** -22 * np.abs(r)
  assert np.all(dist[np.arange(r.size), got] <= best + slack)
  tie = np.sum(dist <= best[:, None] + slack[:, None], axis=1) > 1
  nearest_up = (dist.shape[1] - 1) - np.argmin(dist[:, ::-1], axis=1)
  np.testing.assert_array_equal(got[~tie], nearest_up[~tie])
  exact_mid = np.isin(r, Q._midpoints("8bit", role))  # a float32 midpoint rounds up
  assert np.all(got[exact_mid] == np.searchsorted(book, r[exact_mid].astype(np.float64)))


def test_4bit_nu_encode_is_nearest_in_log2():
  rng = np.random.default_rng(1)
  r = np.exp(rng.uniform(np.log(2.0 ** -20), 0.0, 50000)).astype(np.float32)
  want = np.clip(np.floor(15 + 2 * np.log2(r.astype(np.float64)) + 0.5), 0, 15)
  got = np.asarray(Q._encode(jnp.asarray(r), fmt("4bit", "nu")))
  np.testing.assert_array_equal(got, want)
  assert np.all(np.asarray(Q._encode(jnp.float32([0.0, 1e-30, 1.0]), fmt("4bit", "nu"))) == [0, 0, 15])


def _codes_4bit_mu(x, step, pos=None, block=128):
  """adamkit's 4-bit first-moment codes (unpacked, -7 .. 7) of blocks ``x`` at ``step``."""
  f = fmt("4bit", "mu", block)
  codes, _ = Q.encode_blocks(jnp.asarray(x), f, step=step, pos=pos)
  codes = np.asarray(codes).astype(int)
  return np.stack([codes & 15, codes >> 4], -1).reshape(x.shape) - 7


def test_4bit_mu_codes_are_the_dither_reference():
  """Every code is the reference's (tests/reference.py, from the documented definition):
  the dither of each element's flat position and the step count, eager and under jit; a
  pure function of integers, so positions given explicitly give the same codes."""
  rng = np.random.default_rng(2)
  x = rng.uniform(-1, 1, (64, 4, 128)).astype(np.float32)
  x[:, :, 0] = 1.0  # every block's scale is 1: r is x itself
  pos = np.arange(x.size).reshape(x.shape)
  for step in (1, 2, 7, 2**31 - 1):
    want = round_4bit_mu(x, pos, step)
    got = _codes_4bit_mu(x, step)
    np.testing.assert_array_equal(got, want)
    jitted = jax.jit(lambda x, t: Q.encode_blocks(x, fmt("4bit", "mu"), step=t))(
        jnp.asarray(x), jnp.int32(step))[0]
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(
        Q.encode_blocks(jnp.asarray(x), fmt("4bit", "mu"), step=step)[0]))
  # the positions are an argument: other positions, other numbers; the same ones, the same
  np.testing.assert_array_equal(_codes_4bit_mu(x, 3, jnp.asarray(pos, jnp.uint32)),
                                _codes_4bit_mu(x, 3))
  shifted = _codes_4bit_mu(x, 3, jnp.asarray(pos + 5, jnp.uint32))
  np.testing.assert_array_equal(shifted, round_4bit_mu(x, pos + 5, 3))
  # levels themselves stay put whatever the dither
  grid = np.tile(np.arange(-7, 8, dtype=np.float32) / np.float32(7), (3, 1))
  for step in (1, 9):
    np.testing.assert_array_equal(_codes_4bit_mu(np.pad(grid, ((0, 0), (0, 1))), step, block=16)[:, :15],
                                  np.tile(np.arange(-7, 8), (3, 1)))


def test_4bit_mu_rounding_is_unbiased():
  """One value a third of the way between two levels, rounded at 2^16 positions (one
  step) and at one position over 4096 steps: the mean is the value within 4 standard
  errors, and a third of the roundings go up."""
  x = np.float32(2 / 7) + np.float32(1 / 21)
  block = np.full((1 << 9, 128), x, np.float32)
  block[:, 0] = 1.0  # the scale
  levels = _codes_4bit_mu(block, 3)[:, 1:] / 7
  se = (1 / 7) * np.sqrt(1 / 3 * 2 / 3) / np.sqrt(levels.size)
  assert abs(levels.mean() - x) < 4 * se, (levels.mean() - x, se)
  assert 0.3 < np.mean(levels > x) < 0.37
  # one element over the steps (vmapped over the step count)
  f = fmt("4bit", "mu", 2)
  pair = jnp.asarray([[1.0, x]], jnp.float32)
  codes = jax.vmap(lambda t: Q.encode_blocks(pair, f, step=t)[0])(jnp.arange(1, 4097))
  over_steps = ((np.asarray(codes).reshape(-1) >> 4).astype(int) - 7) / 7
  se = (1 / 7) * np.sqrt(1 / 3 * 2 / 3) / np.sqrt(over_steps.size)
  assert abs(over_steps.mean() - x) < 4 * se, (over_steps.mean() - x, se)


def test_4bit_mu_rounding_changes_with_the_step():
  """Fresh numbers every step: the same values at the next step round otherwise for
  about 2 p (1 - p) of the elements (p = 1/3 here: 4/9), never by more than one level."""
  x = np.full((64, 128), np.float32(2 / 7) + np.float32(1 / 21), np.float32)
  x[:, 0] = 1.0
  a, b = _codes_4bit_mu(x, 1)[:, 1:], _codes_4bit_mu(x, 2)[:, 1:]
  assert 0.38 < np.mean(a != b) < 0.51
  assert np.abs(a - b).max() == 1
  with pytest.raises(ValueError, match="step"):
    Q.quantize(jnp.asarray(x), fmt("4bit", "mu"))


def test_fp8_encode_is_e4m3_round_to_nearest_even():
  rng = np.random.default_rng(3)
  y = rng.uniform(-448, 448, 100000).astype(np.float32)
  y = np.concatenate([y, y * 1e-3, y * 1e-5, np.float32([0.0, -0.0, 448.0, -448.0, 2.0 ** -10])])
  want = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  np.testing.assert_array_equal(np.asarray(Q._encode_fp8(jnp.asarray(y))), want)


# ----------------------------------------------------------------------------- round trips


def blocky(rng, shape, signed):
  """Moments spanning decades within a block, as Adam's do."""
  x = np.exp(rng.uniform(-12, 0, shape)) * (rng.choice([-1, 1], shape) if signed else 1)
  return x.astype(np.float32)


@pytest.mark.parametrize("kind,role", KIND_ROLES)
def test_round_trip_error(kind, role):
  rng = np.random.default_rng(4)
  f = fmt(kind, role)
  x = blocky(rng, (8, 1024), role == "mu")
  q = Q.quantize(jnp.asarray(x), f, step=1)
  back = np.asarray(Q.dequantize(q))
  assert back.shape == x.shape and back.dtype == np.float32
  s = np.abs(x).reshape(8, -1, f.block_size).max(-1).repeat(f.block_size, -1).reshape(x.shape)
  err = np.abs(back - x)
  r = np.abs(x) / s
  if kind == "8bit":
    book = Q.code_book(kind, role)
    k = np.clip(np.searchsorted(book, x / s), 1, 255)
    assert np.all(err <= (book[k] - book[k - 1]) * s * (0.5 + 1e-5))  # nearest: half the gap
    top = r > 0.1  # the top decade: 64 (signed) or 128 codes over [0.1, 1]
    assert np.all(err[top] <= s[top] * 0.9 / (64 if role == "mu" else 128) * (0.5 + 1e-5))
  elif kind == "4bit" and role == "mu":
    assert np.all(err <= s / 7 * (1 + 1e-5))
  elif kind == "4bit":  # sqrt(v) within a quarter power of two, small v rounded up
    sq = np.sqrt(r)
    ok = sq >= 2.0 ** -7.5
    ratio = np.sqrt(back[ok] / x[ok])
    assert np.all((ratio <= 2 ** 0.25 * (1 + 1e-5)) & (ratio >= 2 ** -0.25 * (1 - 1e-5)))
    assert np.all(back[~ok] >= x[~ok]) and np.all(back > 0)
  else:  # fp8: 3 mantissa bits in the normal range
    normal = r * 448 >= 2.0 ** -6 if role == "mu" else np.sqrt(r) * 448 >= 2.0 ** -6
    rel = err[normal] / np.abs(x[normal])
    assert np.all(rel <= (2 ** -4 if role == "mu" else 2 * 2 ** -4 + 2 ** -8) * (1 + 1e-5))
    if role == "nu":
      assert np.all(back[x > 0] > 0)  # a positive v never reads back zero


@pytest.mark.parametrize("kind,role", KIND_ROLES)
def test_block_maximum_reads_back_exactly(kind, role):
  x = np.zeros((4, 256), np.float32)
  x[:, 3] = np.float32([0.5, 2.0, 1e-3, 7.0])
  x[:, 100] = np.float32([-0.1, 0.3, 1e-5, 1.0]) if role == "mu" else np.float32([0.1, 0.3, 1e-5, 1.0])
  back = np.asarray(Q.dequantize(Q.quantize(jnp.asarray(x), fmt(kind, role, 256), step=1)))
  np.testing.assert_allclose(back[:, 3], x[:, 3], rtol=2e-7)


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("kind,role", KIND_ROLES)
@pytest.mark.parametrize("shape", [(5000,), (3, 1000), (7, 3, 33)])
def test_padding_of_a_leaf_that_is_not_whole_blocks(kind, role, shape):
  f = fmt(kind, role, 64)
  x = blocky(np.random.default_rng(5), shape, role == "mu")
  q = Q.quantize(jnp.asarray(x), f, step=1)
  n = int(np.prod(shape))
  blocks = -(-n // 64)
  assert q.scales.shape == (blocks,)
  assert q.codes.shape == (blocks, 32 if kind == "4bit" else 64) and q.codes.dtype == jnp.uint8
  back = np.asarray(Q.dequantize(q))
  assert back.shape == shape
  # Each block's scale is the maximum of its own elements: the padding adds none.
  padded = np.concatenate([np.abs(x).reshape(-1), np.zeros(blocks * 64 - n, np.float32)])
  if kind != "8bit" and role == "nu":
    padded = np.sqrt(padded)
  np.testing.assert_array_equal(np.asarray(q.scales), np.maximum(padded.reshape(blocks, 64).max(1), 1e-12))
  assert q.nbytes == q.codes.size + 4 * blocks


@pytest.mark.parametrize("kind", Q.KINDS)
def test_whole_blocks_keep_the_leading_axes(kind):
  f = fmt(kind, "mu", 128)
  q = Q.quantize(jnp.ones((6, 4, 512)), f, step=1)
  assert q.scales.shape == (6, 4, 4)
  assert q.codes.shape == (6, 4, 256 if kind == "4bit" else 512)  # the leaf's shape
  assert Q.code_blocks(q).shape == (6, 4, 4, 64 if kind == "4bit" else 128)
  np.testing.assert_array_equal(np.asarray(Q.dequantize(q)), np.ones((6, 4, 512), np.float32))


def test_4bit_packing_low_nibble_first():
  f = fmt("4bit", "mu", 4)
  x = jnp.float32([[-1.0, 0.0, 1.0, 3 / 7]])
  q = Q.quantize(x, f, step=1)
  assert q.codes.tolist() == [[0 | (7 << 4), 14 | (10 << 4)]]


@pytest.mark.parametrize("kind,role", KIND_ROLES)
def test_stored_layout_is_what_quantize_stores(kind, role):
  """The layout the state checks compare against, computed without a trace, is the one
  quantize and zeros store: whole blocks, padded ones, 1-D, odd sizes, packed nibbles."""
  for shape, block in [((6, 4, 512), 128), ((7, 5), 64), ((300,), 64), ((1,), 8),
                       ((3, 3, 8, 16), 32), ((4096, 4000), 256)]:
    f = fmt(kind, role, block)
    want = Q.stored_layout(shape, f)
    for got in (jax.eval_shape(lambda s=shape, f=f: Q.quantize(jnp.zeros(s), f, step=1)),
                jax.eval_shape(lambda s=shape, f=f: Q.zeros(s, f))):
      assert (got.codes.shape, got.codes.dtype, got.scales.shape, got.scales.dtype) == (
          want.codes.shape, want.codes.dtype, want.scales.shape, want.scales.dtype), shape


@pytest.mark.parametrize("kind,role", KIND_ROLES)
def test_zeros_read_back_zero(kind, role):
  z = Q.zeros((3, 256), fmt(kind, role))
  back = np.asarray(Q.dequantize(z))
  assert np.all(back >= 0) and np.all(back <= 1e-24)
  if role == "mu" or kind == "8bit":
    assert np.all(back == 0)
  # quantizing zeros gives the same stored state
  q = Q.quantize(jnp.zeros((3, 256)), fmt(kind, role), step=1)
  np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(z.codes))
  np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(z.scales))


@pytest.mark.parametrize("kind,role", KIND_ROLES)
def test_nonfinite_values_are_stored_as_zero(kind, role):
  x = np.abs(blocky(np.random.default_rng(6), (2, 256), role == "mu")) * (1 if role == "nu" else -1)
  x[0, 5], x[0, 6], x[1, 7] = np.nan, np.inf, -np.inf
  q = Q.quantize(jnp.asarray(x), fmt(kind, role, 256), step=1)
  assert np.all(np.isfinite(np.asarray(q.scales)))
  back = np.asarray(Q.dequantize(q))
  assert np.all(np.isfinite(back))
  # stored as 0: reads back 0 (the 4-bit v: its smallest code, 2^-15 of the block's maximum)
  bound = 0.0
  if (kind, role) == ("4bit", "nu"):
    bound = 2.0 ** -15 * np.asarray(q.scales).reshape(-1)[[0, 0, 1]] ** 2 * (1 + 1e-6)
  assert np.all(np.abs(back[[0, 0, 1], [5, 6, 7]]) <= bound)
  finite = np.isfinite(x)
  want = np.maximum(np.abs(np.where(finite, x, 0)).max(1), 1e-12)
  if kind != "8bit" and role == "nu":
    want = np.sqrt(want)
  np.testing.assert_allclose(np.asarray(q.scales).reshape(-1), want, rtol=1e-7)


@pytest.mark.parametrize("kind,role", KIND_ROLES)
def test_jit_equals_eager(kind, role):
  f = fmt(kind, role)
  x = jnp.asarray(blocky(np.random.default_rng(7), (4, 512), role == "mu"))
  eager = Q.quantize(x, f, step=1)
  jitted = jax.jit(Q.quantize, static_argnums=1)(x, f, step=jnp.int32(1))
  np.testing.assert_array_equal(np.asarray(eager.codes), np.asarray(jitted.codes))
  np.testing.assert_array_equal(np.asarray(eager.scales), np.asarray(jitted.scales))


# ----------------------------------------------------------------------------- the spec


@pytest.mark.parametrize("kwargs,match", [
  (dict(kind="int8"), "kind"),
  (dict(kind=8), "kind"),
  (dict(kind="8bit", block_size=0), "block_size"),
  (dict(kind="8bit", block_size=-256), "block_size"),
  (dict(kind="8bit", block_size=96), "block_size"),
  (dict(kind="8bit", block_size=256.0), "block_size"),
  (dict(kind="8bit", block_size=True), "block_size"),
  (dict(kind="4bit", block_size=1), "block_size"),
  (dict(kind="8bit", min_size=-1), "min_size"),
  (dict(kind="8bit", min_size=1.5), "min_size"),
])
def test_quantized_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Q.Quantized(**kwargs)


def test_quantized_defaults_and_as_format():
  assert Q.as_format("mu_dtype", "4bit") == Q.Quantized("4bit")
  assert Q.resolve(Q.Quantized("8bit"), "nu").block_size == 256
  assert Q.resolve(Q.Quantized("8bit", 64), "mu").block_size == 64
  assert Q.resolve(Q.Quantized("fp8", 1), "mu").block_size == 1
  with pytest.raises(TypeError, match="mu_dtype"):
    Q.as_format("mu_dtype", "int4")


def test_init_moment_min_size():
  small, big = jnp.ones((4095,)), jnp.ones((4096,))
  assert Q.init_moment(small, Q.Quantized("8bit"), "mu").dtype == jnp.float32
  assert isinstance(Q.init_moment(big, Q.Quantized("8bit"), "mu"), Q.QuantizedArray)
  assert isinstance(Q.init_moment(small, Q.Quantized("8bit", min_size=0), "mu"), Q.QuantizedArray)


@pytest.mark.parametrize("block", [128, 16])
@pytest.mark.parametrize("kind,role", [(k, r) for k, r in KIND_ROLES if k != "4bit"])
def test_decode_in_place_equals_the_blocked_decode(monkeypatch, kind, role, block):
  """The TPU's decode (codes in the leaf's shape, each block's scale spread by selects,
  rows of 4 blocks, or by a 0/1 matmul, rows of 32) reads back what the blocked decode
  reads, bit for bit, a corrupted scale's block as zeros (it must not spread a NaN over
  the row). Run here on the CPU, the same float32 maths."""
  monkeypatch.setattr(Q, "SELECT_MIN_SIZE", 0)  # the selects for this small leaf too
  assert (512 // block <= Q.SELECT_MAX_BLOCKS) == (block == 128)
  f = fmt(kind, role, block)
  x = jax.random.normal(jax.random.key(3), (6, 512)) * jnp.logspace(-6, 2, 512)
  q = Q.quantize(jnp.abs(x) if role == "nu" else x, f, step=1)
  q = dataclasses.replace(q, scales=q.scales.at[1, 2].set(jnp.nan).at[4, 0].set(-1.0)
                          .at[5, 3].set(jnp.inf))
  blocked = Q._from_blocks(Q.decode_blocks(Q.code_blocks(q), q.scales, q.fmt), q.shape)
  got = jax.jit(Q._decode_in_place)(q)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(blocked))
  assert np.all(np.asarray(got)[1, 2 * block:3 * block] == 0) and np.isfinite(np.asarray(got)).all()
