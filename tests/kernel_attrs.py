"""Malformed and boundary calls of every C++ handler, as data (issue 32, "Memory safety").

Each :class:`Call` is one direct ``jax.ffi.ffi_call`` of a registered target, past every
Python check: attributes at INT64_MAX, INT64_MIN, negative, one past a buffer's end, sums
that wrap int64 (``offset + n`` for ``offset`` near INT64_MAX), products that overflow it
(a zero-sized buffer whose other dimensions multiply past 2^63), block sizes and row
counts out of range. A malformed call must fail with an error whose message contains
``error`` (it names the attribute and its accepted range); a valid call at the edge of a
range (``error`` None) must succeed and leave every element outside the range it was
given as it was (``kept``: result index, slice). tests/test_kernel_attrs.py runs them on
the release build, tests/test_sanitizer.py under AddressSanitizer and UBSan.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

INT64_MAX, INT64_MIN = np.iinfo(np.int64).max, np.iinfo(np.int64).min
I64 = np.int64


class Call(NamedTuple):
  name: str  # what the case is
  target: str  # the XLA custom-call target
  operands: tuple  # NumPy arrays, in the handler's order
  outs: tuple  # (shape, dtype) of each result
  attrs: dict  # the call's attributes (np.int64, bool, or np.int64 arrays for spans)
  error: str | None  # a fragment of the expected error message; None: a valid call
  kept: tuple = ()  # valid calls: (result index, slice of it equal to the same operand)


def _f32(*shape):
  return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * np.float32(0.01)


def _scalars():
  return np.array([0.9, 0.1, 0.999, 0.001, 1e-8, 0.01, 0.0, 1.0, 1.0], np.float32)


def _outs(*arrays):
  return tuple((a.shape, a.dtype) for a in arrays)


ADAM = dict(kind=I64(1), nesterov=False, decay=I64(0), amsgrad=False, state=I64(2))
BAD_VARIANTS = [  # (attributes, message fragment): every handler checks them first
    (dict(kind=I64(7)), "attribute kind = 7"), (dict(kind=I64(-1)), "attribute kind = -1"),
    (dict(kind=I64(INT64_MAX)), f"attribute kind = {INT64_MAX}"),
    (dict(decay=I64(3)), "attribute decay = 3"),
    (dict(decay=I64(INT64_MIN)), f"attribute decay = {INT64_MIN}"),
    (dict(state=I64(3)), "attribute state = 3 must be 2"),
    (dict(state=I64(INT64_MAX)), f"attribute state = {INT64_MAX} must be 2"),
    (dict(amsgrad=True), "attribute state = 2 must be 3"),
    (dict(kind=I64(2), nesterov=True), "must be false for kind 2"),
]
OFFSETS = [  # (offset, message fragment) for a leaf of 8 elements in state buffers of 16
    (INT64_MAX, f"attribute offset = {INT64_MAX} must be in [0, 16]"),
    (INT64_MAX - 4, f"attribute offset = {INT64_MAX - 4} must be in [0, 16]"),  # + 8 wraps
    (2**62, f"attribute offset = {2**62} must be in [0, 16]"),
    (INT64_MIN, f"attribute offset = {INT64_MIN} must be >= 0"),
    (-1, "attribute offset = -1 must be >= 0"),
    (17, "attribute offset = 17 must be in [0, 16]"),
    (16, "smaller than its params from attribute offset = 16"),
    (9, "smaller than its params from attribute offset = 9"),
]


def step_calls() -> list[Call]:
  """adamkit_cpu_step: one leaf (or two) of 8 elements in state buffers of 16."""
  s, p, g, m, v = _scalars(), _f32(8), _f32(8), _f32(16), _f32(16) + 1
  ops = (s, p, g, m, v)
  calls = [Call(f"offset {off}", "adamkit_cpu_step", ops, _outs(p, m, v),
                dict(ADAM, offset=I64(off)), err) for off, err in OFFSETS]
  calls += [Call(f"variant {a}", "adamkit_cpu_step", ops, _outs(p, m, v),
                 dict(ADAM, offset=I64(0), **a), err) for a, err in BAD_VARIANTS]
  p2 = _f32(2, 4)  # a second leaf: 8 + 8 elements from offset 1 pass the end
  calls.append(Call("two leaves from offset 1", "adamkit_cpu_step", (s, p, p2, g, p2, m, v),
                    _outs(p, p2, m, v), dict(ADAM, offset=I64(1)),
                    "smaller than its params from attribute offset = 1"))
  calls.append(Call("offset 8, the last fit", "adamkit_cpu_step", ops, _outs(p, m, v),
                    dict(ADAM, offset=I64(8)), None, ((1, slice(0, 8)), (2, slice(0, 8)))))
  calls.append(Call("two leaves, the whole buffers", "adamkit_cpu_step", (s, p, p2, g, p2, m, v),
                    _outs(p, p2, m, v), dict(ADAM, offset=I64(0)), None))
  return calls


def rounded_calls() -> list[Call]:
  """adamkit_cpu_step_rounded: a bf16 leaf of 8 elements (Kahan, stochastic, nearest)."""
  import ml_dtypes  # noqa: PLC0415 - jax's own dependency

  bf = lambda *shape: _f32(*shape).astype(ml_dtypes.bfloat16)  # noqa: E731
  s, p, m, v = _scalars(), bf(8), _f32(16), _f32(16) + 1
  nearest = dict(ADAM, rounding=I64(0), grads_f32=False)
  ops = (s, p, p, m, v)
  calls = [Call(f"offset {off}", "adamkit_cpu_step_rounded", ops, _outs(p, m, v),
                dict(nearest, offset=I64(off)), err)
           for off, err in OFFSETS]
  calls += [Call(f"variant {a}", "adamkit_cpu_step_rounded", ops, _outs(p, m, v),
                 dict(nearest, offset=I64(0), **a), err) for a, err in BAD_VARIANTS]
  for r in (3, -1, INT64_MAX, INT64_MIN):
    calls.append(Call(f"rounding {r}", "adamkit_cpu_step_rounded", ops, _outs(p, m, v),
                      dict(nearest, offset=I64(0), rounding=I64(r)), f"attribute rounding = {r}"))
  keys = np.arange(2, dtype=np.uint32)
  calls.append(Call("stochastic, offset INT64_MAX", "adamkit_cpu_step_rounded",
                    (s, p, p, m, v, keys), _outs(p, m, v),
                    dict(nearest, offset=I64(INT64_MAX), rounding=I64(1)), "attribute offset"))
  calls.append(Call("kahan, offset 9", "adamkit_cpu_step_rounded", (s, p, p, m, v, p),
                    _outs(p, m, v, p), dict(nearest, offset=I64(9), rounding=I64(2)),
                    "from attribute offset = 9"))
  empty = np.zeros((0, 2**33), ml_dtypes.bfloat16)  # counters past 32 bits
  calls.append(Call("empty param of 2^33 per row", "adamkit_cpu_step_rounded",
                    (s, empty, empty, m, v), _outs(empty, m, v), dict(nearest, offset=I64(0)),
                    "counters must fit 32 bits"))
  calls.append(Call("offset 8, the last fit", "adamkit_cpu_step_rounded", (s, p, p, m, v, keys),
                    _outs(p, m, v), dict(nearest, offset=I64(8), rounding=I64(1)), None,
                    ((1, slice(0, 8)), (2, slice(0, 8)))))
  return calls


def sparse_calls() -> list[Call]:
  """adamkit_cpu_sparse_lazy: a table of 10 rows of 4 (state buffers of 48), ids 1, 3."""
  s, ids, rows = _scalars(), np.array([1, 3], np.int32), _f32(2, 4)
  m, v, table = _f32(48), _f32(48) + 1, _f32(10, 4)
  lazy = dict(ADAM, apply=True, merge=True)
  ops = (s, ids, rows, m, v, table)
  outs = _outs(m, v, table)
  cases = [
      (dict(num_rows=I64(INT64_MAX), offset=I64(0)), f"attribute num_rows = {INT64_MAX}"),
      (dict(num_rows=I64(2**31), offset=I64(0)), "attribute num_rows = 2147483648"),
      (dict(num_rows=I64(-1), offset=I64(0)), "attribute num_rows = -1"),
      (dict(num_rows=I64(INT64_MIN), offset=I64(0)), f"attribute num_rows = {INT64_MIN}"),
      (dict(num_rows=I64(10), offset=I64(INT64_MAX)), f"from attribute offset = {INT64_MAX}"),
      (dict(num_rows=I64(10), offset=I64(INT64_MAX - 20)), "from attribute offset"),  # wraps
      (dict(num_rows=I64(10), offset=I64(-8)), "attribute offset = -8 must be >= 0"),
      (dict(num_rows=I64(10), offset=I64(INT64_MIN)), "must be >= 0"),
      (dict(num_rows=I64(10), offset=I64(9)), "from attribute offset = 9"),
      (dict(num_rows=I64(12), offset=I64(0)), "attribute num_rows = 12 rows"),
      (dict(num_rows=I64(2**31 - 1), offset=I64(0)), "attribute num_rows = 2147483647 rows"),
      (dict(num_rows=I64(10), offset=I64(0), decay=I64(1)), "attribute decay = 1"),
  ]
  calls = [Call(f"sparse {a}", "adamkit_cpu_sparse_lazy", ops, outs, dict(lazy, **a), err)
           for a, err in cases]
  calls += [Call(f"variant {a}", "adamkit_cpu_sparse_lazy", ops, outs,
                 dict(lazy, num_rows=I64(10), offset=I64(0), **a), err)
            for a, err in BAD_VARIANTS if "decay" not in a]
  wide = np.zeros((0, 2**33), np.float32)  # k = 0 rows of 2^33: num_rows x width overflows
  calls.append(Call("rows of 2^33 elements", "adamkit_cpu_sparse_lazy",
                    (s, np.zeros(0, np.int32), wide, m, v), _outs(m, v, np.zeros(0, np.int32), wide),
                    dict(lazy, apply=False, num_rows=I64(2**31 - 1), offset=I64(0)),
                    "overflow int64"))
  calls.append(Call("offset 8, the last fit", "adamkit_cpu_sparse_lazy", ops, outs,
                    dict(lazy, num_rows=I64(10), offset=I64(8)), None,
                    tuple((j, where) for j in (0, 1)  # rows 1 and 3: [12, 16), [20, 24)
                          for where in (slice(0, 12), slice(16, 20), slice(24, 48)))))
  return calls


def row_add_calls() -> list[Call]:
  """adamkit_cpu_row_add (no attributes): rows of another width, and ids at the ends of
  int32 (skipped: only row 3 changes)."""
  table, ids = _f32(10, 4), np.array([-1, 2**31 - 1, 3, -2**31, 10], np.int32)
  return [Call("rows of another width", "adamkit_cpu_row_add", (ids, _f32(5, 3), table),
               _outs(table), {}, "rows do not match the table's rows"),
          Call("ids outside the table", "adamkit_cpu_row_add", (ids, _f32(5, 4), table),
               _outs(table), {}, None, ((0, slice(0, 12)), (0, slice(16, 40))))]


def sparse_quantized_calls() -> list[Call]:
  """adamkit_cpu_sparse_lazy_quantized: a table of 10 rows of 8 (one block of 8 a row),
  ids 1 and 3, and ids outside the table (skipped)."""
  s, ids, rows, q = _scalars(), np.array([1, 3], np.int32), _f32(2, 8), _codes(10)
  base = dict(kind=I64(1), nesterov=False, amsgrad=False, state=I64(2), merge=True,
              num_rows=I64(10), block=I64(8))
  ops = (s, ids, rows, *q, *q)
  outs = _outs(q[0], q[1], q[0], q[1], ids, rows)
  cases = [(dict(num_rows=I64(n)), f"attribute num_rows = {n} must be in [0, 2^31 - 1]")
           for n in (INT64_MAX, 2**31, -1, INT64_MIN)]
  cases += [(dict(num_rows=I64(n)), "scales must be one per block") for n in (12, 2**31 - 1, 9)]
  cases += [(dict(block=I64(b)), f"attribute block = {b} must be a power of two")
            for b in (0, -8, 3, 2**21, INT64_MAX, INT64_MIN)]
  cases.append((dict(block=I64(16)), "a row of 8 elements must be whole blocks of attribute "
                "block = 16"))
  cases += [(a, err) for a, err in BAD_VARIANTS if "decay" not in a]
  calls = [Call(f"sparse quantized {a}", "adamkit_cpu_sparse_lazy_quantized", ops, outs,
                dict(base, **a), err) for a, err in cases]
  wide = np.zeros((0, 2**33), np.float32)  # k = 0 rows of 2^33 elements
  calls.append(Call("rows of 2^33 elements", "adamkit_cpu_sparse_lazy_quantized",
                    (s, np.zeros(0, np.int32), wide, *q, *q),
                    _outs(q[0], q[1], q[0], q[1], np.zeros(0, np.int32), wide), base,
                    "a row of 8589934592 elements must be whole blocks"))
  far = np.array([-1, 1, 2**31 - 1, 3, -2**31, 10], np.int32)
  calls.append(Call("ids outside the table", "adamkit_cpu_sparse_lazy_quantized",
                    (s, far, _f32(6, 8), *q, *q), _outs(q[0], q[1], q[0], q[1], far, _f32(6, 8)),
                    base, None, tuple((j, where) for j in (0, 2) for where in (
                        slice(0, 8), slice(16, 24), slice(32, 80))) + tuple(
                        (j, where) for j in (1, 3)
                        for where in (slice(0, 1), slice(2, 3), slice(4, 10)))))
  return calls


def _codes(blocks, block=8):
  book = np.linspace(-1, 1, 256).astype(np.float32)
  mid = ((book[:-1] + book[1:]) / 2).astype(np.float32)
  return [np.zeros((blocks, block), np.uint8), np.ones(blocks, np.float32), book, mid]


def quantized_calls() -> list[Call]:
  """adamkit_cpu_step_quantized: a leaf of 16 elements (2 blocks of 8) in moments of 4
  blocks (8-bit) or 32 elements (float32)."""
  s, p = _scalars(), _f32(16)
  q = _codes(4)
  base = dict(ADAM, quantized=np.array([1, 1], I64), offsets=np.array([0, 0], I64), block=I64(8))
  ops = (s, p, p, *q, *q)
  outs = _outs(p, q[0], q[1], q[0], q[1])
  off = lambda a, b: dict(base, offsets=np.array([a, b], I64))  # noqa: E731
  cases = [
      (off(INT64_MAX, 0), f"attribute offsets[0] = {INT64_MAX} must be in [0, 4]"),
      (off(0, INT64_MAX - 1), f"attribute offsets[1] = {INT64_MAX - 1} must be in [0, 4]"),
      (off(INT64_MIN, 0), f"attribute offsets[0] = {INT64_MIN} must be >= 0"),
      (off(0, -1), "attribute offsets[1] = -1 must be >= 0"),
      (off(5, 0), "attribute offsets[0] = 5 must be in [0, 4]"),
      (off(3, 0), "smaller than its params from attribute offsets[0] = 3"),
      (off(0, 4), "smaller than its params from attribute offsets[1] = 4"),
      (dict(base, offsets=np.array([0], I64)), "one entry per state buffer (2), got 2 and 1"),
      (dict(base, quantized=np.array([1, 1, 1], I64)), "one entry per state buffer (2), got 3"),
      (dict(base, quantized=np.array([2, 1], I64)), "attribute quantized[0] = 2 must be 0 or 1"),
      (dict(base, quantized=np.array([1, INT64_MIN], I64)), "attribute quantized[1]"),
  ]
  for b in (0, -8, 3, 2**21, INT64_MAX, INT64_MIN):
    cases.append((dict(base, block=I64(b)), f"attribute block = {b} must be a power of two"))
  calls = [Call(f"quantized {a}", "adamkit_cpu_step_quantized", ops, outs, a, err)
           for a, err in cases]
  calls += [Call(f"variant {a}", "adamkit_cpu_step_quantized", ops, outs, dict(base, **a), err)
            for a, err in BAD_VARIANTS]
  f = _f32(32)  # a float32 first moment: offsets in elements
  mixed = dict(base, quantized=np.array([0, 1], I64))
  mops, mouts = (s, p, p, f, *q), _outs(p, f, q[0], q[1])
  for at, err in [(INT64_MAX, "attribute offsets[0] = 9223372036854775807 must be in [0, 32]"),
                  (INT64_MAX - 8, "must be in [0, 32]"), (17, "from attribute offsets[0] = 17")]:
    calls.append(Call(f"float32 moment from {at}", "adamkit_cpu_step_quantized", mops, mouts,
                      dict(mixed, offsets=np.array([at, 0], I64)), err))
  calls.append(Call("float32 moment from 16, the last fit", "adamkit_cpu_step_quantized", mops,
                    mouts, dict(mixed, offsets=np.array([16, 2], I64)), None,
                    ((1, slice(0, 16)), (2, slice(0, 2)), (3, slice(0, 2)))))
  return calls


def requantize_calls() -> list[Call]:
  """adamkit_cpu_requantize: a gradient of 16 elements, moments of 2 blocks of 8."""
  s, g, q = _scalars(), _f32(16), _codes(2)
  base = dict(kind=I64(1), amsgrad=False, state=I64(2), block=I64(8))
  ops, outs = (s, g, *q, *q), _outs(q[0], q[1], q[0], q[1])
  calls = [Call(f"block {b}", "adamkit_cpu_requantize", ops, outs, dict(base, block=I64(b)),
                f"attribute block = {b} must be a power of two")
           for b in (0, -8, 3, 2**21, INT64_MAX, INT64_MIN)]
  calls += [Call(f"variant {a}", "adamkit_cpu_requantize", ops, outs, dict(base, **a), err)
            for a, err in BAD_VARIANTS if "decay" not in a and "nesterov" not in a]
  return calls


def calls() -> list[Call]:
  """Every case, handler by handler."""
  return (step_calls() + rounded_calls() + sparse_calls() + row_add_calls() + quantized_calls()
          + requantize_calls() + sparse_quantized_calls())


def run(call: Call):
  """Makes ``call`` (jax.ffi.ffi_call, eagerly): returns the results as NumPy arrays, or
  raises the handler's error."""
  import jax  # noqa: PLC0415

  outs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in call.outs]
  res = jax.ffi.ffi_call(call.target, outs)(*call.operands, **call.attrs)
  return [np.asarray(r) for r in jax.block_until_ready(res)]


def check(call: Call) -> None:
  """Runs ``call`` and checks its outcome: the expected error (and the operands kept), or
  success with every ``kept`` range of the results equal to the operand it came from."""
  before = [np.array(x, copy=True) for x in call.operands]
  try:
    results = run(call)
  except Exception as e:  # noqa: BLE001 - the handler's InvalidArgument, as jax raises it
    if call.error is None or call.error not in str(e):
      raise AssertionError(f"{call.target} ({call.name}): expected "
                           f"{call.error!r}, got {e}") from e
  else:
    if call.error is not None:
      raise AssertionError(f"{call.target} ({call.name}) was accepted; expected {call.error!r}")
    for index, where in call.kept:
      source = _source(call, index)
      np.testing.assert_array_equal(results[index].reshape(-1)[where],
                                    source.reshape(-1)[where], err_msg=call.name)
  for x, b in zip(call.operands, before):
    np.testing.assert_array_equal(np.asarray(x), b, err_msg=f"{call.name}: an operand changed")


def _source(call: Call, index: int) -> np.ndarray:
  """The operand result ``index`` of a valid call starts from (its state buffers)."""
  if call.target == "adamkit_cpu_sparse_lazy":
    return call.operands[3 + index]
  if call.target == "adamkit_cpu_row_add":
    return call.operands[2]
  if call.target == "adamkit_cpu_sparse_lazy_quantized":  # per buffer codes, scales, book, mid
    return call.operands[3 + 4 * (index // 2) + index % 2]
  if call.target in ("adamkit_cpu_step", "adamkit_cpu_step_rounded"):
    # params and grads first, then the state buffers (+ keys): results are params, state
    state = int(call.attrs["state"])
    extra = 1 if int(call.attrs.get("rounding", 0)) == 1 else 0
    num = (len(call.operands) - 1 - state - extra) // 2
    return call.operands[1 + num + index] if index >= num else call.operands[1 + index]
  # the quantized step: scalars, p, g, then per state buffer 1 or 4 operands; results are
  # p, then per state buffer 1 or 2
  flags = list(call.attrs["quantized"])
  at, res = 3, 1
  for flag in flags:
    width = 2 if flag else 1
    if index < res + width:
      return call.operands[at + index - res]
    at += 4 if flag else 1
    res += width
  raise IndexError(index)
