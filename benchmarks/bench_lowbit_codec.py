"""Speed of the low-bit codecs alone: jitted quantize + dequantize of 16M float32 elements.

    python benchmarks/bench_lowbit_codec.py            # 16M elements, every format
    python benchmarks/bench_lowbit_codec.py --n 4194304

Rows: each format's ``encode_blocks`` + ``decode_blocks`` (what a chain step adds to a
float32 Adam step per moment); the 8-bit encode and decode by arithmetic (adamkit's) against
the table lookups they replaced (same codes and values: the two-gather bucket tables, the
eight-gather binary search, the code book gather); XLA's own float8 conversion; and a probe
(``x -> uint8(a*x)``, one read and a quarter write). Interleaved medians, as the other
benchmarks.
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import interleave, median_ms, table, write_json

from adamkit import _quant

_BUCKET_BITS = 7
_BUCKET_E0 = 127 - 24  # biased exponent of the first binade with buckets of its own
_BUCKET_LOW = 23 - _BUCKET_BITS


@functools.cache
def bucket_tables(role: str) -> tuple[np.ndarray, np.ndarray, int]:
  """The encoder before the arithmetic one: ``|r|`` cut into buckets (each binade split in
  2^7 by the mantissa's top bits, no bucket holding two midpoints); per bucket the number
  of positive midpoints under it and the first one at or above its lower end; and the code
  of 0."""
  mids = _quant._midpoints("8bit", role)
  pos = mids[mids > 0]
  b = np.arange((127 - _BUCKET_E0 + 1) << _BUCKET_BITS, dtype=np.uint32)
  lo_bits = (((b >> _BUCKET_BITS) + _BUCKET_E0) << 23) | ((b & ((1 << _BUCKET_BITS) - 1)) << _BUCKET_LOW)
  lo = lo_bits.view(np.float32).copy()
  lo[b < (1 << _BUCKET_BITS)] = 0.0
  below = np.searchsorted(pos, lo, side="left")
  first = np.append(pos, np.float32(np.inf)).astype(np.float32)[below]
  return below.astype(np.uint8), first, int(mids.size - pos.size)


def bucket_code(r: jax.Array, role: str) -> jax.Array:
  """The 8-bit nearest code by two lookups in :func:`bucket_tables` (same codes for finite r)."""
  below, first, zero = bucket_tables(role)
  a = jnp.abs(r)
  bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
  e = bits >> 23
  bucket = ((jnp.clip(e, _BUCKET_E0, 127) - _BUCKET_E0) << _BUCKET_BITS) | (
    (bits >> _BUCKET_LOW) & ((1 << _BUCKET_BITS) - 1))
  bucket = jnp.where(e < _BUCKET_E0, 0, bucket).astype(jnp.int32)
  n_below = jnp.asarray(below)[bucket].astype(jnp.int32)
  m = jnp.asarray(first)[bucket]
  n_le = n_below + (a >= m).astype(jnp.int32)
  n_lt = n_below + (a > m).astype(jnp.int32)
  code = jnp.where(jnp.signbit(r), zero - jnp.minimum(n_lt, zero), zero + n_le)
  return code.astype(jnp.uint8)


def binary_search_code(r: jax.Array, role: str) -> jax.Array:
  """The 8-bit nearest code by a branch-free binary search over the 255 midpoints (one
  gather per bit): the encoder before the bucket tables."""
  mid = jnp.asarray(_quant._midpoints("8bit", role))
  bits = int(math.log2(mid.shape[0] + 1))
  code = jnp.where(r >= mid[(1 << (bits - 1)) - 1], 1 << (bits - 1), 0)
  for b in reversed(range(bits - 1)):
    cand = code + (1 << b)
    code = jnp.where(r >= mid[cand - 1], cand, code)
  return code.astype(jnp.uint8)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, default=16 * 2 ** 20)
  parser.add_argument("--reps", type=int, default=9)
  args = parser.parse_args(argv)
  key1, key2 = jax.random.split(jax.random.key(0))
  shape = (args.n // 256, 256)
  x = jax.random.normal(key1, shape) * jnp.exp(2.0 * jax.random.normal(key2, shape))

  def round_trip(fmt):
    @jax.jit
    def f(x):
      y = jnp.abs(x) if fmt.role == "nu" else x
      return _quant.decode_blocks(*_quant.encode_blocks(y, fmt, step=1), fmt)
    return f

  runners, rows = {}, []
  for kind in _quant.KINDS:
    for role in _quant.ROLES:
      fmt = _quant.resolve(_quant.Quantized(kind), role)
      runners[f"{kind} {role}: encode + decode"] = round_trip(fmt)
  for role in _quant.ROLES:
    fmt = _quant.resolve(_quant.Quantized("8bit"), role)
    runners[f"8bit {role}: encode (arithmetic)"] = jax.jit(
      lambda x, fmt=fmt: _quant._encode(x / jnp.max(jnp.abs(x), -1, keepdims=True), fmt))
    runners[f"8bit {role}: encode (bucket tables)"] = jax.jit(
      lambda x, role=role: bucket_code(x / jnp.max(jnp.abs(x), -1, keepdims=True), role))
    codes = (jnp.abs(x) * 1e3).astype(jnp.uint8)
    runners[f"8bit {role}: decode (arithmetic)"] = jax.jit(
      lambda x, fmt=fmt, codes=codes: _quant._decode(codes, fmt) * x)
    runners[f"8bit {role}: decode (code book gather)"] = jax.jit(
      lambda x, role=role, codes=codes: jnp.asarray(_quant.code_book("8bit", role))[codes] * x)
    runners[f"8bit {role}: encode (binary search)"] = jax.jit(
      lambda x, role=role: binary_search_code(x / jnp.max(jnp.abs(x), -1, keepdims=True), role))

    @jax.jit
    def before(x, fmt=fmt):  # the round trip with the binary search
      y = jnp.abs(x) if fmt.role == "nu" else x
      scale = jnp.max(jnp.abs(y), -1, keepdims=True)
      book = jnp.asarray(_quant.code_book("8bit", fmt.role))
      return book[binary_search_code(y / scale, fmt.role)] * scale

    runners[f"8bit {role}: encode + decode (binary search)"] = before
  runners["fp8: encode (integer ops)"] = jax.jit(
    lambda x: _quant._encode_fp8(jnp.clip(x, -448.0, 448.0)))
  runners["fp8: encode (XLA convert)"] = jax.jit(
    lambda x: jax.lax.bitcast_convert_type(jnp.clip(x, -448.0, 448.0).astype(jnp.float8_e4m3fn),
                                           jnp.uint8))
  runners["probe: uint8(a*x)"] = jax.jit(lambda x: (x * 10.0).astype(jnp.uint8))
  def timer(f):
    def run():
      t = time.perf_counter()
      jax.block_until_ready(f(x))
      return time.perf_counter() - t
    return run

  timers = {name: timer(f) for name, f in runners.items()}
  times = interleave(timers, args.reps)
  probe = median_ms(times["probe: uint8(a*x)"])
  for name, samples in times.items():
    rows.append([name, median_ms(samples), median_ms(samples) / probe,
                 1e9 * np.median(samples) / args.n])
  print(table(f"low-bit codecs, {args.n} float32 elements ({jax.devices()[0].platform})",
              ["contender", "median ms", "vs probe", "ns/element"], rows))
  write_json("lowbit_codec", {"n": args.n, "times": times})


if __name__ == "__main__":
  main()
