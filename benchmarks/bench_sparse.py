"""Sparse Adam benchmark: one lazy step on k touched rows of an (N, D) embedding table.

Prints one table: median step time of ``ak.sparse_adam`` (lazy, jitted, table and state
donated; ``update`` + ``ak.apply_updates``) on its two backends, the C++ kernel (the default
on one CPU device) and the XLA gathers/scatters (``backend="xla"``, what other backends and
sharded tables run), and of the functional op ``ak.fused_sparse_lazy_adam`` (table, m and v
in one kernel call); against ``torch.optim.SparseAdam`` on the same ids and values, and
against a dense ``ak.adam`` / ``optax.adam`` step fed the dense (N, D) gradient (gradient
already made; only the optimizer step and the parameter update are timed). Also the scratch
memory XLA reserves for the compiled lazy step (``compiled.memory_analysis()``) next to the
size of the table, and a floor: the same k rows scatter-added by XLA into three (N, D) arrays
with no arithmetic, which shows what the memory system costs as N grows. The lazy steps and
the floor are timed round-robin over the table sizes, so that load on a shared machine
affects every size alike.

Run:  python benchmarks/bench_sparse.py [--sizes 100000,1000000,4000000] [--reps 20]
torch is optional (``pip install adamkit[bench]``); its column is skipped without it.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import adamkit as ak

try:
  import torch
except ImportError:  # the bench extra is not installed
  torch = None


def median_ms(fn, reps: int, warmup: int = 2) -> float:
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def batches(n, k, d, count=4, seed=0):
  rng = np.random.default_rng(seed)
  return [(rng.integers(0, n, size=k).astype(np.int32),
           rng.normal(size=(k, d)).astype(np.float32)) for _ in range(count)]


def interleaved_ms(runners: dict, reps: int, block: int = 8, settle: int = 2) -> dict:
  """Median ms of each runner. The runners take turns in blocks of ``block`` consecutive
  steps, the first ``settle`` of each block untimed: every step is timed as it runs in a
  training loop, right after the previous step of the same optimizer, while a change in the
  load of a shared machine hits every runner alike (round-robin over the blocks)."""
  times = {key: [] for key in runners}
  while min(len(t) for t in times.values()) < reps:
    for key, run in runners.items():
      for i in range(block):
        t0 = time.perf_counter()
        run()
        if i >= settle:
          times[key].append(time.perf_counter() - t0)
  return {key: 1e3 * statistics.median(t) for key, t in times.items()}


def ak_sparse_runner(n, d, data, backend="auto"):
  """A callable doing one jitted lazy step (table and state donated), and the step's
  scratch memory in bytes."""
  tx = ak.sparse_adam(1e-3, backend=backend)

  def step(params, state, ids, vals):
    grads = {"emb": ak.RowSparse(ids, vals, n)}
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates, backend=backend), state

  params = {"emb": jnp.zeros((n, d), jnp.float32)}
  state = tx.init(params)
  jstep = jax.jit(step, donate_argnums=(0, 1))
  dev = [(jnp.asarray(i), jnp.asarray(v)) for i, v in data]
  compiled = jstep.lower(params, state, *dev[0]).compile()
  mem = compiled.memory_analysis()
  temp = None if mem is None else mem.temp_size_in_bytes
  box = [params, state, 0]

  def run():
    p, s, j = box
    p, s = compiled(p, s, *dev[j % len(dev)])
    jax.block_until_ready(p)
    box[:] = [p, s, j + 1]

  return run, temp


def ak_op_runner(n, d, data):
  """One jitted ``ak.fused_sparse_lazy_adam`` step (MindSpore's op: the caller keeps the
  beta powers), table, m and v donated."""
  b1, b2 = np.float32(0.9), np.float32(0.999)

  def step(var, m, v, t, ids, vals):
    return ak.fused_sparse_lazy_adam(var, m, v, b1 ** t, b2 ** t, 1e-3, b1, b2, 1e-8, vals,
                                     ids)

  f = jax.jit(step, donate_argnums=(0, 1, 2))
  dev = [(jnp.asarray(i), jnp.asarray(v)) for i, v in data]
  box = [tuple(jnp.zeros((n, d), jnp.float32) for _ in range(3)), 1]

  def run():
    arrays, t = box
    arrays = f(*arrays, jnp.float32(t), *dev[t % len(dev)])
    jax.block_until_ready(arrays)
    box[:] = [arrays, t + 1]

  return run


def floor_runner(n, d, data):
  """The memory-system floor: scatter-add the same k rows into three donated (N, D) arrays
  (table, m, v), no Adam arithmetic and no merge of duplicates."""

  def scatter3(a, b, c, ids, vals):
    return tuple(x.at[ids].add(vals, mode="drop") for x in (a, b, c))

  f = jax.jit(scatter3, donate_argnums=(0, 1, 2))
  dev = [(jnp.asarray(np.sort(i)), jnp.asarray(v)) for i, v in data]
  box = [tuple(jnp.zeros((n, d), jnp.float32) for _ in range(3)), 0]

  def run():
    arrays, j = box
    arrays = f(*arrays, *dev[j % len(dev)])
    jax.block_until_ready(arrays)
    box[:] = [arrays, j + 1]

  return run


def bench_dense(n, d, data, reps, which):
  tx = ak.adam(1e-3) if which == "ak" else optax.adam(1e-3)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = {"emb": jnp.zeros((n, d), jnp.float32)}
  state = tx.init(params)
  ids, vals = data[0]
  grads = {"emb": jnp.zeros((n, d), jnp.float32).at[ids].add(vals)}
  jstep = jax.jit(step, donate_argnums=(0, 1))
  box = [params, state]

  def run():
    p, s = jstep(box[0], box[1], grads)
    jax.block_until_ready(p)
    box[:] = [p, s]

  ms = median_ms(run, reps, warmup=1)
  return ms


def bench_torch(n, d, data, reps, threads):
  """Best median over the given intra-op thread counts (torch's default of one thread per
  core suffers most when the machine is shared)."""
  best = float("inf")
  default = torch.get_num_threads()
  for t in threads:
    torch.set_num_threads(t)
    best = min(best, _bench_torch(n, d, data, reps))
  torch.set_num_threads(default)
  return best


def _bench_torch(n, d, data, reps):
  emb = torch.nn.Parameter(torch.zeros(n, d))
  opt = torch.optim.SparseAdam([emb], lr=1e-3)
  grads = [torch.sparse_coo_tensor(torch.from_numpy(i.astype(np.int64))[None],
                                   torch.from_numpy(v), (n, d), check_invariants=False)
           for i, v in data]
  box = [0]

  def run():
    emb.grad = grads[box[0] % len(grads)]
    opt.step()
    box[0] += 1

  ms = median_ms(run, reps)
  return ms


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="100000,1000000,4000000")
  parser.add_argument("--k", type=int, default=4096)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--dense-reps", type=int, default=5)
  parser.add_argument("--no-dense", action="store_true", help="skip the dense columns")
  parser.add_argument("--torch-threads", default=None,
                      help="comma-separated torch thread counts to try, best kept "
                           "(default: 1 and torch's default)")
  args = parser.parse_args()
  sizes = [int(s) for s in args.sizes.split(",")]
  if torch is not None:
    threads = (sorted({1, torch.get_num_threads()}) if args.torch_threads is None
               else [int(t) for t in args.torch_threads.split(",")])
  k, d = args.k, args.dim

  print(f"# sparse Adam step, k={k} ids (random, with repeats) x {d} float32; "
        f"jax {jax.__version__}, optax {optax.__version__}, "
        f"torch {f'{torch.__version__} (best of threads {threads})' if torch else 'absent'}; "
        f"{jax.devices()[0].platform} x{len(jax.devices())}; median ms of {args.reps} steps "
        f"({args.dense_reps} for dense)")
  data = {n: batches(n, k, d) for n in sizes}
  # 1. the lazy steps, all sizes round-robin; 2. the bare scatter floor, likewise
  lazy = {(n, b): ak_sparse_runner(n, d, data[n], b) for n in sizes for b in ("auto", "xla")}
  temps = {n: lazy[n, "auto"][1] for n in sizes}
  runners = {key: run for key, (run, _) in lazy.items()}
  runners.update({(n, "op"): ak_op_runner(n, d, data[n]) for n in sizes})
  lazy_ms = interleaved_ms(runners, args.reps)
  del lazy, runners
  gc.collect()
  floor_ms = interleaved_ms({n: floor_runner(n, d, data[n]) for n in sizes}, args.reps)
  gc.collect()
  # 3. torch and the dense steps, one size at a time (they need more memory)
  rows = []
  for n in sizes:
    t_ms = (bench_torch(n, d, data[n], args.reps, threads) if torch is not None
            else float("nan"))
    gc.collect()
    ak_dense = optax_dense = float("nan")
    if not args.no_dense:
      ak_dense = bench_dense(n, d, data[n], args.dense_reps, "ak")
      gc.collect()
      optax_dense = bench_dense(n, d, data[n], args.dense_reps, "optax")
      gc.collect()
    rows.append((n, lazy_ms[n, "auto"], lazy_ms[n, "op"], lazy_ms[n, "xla"], t_ms, ak_dense,
                 optax_dense, temps[n], floor_ms[n]))

  kernel = ak.cpu_kernel_available()
  print(f"ak.sparse_adam: update + ak.apply_updates, backend auto = "
        f"{'the C++ kernel' if kernel else 'XLA (kernel not built!)'}; op: "
        "ak.fused_sparse_lazy_adam (one kernel call); xla: backend='xla'")
  table_mb = lambda n: n * d * 4 / 2**20  # noqa: E731
  cols = [("rows N", 9), ("ak.sparse_adam", 14), ("ak op", 9), ("ak xla path", 11),
          ("torch SparseAdam", 16), ("ak.adam dense", 13), ("optax.adam dense", 16),
          ("torch/ak", 8), ("torch/op", 8), ("ak.adam/ak", 10), ("ak.adam/op", 10),
          ("XLA scatter floor", 17), ("temp MB", 7), ("table MB", 8)]
  print()
  print("| " + " | ".join(f"{name:>{w}}" for name, w in cols) + " |")
  print("|" + "|".join("-" * (w + 2) for _, w in cols) + "|")
  for n, a, op, xla, t, da, do, temp, fl in rows:
    temp_mb = float("nan") if temp is None else temp / 2**20
    print(f"| {n:>9,} | {a:>11.3f} ms | {op:>6.3f} ms | {xla:>8.3f} ms | {t:>13.3f} ms "
          f"| {da:>10.2f} ms | {do:>13.2f} ms | {t / a:>7.2f}x | {t / op:>7.2f}x "
          f"| {da / a:>9.1f}x | {da / op:>9.1f}x | {fl:>14.3f} ms | {temp_mb:>7.3f} "
          f"| {table_mb(n):>8.0f} |")
  if len(rows) > 1:
    big, small = rows[-1], rows[0]
    print(f"\nlargest / smallest table ({big[0]:,} / {small[0]:,} rows), target <= 1.3x: "
          f"ak.sparse_adam {big[1] / small[1]:.2f}x, op {big[2] / small[2]:.2f}x, xla path "
          f"{big[3] / small[3]:.2f}x; the bare XLA 3-array row scatter grows "
          f"{big[8] / small[8]:.2f}x over the same range (cache and TLB misses of random rows).")
  print("optax.adam dense / ak: "
        + ", ".join(f"{r[0]:,}: {r[6] / r[1]:.1f}x (op {r[6] / r[2]:.1f}x)" for r in rows))


if __name__ == "__main__":
  main()
