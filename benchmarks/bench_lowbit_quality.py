"""Training quality of low-bit optimizer states: a digits MLP, 100 full-batch AdamW steps.

The model is a 64-512-512-10 ReLU MLP on scikit-learn's digits (1347 train / 450 test
images, a fixed split), trained full batch for 100 steps of AdamW with a warmup-cosine
learning rate. Every contender runs the same float32 AdamW step written out below; only
where the two moments are *stored* between steps changes (a "storage"):

- ``float32``: no quantization (the reference);
- ``adamkit 8bit`` / ``4bit`` / ``fp8``: ``adamkit._quant``'s formats (``ak.Quantized``),
  leaves under ``min_size=4096`` elements stay float32, as in the optimizers;
- ``torchao 4bit``, ``torchao fp8``: faithful emulations of torchao's ``AdamW4bit`` (signed
  4-bit dynamic map for m, the zero-free linear map ``linspace(0, 1, 17)[1:]`` for v, blocks
  of 128) and ``AdamWFp8`` (float8 e4m3 codes of ``x / absmax * 448`` for m and v, blocks
  of 256); both keep float32 for a leaf under 4096 elements or not a multiple of the block.
  The 8-bit format of torchao's / bitsandbytes' ``AdamW8bit`` *is* ``adamkit 8bit``.

As in torchao and bitsandbytes, the step reads the dequantized old moments, forms the new
ones in float32, takes its update from those, and stores them quantized. The rows
``ak.adamw(...)`` run the library's own optimizer with ``mu_dtype=nu_dtype=fmt`` (where
this checkout has it) as a cross-check of the emulated loop.

    python benchmarks/bench_lowbit_quality.py                 # the table (seed 0, lr 2e-3)
    python benchmarks/bench_lowbit_quality.py --grid          # + seeds 0-2 x lr 1e-3, 3e-3

Prints Markdown tables and writes them to ``benchmarks/results/lowbit_quality.md``
(and the loss curves to ``lowbit_quality.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adamkit import _quant

RESULTS = pathlib.Path(__file__).parent / "results"
SIZES = (64, 512, 512, 10)
B1, B2, EPS, WEIGHT_DECAY = 0.9, 0.999, 1e-8, 1e-2
WARMUP = 10


# ----------------------------------------------------------------------------- the task


def digits_split(seed: int = 0):
  """scikit-learn's digits as float32 in [0, 1], split 1347 / 450 by a fixed permutation."""
  from sklearn.datasets import load_digits  # noqa: PLC0415 - only the benchmarks need it

  x, y = load_digits(return_X_y=True)
  order = np.random.default_rng(seed).permutation(len(y))
  x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
  n_test = 450
  return (jnp.asarray(x[n_test:]), jnp.asarray(y[n_test:])), (jnp.asarray(x[:n_test]),
                                                             jnp.asarray(y[:n_test]))


def init_mlp(key: jax.Array, sizes=SIZES) -> dict:
  keys = jax.random.split(key, len(sizes) - 1)
  return {f"dense{i}": {"kernel": jax.random.normal(k, (m, n)) * np.float32(math.sqrt(2.0 / m)),
                        "bias": jnp.zeros((n,), jnp.float32)}
          for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def logits_fn(params: dict, x: jax.Array) -> jax.Array:
  layers = list(params.values())
  for layer in layers[:-1]:
    x = jax.nn.relu(x @ layer["kernel"] + layer["bias"])
  return x @ layers[-1]["kernel"] + layers[-1]["bias"]


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y).mean()


def accuracy(params: dict, x: jax.Array, y: jax.Array) -> float:
  return float(jnp.mean(jnp.argmax(logits_fn(params, x), -1) == y))


# ----------------------------------------------------------------------------- storages


@dataclasses.dataclass(frozen=True)
class Storage:
  """How a moment lives between steps: ``init(p, role)``, ``load(s)`` (float32),
  ``store(x, s, t)`` (like ``s``, at step count ``t``: adamkit's 4-bit dither),
  ``nbytes(s)``; ``role`` is "mu" (m) or "nu" (v)."""

  name: str
  init: Callable[[jax.Array, str], Any]
  load: Callable[[Any], jax.Array]
  store: Callable[[jax.Array, Any, jax.Array], Any]
  nbytes: Callable[[Any], int]


FLOAT32 = Storage("float32", lambda p, role: jnp.zeros_like(p, jnp.float32), lambda s: s,
                  lambda x, s, t: x, lambda s: s.size * 4)


def adamkit_storage(kind: str, exact: bool = False) -> Storage:
  fmt = _quant.Quantized(kind, exact=exact)  # min_size=4096: smaller leaves stay float32
  name = f"adamkit {kind}" + (" exact (= bitsandbytes / torchao)" if exact else "")
  return Storage(name, lambda p, role: _quant.init_moment(p, fmt, role),
                 _quant.load, lambda x, s, t: _quant.store(x, s, step=t),
                 lambda s: s.nbytes if _quant.is_qarray(s) else s.size * 4)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Emulated:
  """An anchor's quantized moment: ``codes`` (one per element, flat) and block scales."""

  codes: jax.Array
  scales: jax.Array
  shape: tuple = dataclasses.field(metadata=dict(static=True))
  role: str = dataclasses.field(metadata=dict(static=True))


def _torchao_search(r: jax.Array, qmap: jax.Array, bits: int) -> jax.Array:
  """torchao's ``quantize_{4,8}bit_with_qmap``: a branch-free binary search for the last
  entry ``<= r``, then a step up when ``r`` is at least halfway to the next entry."""
  code = jnp.where(r >= qmap[1 << (bits - 1)], 1 << (bits - 1), 0)
  for b in reversed(range(bits - 1)):
    code = code + jnp.where(r >= qmap[code + (1 << b)], 1 << b, 0)
  up = jnp.minimum(code + 1, (1 << bits) - 1)
  down_value, up_value = qmap[code], qmap[up]
  return jnp.where(r - down_value >= (up_value - down_value) * 0.5, up, code)


def torchao_4bit_storage() -> Storage:
  block = 128
  qmaps = {"mu": jnp.asarray(_quant._dynamic_map(True, 4, 3)),  # = create_dynamic_map(True, 3, 4)
           "nu": jnp.asarray(np.linspace(0, 1, 17, dtype=np.float32)[1:])}  # no zero

  def init(p, role):
    if p.size < 4096 or p.size % block:
      return jnp.zeros_like(p, jnp.float32)
    return store(jnp.zeros_like(p, jnp.float32), Emulated(None, None, p.shape, role))

  def store(x, s, t=None):  # deterministic rounding: the step count is not used
    if not isinstance(s, Emulated):
      return x
    xb = x.reshape(-1, block)
    scales = jnp.maximum(jnp.max(jnp.abs(xb), axis=1), 1e-12)
    codes = _torchao_search(xb / scales[:, None], qmaps[s.role], 4).astype(jnp.uint8)
    return Emulated(codes.reshape(-1), scales, s.shape, s.role)

  def load(s):
    if not isinstance(s, Emulated):
      return s
    xb = qmaps[s.role][s.codes.astype(jnp.int32)].reshape(-1, block) * s.scales[:, None]
    return xb.reshape(s.shape)

  def nbytes(s):
    return s.codes.size // 2 + s.scales.size * 4 if isinstance(s, Emulated) else s.size * 4

  return Storage("torchao 4bit", init, load, store, nbytes)


def torchao_fp8_storage() -> Storage:
  block, fp8_max = 256, 448.0

  def init(p, role):
    if p.size < 4096 or p.size % block:
      return jnp.zeros_like(p, jnp.float32)
    return store(jnp.zeros_like(p, jnp.float32), Emulated(None, None, p.shape, role))

  def store(x, s, t=None):  # deterministic rounding: the step count is not used
    if not isinstance(s, Emulated):
      return x
    xb = x.reshape(-1, block)
    scales = jnp.maximum(jnp.max(jnp.abs(xb), axis=1), 1e-12) / fp8_max
    codes = (xb / scales[:, None]).astype(jnp.float8_e4m3fn)  # round to nearest even
    return Emulated(jax.lax.bitcast_convert_type(codes, jnp.uint8).reshape(-1), scales,
                    s.shape, s.role)

  def load(s):
    if not isinstance(s, Emulated):
      return s
    codes = jax.lax.bitcast_convert_type(s.codes, jnp.float8_e4m3fn).astype(jnp.float32)
    return (codes.reshape(-1, block) * s.scales[:, None]).reshape(s.shape)

  def nbytes(s):
    return s.codes.size + s.scales.size * 4 if isinstance(s, Emulated) else s.size * 4

  return Storage("torchao fp8", init, load, store, nbytes)


def storages() -> list[Storage]:
  return [FLOAT32, adamkit_storage("8bit"), adamkit_storage("8bit", exact=True),
          adamkit_storage("4bit"), adamkit_storage("fp8"),
          torchao_4bit_storage(), torchao_fp8_storage()]


# ----------------------------------------------------------------------------- training


def schedule(lr: float, steps: int):
  return optax.warmup_cosine_decay_schedule(0.0, lr, WARMUP, steps, 0.0)


def is_state_leaf(x) -> bool:
  return isinstance(x, (_quant.QuantizedArray, Emulated))


def adamw_step(storage: Storage, params, grads, mu, nu, count, lr):
  """One float32 AdamW step (decay on every leaf), moments kept in ``storage``."""
  t = (count + 1).astype(jnp.float32)
  bc1, bc2 = 1.0 - B1 ** t, 1.0 - B2 ** t

  def leaf(p, g, m_s, v_s):
    m = B1 * storage.load(m_s) + (1.0 - B1) * g
    v = B2 * storage.load(v_s) + (1.0 - B2) * g * g
    u = (m / bc1) / (jnp.sqrt(v / bc2) + EPS) + WEIGHT_DECAY * p
    return p - lr * u, storage.store(m, m_s, count + 1), storage.store(v, v_s, count + 1)

  out = jax.tree.map(leaf, params, grads, mu, nu, is_leaf=is_state_leaf)
  pick = lambda i: jax.tree.map(lambda _, o: o[i], params, out)
  return pick(0), pick(1), pick(2)


def train_emulated(storage: Storage, params, data, lr: float, steps: int):
  """Losses before every step and the final params of ``steps`` AdamW steps."""
  (x, y), sched = data, schedule(lr, steps)
  mu = jax.tree.map(lambda p: storage.init(p, "mu"), params)
  nu = jax.tree.map(lambda p: storage.init(p, "nu"), params)

  def body(carry, _):
    params, mu, nu, count = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    params, mu, nu = adamw_step(storage, params, grads, mu, nu, count, sched(count))
    return (params, mu, nu, count + 1), loss

  (params, mu, nu, _), losses = jax.jit(lambda c: jax.lax.scan(body, c, length=steps))(
    (params, mu, nu, jnp.zeros((), jnp.int32)))
  state_bytes = sum(storage.nbytes(s) for s in jax.tree.leaves((mu, nu), is_leaf=is_state_leaf))
  return params, np.asarray(losses), state_bytes


def train_library(kind: str | None, params, data, lr: float, steps: int):
  """The same run through ``ak.adamw(mu_dtype=kind, nu_dtype=kind)``; None where this
  checkout's optimizers do not take a quantized format yet."""
  import adamkit as ak  # noqa: PLC0415

  x, y = data
  try:
    tx = ak.adamw(schedule(lr, steps), B1, B2, EPS, weight_decay=WEIGHT_DECAY,
                  weight_decay_mask=None, mu_dtype=kind, nu_dtype=kind)
    state = tx.init(params)
  except (TypeError, ValueError) as err:
    return None, str(err).splitlines()[0]

  def body(carry, _):
    params, state = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), loss

  (params, state), losses = jax.jit(lambda c: jax.lax.scan(body, c, length=steps))(
    (params, state))
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if getattr(x, "ndim", 0) > 0)
  return (params, np.asarray(losses), state_bytes), None


@dataclasses.dataclass
class Run:
  name: str
  final_loss: float
  test_acc: float
  nan: bool
  bytes_per_param: float
  losses: list


def run_all(seed: int, lr: float, steps: int, library: bool = True) -> list[Run]:
  train, test = digits_split()
  params0 = init_mlp(jax.random.key(seed))
  n_params = sum(p.size for p in jax.tree.leaves(params0))
  runs = []

  def record(name, params, losses, state_bytes):
    final = float(loss_fn(params, *train))
    nan = not (np.all(np.isfinite(losses)) and math.isfinite(final))
    runs.append(Run(name, final, accuracy(params, *test), nan, state_bytes / n_params,
                    [float(v) for v in losses] + [final]))

  for storage in storages():
    record(storage.name, *train_emulated(storage, params0, train, lr, steps))
  if library:
    for kind in (None, "8bit", "4bit", "fp8"):
      got, why = train_library(kind, params0, train, lr, steps)
      name = f"ak.adamw(mu_dtype=nu_dtype={kind!r})"
      if got is None:
        print(f"  {name}: not run ({why})")
      else:
        record(name, *got)
  return runs


# ----------------------------------------------------------------------------- tables


def large_leaf_bytes(kind: str) -> float:
  """State bytes per parameter of a large leaf (both moments, codes + scales)."""
  total = 0.0
  for role in _quant.ROLES:
    fmt = _quant.resolve(_quant.Quantized(kind), role)
    total += (0.5 if fmt.packed else 1.0) + 4.0 / fmt.block_size
  return total


def quality_table(runs: list[Run]) -> str:
  ref = next(r for r in runs if r.name == "float32")
  lines = ["| state storage | final train loss | vs float32 | test accuracy | NaN | state bytes/param |",
           "|---|---|---|---|---|---|"]
  for r in runs:
    ratio = "diverged" if r.nan else f"{r.final_loss / ref.final_loss:.2f}x"
    lines.append(f"| {r.name} | {r.final_loss:.4g} | {ratio} | {100 * r.test_acc:.1f}% | "
                 f"{'yes' if r.nan else 'no'} | {r.bytes_per_param:.2f} |")
  return "\n".join(lines)


def grid_table(grid: dict) -> str:
  names = [r.name for r in next(iter(grid.values()))]
  names = [n for n in names if not n.startswith("ak.adamw")]
  head = "| seed, peak lr | " + " | ".join(names) + " |"
  lines = [head, "|" + "---|" * (len(names) + 1)]
  for (seed, lr), runs in grid.items():
    by = {r.name: r for r in runs}
    ref = by["float32"]
    cells = []
    for n in names:
      r = by[n]
      cells.append("NaN" if r.nan else
                   f"{r.final_loss / ref.final_loss:.2f}x, {100 * (r.test_acc - ref.test_acc):+.1f}")
    lines.append(f"| {seed}, {lr:g} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--lr", type=float, default=2e-3)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--grid", action="store_true",
                      help="also seeds 0, 1, 2 x peak lr 1e-3, 3e-3 (ratios only)")
  args = parser.parse_args(argv)

  t0 = time.perf_counter()
  runs = run_all(args.seed, args.lr, args.steps)
  header = (f"digits MLP {'-'.join(map(str, SIZES))}, {args.steps} full-batch AdamW steps, "
            f"peak lr {args.lr:g} (warmup {WARMUP}, cosine to 0), weight decay {WEIGHT_DECAY:g}, "
            f"seed {args.seed}")
  text = f"### Low-bit optimizer states: quality\n\n{header}\n\n{quality_table(runs)}\n"
  text += ("\nState bytes/param of a large leaf (both moments, codes + scales): "
           + ", ".join(f"{k} {large_leaf_bytes(k):.3f}" for k in _quant.KINDS) + "; float32 8.\n")
  payload = {"settings": vars(args), "runs": [dataclasses.asdict(r) for r in runs]}
  if args.grid:
    grid = {}
    for seed in (0, 1, 2):
      for lr in (1e-3, 3e-3):
        grid[(seed, lr)] = run_all(seed, lr, args.steps, library=False)
    text += ("\n#### Other seeds and learning rates (final train loss vs float32, test "
             "accuracy points vs float32)\n\n" + grid_table(grid) + "\n")
    payload["grid"] = {f"{s},{lr}": [dataclasses.asdict(r) for r in runs]
                       for (s, lr), runs in grid.items()}
  print(text)
  print(f"({time.perf_counter() - t0:.0f} s)")
  RESULTS.mkdir(exist_ok=True)
  (RESULTS / "lowbit_quality.md").write_text(text)
  (RESULTS / "lowbit_quality.json").write_text(json.dumps(payload))


if __name__ == "__main__":
  main()
