"""Sparse Adam benchmark: one lazy step on k touched rows of an (N, D) embedding table.

Prints two tables in one run. Step times are medians; every lazy step is timed as in a
training loop (right after the previous step of the same optimizer: blocks of consecutive
steps), the blocks of all table sizes and variants taken in turn so that load on a shared
machine hits each alike.

1. The lazy step (jitted, table and state donated) at each table size:
   ``ak.sparse_adam`` (optax protocol: ``update`` + ``ak.apply_updates``) on its default
   backend (the C++ kernels on one CPU device) and with ``backend="xla"`` (XLA gathers and
   scatters: what other backends and sharded tables run); ``ak.fused_adam(...).step`` with a
   ``RowSparse`` gradient (one kernel call: table, m and v rows read and written once); the
   same two kernel paths in a child process whose large buffers get 2 MiB pages
   (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, Linux with transparent huge pages in
   ``madvise`` or ``always`` mode), which takes TLB misses out of random row access; an XLA
   floor (the same k rows scatter-added into three (N, D) arrays, no arithmetic); the
   scratch memory of the compiled ``ak.sparse_adam`` step
   (``compiled.memory_analysis().temp_size_in_bytes``).
2. Against ``torch.optim.SparseAdam`` on the same ids and values and a dense ``ak.adam`` /
   ``optax.adam`` step fed the dense (N, D) gradient (gradient made beforehand; only the
   optimizer step and the update of the params are timed), as ratios.
3. 8-bit moments (``mu_dtype="8bit", nu_dtype="8bit"``, one scale per row): the lazy step's
   time on its default backend (the C++ row kernel on one CPU device) and with
   ``backend="xla"``, against the float32 step on the same backend, and the state's bytes
   per table element measured from its arrays.

Run:  python benchmarks/bench_sparse.py [--sizes 100000,1000000,4000000] [--reps 60]
torch is optional (``pip install adamkit[bench]``); its column is skipped without it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
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


def ak_sparse_runner(n, d, data, backend="auto", moments=None):
  """A callable doing one jitted lazy step (table and state donated), the step's scratch
  memory in bytes, and the state's bytes. ``moments``: ``mu_dtype`` and ``nu_dtype``."""
  tx = ak.sparse_adam(1e-3, backend=backend, mu_dtype=moments, nu_dtype=moments)

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
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  box = [params, state, 0]

  def run():
    p, s, j = box
    p, s = compiled(p, s, *dev[j % len(dev)])
    jax.block_until_ready(p)
    box[:] = [p, s, j + 1]

  return run, temp, state_bytes


VARIANTS = {"auto": ("auto", None), "xla": ("xla", None), "8bit": ("auto", "8bit"),
            "8bit xla": ("xla", "8bit")}


def ak_fused_runner(n, d, data):
  """One jitted ``ak.fused_adam(...).step`` with a RowSparse gradient, params and state
  donated."""
  opt = ak.fused_adam(1e-3)

  def step(params, state, ids, vals):
    return opt.step(params, state, grads={"emb": ak.RowSparse(ids, vals, n)})

  f = jax.jit(step, donate_argnums=(0, 1))
  dev = [(jnp.asarray(i), jnp.asarray(v)) for i, v in data]
  params = {"emb": jnp.zeros((n, d), jnp.float32)}
  box = [params, opt.init(params), 0]

  def run():
    p, s, j = box
    p, s = f(p, s, *dev[j % len(dev)])
    jax.block_until_ready(p)
    box[:] = [p, s, j + 1]

  return run


def lazy_timings(sizes, d, k, reps, variants):
  """Median ms of each (size, variant), round-robin; and the ak.sparse_adam steps' scratch
  and state bytes, by (size, variant)."""
  data = {n: batches(n, k, d) for n in sizes}
  runners, temps, state_bytes = {}, {}, {}
  for n in sizes:
    for v in variants:
      if v == "fused":
        runners[n, v] = ak_fused_runner(n, d, data[n])
      else:
        runners[n, v], temps[n, v], state_bytes[n, v] = ak_sparse_runner(n, d, data[n],
                                                                          *VARIANTS[v])
  ms = interleaved_ms(runners, reps)
  del runners
  gc.collect()
  return ms, temps, state_bytes


def huge_page_timings(sizes, d, k, reps):
  """The kernel paths' timings in a child process with 2 MiB pages for large buffers, or
  None where that is not available (not Linux, no transparent huge pages)."""
  thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
  if not thp.exists() or "[never]" in thp.read_text():
    return None
  env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
  cmd = [sys.executable, __file__, "--child-lazy", "--sizes", ",".join(map(str, sizes)),
         "--dim", str(d), "--k", str(k), "--reps", str(reps)]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  if done.returncode != 0:
    print(f"(2 MiB page run failed: {done.stderr[-500:]})")
    return None
  return {(int(n), v): t for n, v, t in json.loads(done.stdout.strip().splitlines()[-1])}


def floor_runner(n, d, data, backend="xla"):
  """The memory-system floor: add the same k rows into three donated (N, D) arrays (table,
  m, v), no Adam arithmetic and no merge of duplicates: with XLA's scatter-add, or with the
  row-add kernel of ``ak.apply_updates`` (``backend="kernel"``)."""

  def scatter3(a, b, c, ids, vals):
    if backend == "kernel":
      g = ak.RowSparse(ids, vals, n)
      return tuple(ak.apply_updates(x, g, backend="kernel") for x in (a, b, c))
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
  parser.add_argument("--reps", type=int, default=60)
  parser.add_argument("--dense-reps", type=int, default=5)
  parser.add_argument("--no-dense", action="store_true", help="skip the dense columns")
  parser.add_argument("--no-huge-pages", action="store_true", help="skip the 2 MiB page run")
  parser.add_argument("--torch-threads", default=None,
                      help="comma-separated torch thread counts to try, best kept "
                           "(default: 1 and torch's default)")
  parser.add_argument("--child-lazy", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  sizes = [int(s) for s in args.sizes.split(",")]
  k, d = args.k, args.dim
  if args.child_lazy:  # the 2 MiB page run: kernel paths only, JSON on the last line
    ms, _, _ = lazy_timings(sizes, d, k, args.reps, ("auto", "fused"))
    print(json.dumps([[n, v, t] for (n, v), t in ms.items()]))
    return
  if torch is not None:
    threads = (sorted({1, torch.get_num_threads()}) if args.torch_threads is None
               else [int(t) for t in args.torch_threads.split(",")])

  kernel = ak.cpu_kernel_available()
  nan = float("nan")
  print(f"# sparse Adam step, k={k} ids (random, with repeats) x {d} float32; "
        f"jax {jax.__version__}, optax {optax.__version__}, "
        f"torch {f'{torch.__version__} (best of threads {threads})' if torch else 'absent'}; "
        f"{jax.devices()[0].platform} x{len(jax.devices())}; adamkit CPU kernels "
        f"{'built' if kernel else 'NOT BUILT (the kernel columns run XLA)'}; median ms of "
        f"{args.reps} steps ({args.dense_reps} for dense)")
  lazy_ms, temps, state_bytes = lazy_timings(sizes, d, k, args.reps,
                                             ("auto", "xla", "fused", "8bit", "8bit xla"))
  huge = None if args.no_huge_pages else huge_page_timings(sizes, d, k, args.reps)
  data = {n: batches(n, k, d) for n in sizes}
  floors = {(n, b): floor_runner(n, d, data[n], b) for n in sizes
            for b in (("xla", "kernel") if kernel else ("xla",))}
  floor_ms = interleaved_ms(floors, args.reps)
  del floors
  kfloor = (lambda n: floor_ms[n, "kernel"]) if kernel else (lambda n: nan)  # noqa: E731
  gc.collect()
  others = {}
  for n in sizes:  # torch and the dense steps, one size at a time (they need more memory)
    t_ms = (bench_torch(n, d, data[n], args.reps, threads) if torch is not None
            else float("nan"))
    gc.collect()
    ak_dense = optax_dense = float("nan")
    if not args.no_dense:
      ak_dense = bench_dense(n, d, data[n], args.dense_reps, "ak")
      gc.collect()
      optax_dense = bench_dense(n, d, data[n], args.dense_reps, "optax")
      gc.collect()
    others[n] = (t_ms, ak_dense, optax_dense)

  hp = (lambda n, v: nan) if huge is None else (lambda n, v: huge[n, v])  # noqa: E731
  print("\n## 1. The lazy step (ms)\n")
  _table(["rows N", "ak.sparse_adam", "ak.fused_adam step", "sparse_adam backend=xla",
          "sparse_adam, 2 MiB pages", "fused step, 2 MiB pages", "XLA scatter floor",
          "kernel row-add floor", "scratch MB", "table MB"],
         [[f"{n:,}", f"{lazy_ms[n, 'auto']:.3f}", f"{lazy_ms[n, 'fused']:.3f}",
           f"{lazy_ms[n, 'xla']:.3f}", f"{hp(n, 'auto'):.3f}", f"{hp(n, 'fused'):.3f}",
           f"{floor_ms[n, 'xla']:.3f}", f"{kfloor(n):.3f}",
           "nan" if temps[n, "auto"] is None else f"{temps[n, 'auto'] / 2**20:.2f}",
           f"{n * d * 4 / 2**20:.0f}"] for n in sizes])
  print("\n## 2. Against torch.optim.SparseAdam and dense Adam (time / ak's time)\n")
  _table(["rows N", "torch SparseAdam ms", "ak.adam dense ms", "optax.adam dense ms",
          "torch / sparse_adam", "torch / fused", "ak.adam / sparse_adam", "ak.adam / fused",
          "optax.adam / fused"],
         [[f"{n:,}", f"{t:.3f}", f"{da:.2f}", f"{do:.2f}", f"{t / lazy_ms[n, 'auto']:.2f}x",
           f"{t / lazy_ms[n, 'fused']:.2f}x", f"{da / lazy_ms[n, 'auto']:.1f}x",
           f"{da / lazy_ms[n, 'fused']:.1f}x", f"{do / lazy_ms[n, 'fused']:.1f}x"]
          for n, (t, da, do) in others.items()])
  print("\n## 3. 8-bit moments, one scale per row (target: 8-bit <= 1.5x float32)\n")
  mb = lambda x: "nan" if x is None else f"{x / 2**20:.2f}"  # noqa: E731
  _table(["rows N", "float32 ms", "8-bit ms", "8-bit / float32", "float32 xla ms",
          "8-bit xla ms", "8-bit xla / float32 xla",
          "state MB float32", "state MB 8-bit", "bytes/element 8-bit", "scratch MB 8-bit"],
         [[f"{n:,}", f"{lazy_ms[n, 'auto']:.3f}", f"{lazy_ms[n, '8bit']:.3f}",
           f"{lazy_ms[n, '8bit'] / lazy_ms[n, 'auto']:.2f}x", f"{lazy_ms[n, 'xla']:.3f}",
           f"{lazy_ms[n, '8bit xla']:.3f}", f"{lazy_ms[n, '8bit xla'] / lazy_ms[n, 'xla']:.2f}x",
           mb(state_bytes[n, "xla"]), mb(state_bytes[n, "8bit"]),
           f"{state_bytes[n, '8bit'] / (n * d):.3f}", mb(temps[n, "8bit"])] for n in sizes])
  if len(sizes) > 1:
    big, small = sizes[-1], sizes[0]
    grow = lambda ms, v: ms[big, v] / ms[small, v]  # noqa: E731
    line = (f"\nlargest / smallest table ({big:,} / {small:,} rows), target <= 1.3x: "
            f"ak.sparse_adam {grow(lazy_ms, 'auto'):.2f}x, fused step "
            f"{grow(lazy_ms, 'fused'):.2f}x, backend=xla {grow(lazy_ms, 'xla'):.2f}x")
    if huge is not None:
      line += (f"; with 2 MiB pages: ak.sparse_adam {grow(huge, 'auto'):.2f}x, fused step "
               f"{grow(huge, 'fused'):.2f}x")
    xla_floor = floor_ms[big, "xla"] / floor_ms[small, "xla"]
    print(line + f"; the 3-array row-add floors grow {xla_floor:.2f}x (XLA) and "
          f"{kfloor(big) / kfloor(small):.2f}x (kernel).")


def _table(header, rows):
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
  print("| " + " | ".join(h.rjust(w) for h, w in zip(header, widths)) + " |")
  print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
  for r in rows:
    print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
  main()
