"""Dense optimizer-step benchmark on CPU: adamkit vs optax vs PyTorch, in one run.

Scenarios (one table each, printed and written to ``benchmarks/results/bench_dense.json``):

1. Adam, one dense float32 leaf of 1M, 16M and 64M parameters: ``optax.adam``,
   ``ak.adam`` (the optax-protocol chain), ``ak.fused_adam`` on its pure-JAX path and on its
   CPU kernel, ``torch.optim.Adam(fused=True)`` and ``(foreach=True)``, and a memory probe:
   a donated in-place ``x = a*x + b`` over 3.5 float32 per parameter, i.e. the 28 bytes per
   parameter an Adam step must move (read p, g, m, v; write p, m, v), at this machine's
   in-place bandwidth. Every JAX step is jitted with params and state donated, gradients
   fixed, ``block_until_ready`` inside the timing.
2. AdaMax, the same sizes (``optax.adamax``, ``ak.adamax``, ``ak.fused_adamax``,
   ``torch.optim.Adamax(foreach=True)``; PyTorch has no fused AdaMax).
2b. AdamW (``optax.adamw``, ``ak.adamw``, ``ak.fused_adamw``, ``torch.optim.AdamW(fused=True)``
   and ``(foreach=True)``, every leaf decayed, weight decay 0.01) and AMSGrad
   (``optax.amsgrad``, ``ak.adam(amsgrad=True)``, ``ak.fused_adam(amsgrad=True)``,
   ``torch.optim.Adam(amsgrad=True, fused=True)`` and ``(foreach=True)``), each with the
   plain ``ak.fused_adam`` kernel in the same interleave. AMSGrad keeps a third buffer, the
   running maximum of v, and moves 8 more bytes per parameter (36: read p, g, m, v, vmax;
   write p, m, v, vmax); its probe moves 36.
3. A model of 300 small leaves (100 blocks of a d x d kernel and two d vectors, d in
   16..128, 0.6M parameters): step time and compile time (lowering + XLA compile) vs optax, with the fused
   step per leaf and in multi-tensor mode.

Columns: median step time, its ratio to the row named ``baseline`` (optax) and to
``torch.optim.Adam(fused=True)``, effective bandwidth (28 bytes per parameter / time) and
that as a share of the probe. Contenders are interleaved (see common.py), so ratios hold
even when the shared machine's load changes.

  python benchmarks/bench_dense.py            # the full run (a few minutes)
  python benchmarks/bench_dense.py --quick    # 1M and 4M only, fewer repeats
  python benchmarks/bench_dense.py --algos adamw,amsgrad --sizes 16000000 --no-many-leaves

PyTorch is optional (``pip install adamkit[bench]``); without it its rows are skipped.
The CPU kernel is compiled first if it is missing (needs a C++ compiler).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

# torch's OpenMP workers otherwise spin after each step and steal the two cores from the
# next contender's threads; passive waiting keeps the interleaved runs independent.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import adamkit as ak  # noqa: E402

try:
  import torch  # noqa: E402
except ImportError:  # optional: the `bench` extra
  torch = None

LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
BYTES_PER_PARAM = 28
# Bytes an in-place step must move per float32 parameter: AMSGrad reads and writes its
# running maximum too.
BYTES = {"adam": 28, "adamax": 28, "adamw": 28, "amsgrad": 36}
ALGOS = tuple(BYTES)


# ----------------------------------------------------------------------- contenders


def optax_runner(tx, params, grads):
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  fn = jax.jit(step, donate_argnums=(0, 1))
  p = jax.tree.map(jnp.copy, params)
  return fn, common.stateful_runner(fn, (p, tx.init(p)), (grads,))


def fused_runner(opt, params, grads):
  fn = jax.jit(lambda p, s, g: opt.step(p, s, grads=g), donate_argnums=(0, 1))
  p = jax.tree.map(jnp.copy, params)
  return fn, common.stateful_runner(fn, (p, opt.init(p)), (grads,))


def probe_runner(n_params, nbytes=BYTES_PER_PARAM):
  # nbytes / 8 float32 read and written per parameter (3.5: 28 bytes), one in-place pass.
  x = jnp.ones((n_params * nbytes // 8,), jnp.float32)
  fn = jax.jit(lambda x, a: (x * a + 1.0, a), donate_argnums=0)
  return common.stateful_runner(fn, (x, jnp.float32(0.5)))


def torch_runner(make_opt, sizes, seed=0):
  gen = torch.Generator().manual_seed(seed)
  ps = []
  for n in sizes:
    p = torch.randn(n, generator=gen)
    p.grad = 0.1 * torch.randn(n, generator=gen)
    ps.append(p)
  opt = make_opt(ps)

  def run():
    t = time.perf_counter()
    opt.step()
    return time.perf_counter() - t
  return run


def compile_seconds(fn, *args):
  t = time.perf_counter()
  fn.lower(*args).compile()
  return time.perf_counter() - t


# ------------------------------------------------------------------------ scenarios


def _contenders(algo: str):
  """``(optax baseline, ak chain, fused factory, torch {name: factory(params)})``."""
  t = {}
  if algo == "adam":
    base = ("optax.adam", optax.adam(LR, B1, B2, EPS))
    chain = ("ak.adam (optax protocol)", ak.adam(LR, B1, B2, EPS, eps_mode="corrected"))
    make = lambda **kw: ak.fused_adam(LR, B1, B2, EPS, eps_mode="corrected", **kw)
    if torch is not None:
      t["torch Adam fused"] = lambda ps: torch.optim.Adam(ps, lr=LR, betas=(B1, B2), eps=EPS,
                                                          fused=True)
      t["torch Adam foreach"] = lambda ps: torch.optim.Adam(ps, lr=LR, betas=(B1, B2), eps=EPS,
                                                            foreach=True)
  elif algo == "adamw":
    base = ("optax.adamw", optax.adamw(LR, B1, B2, EPS, weight_decay=WD))
    chain = ("ak.adamw (optax protocol)", ak.adamw(LR, B1, B2, EPS, weight_decay=WD,
                                                   weight_decay_mask=None))
    make = lambda **kw: ak.fused_adamw(LR, B1, B2, EPS, weight_decay=WD, weight_decay_mask=None,
                                       **kw)
    if torch is not None:
      t["torch AdamW fused"] = lambda ps: torch.optim.AdamW(ps, lr=LR, betas=(B1, B2), eps=EPS,
                                                            weight_decay=WD, fused=True)
      t["torch AdamW foreach"] = lambda ps: torch.optim.AdamW(
          ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, foreach=True)
  elif algo == "amsgrad":
    base = ("optax.amsgrad", optax.amsgrad(LR, B1, B2, EPS))
    chain = ("ak.adam(amsgrad) (optax protocol)",
             ak.adam(LR, B1, B2, EPS, eps_mode="corrected", amsgrad=True))
    make = lambda **kw: ak.fused_adam(LR, B1, B2, EPS, eps_mode="corrected", amsgrad=True, **kw)
    if torch is not None:
      t["torch Adam(amsgrad) fused"] = lambda ps: torch.optim.Adam(
          ps, lr=LR, betas=(B1, B2), eps=EPS, amsgrad=True, fused=True)
      t["torch Adam(amsgrad) foreach"] = lambda ps: torch.optim.Adam(
          ps, lr=LR, betas=(B1, B2), eps=EPS, amsgrad=True, foreach=True)
  else:
    base = ("optax.adamax", optax.adamax(LR, B1, B2, EPS))
    chain = ("ak.adamax (optax protocol)", ak.adamax(LR, B1, B2, EPS))
    make = lambda **kw: ak.fused_adamax(LR, B1, B2, EPS, **kw)
    if torch is not None:
      t["torch Adamax foreach"] = lambda ps: torch.optim.Adamax(ps, lr=LR, betas=(B1, B2),
                                                                eps=EPS, foreach=True)
  return base, chain, make, t


def dense(algo: str, n: int, reps: int, kernel: bool):
  key = jax.random.key(n)
  params = {"w": jax.random.normal(key, (n,), jnp.float32)}
  grads = {"w": 0.1 * jax.random.normal(jax.random.fold_in(key, 1), (n,), jnp.float32)}
  runners = {f"probe ({BYTES[algo]} B/param, in place)": probe_runner(n, BYTES[algo])}
  (base, base_tx), (chain, chain_tx), make, torch_makers = _contenders(algo)
  runners[base] = optax_runner(base_tx, params, grads)[1]
  runners[chain] = optax_runner(chain_tx, params, grads)[1]
  runners["ak.fused (pure JAX)"] = fused_runner(make(backend="xla"), params, grads)[1]
  if kernel:
    runners["ak.fused (CPU kernel)"] = fused_runner(make(backend="kernel"), params, grads)[1]
    if algo in ("adamw", "amsgrad"):  # the same bandwidth as Adam? Adam's kernel alongside
      runners["ak.fused_adam (CPU kernel, plain Adam)"] = fused_runner(
          ak.fused_adam(LR, B1, B2, EPS, eps_mode="corrected", backend="kernel"), params,
          grads)[1]
  for name, make_opt in torch_makers.items():
    runners[name] = torch_runner(make_opt, [n])
  times = common.interleave(runners, reps)
  del runners
  gc.collect()
  return times


def many_leaves(algo: str, reps: int, kernel: bool):
  rng = np.random.default_rng(0)
  shapes = []
  for _ in range(100):
    d = int(rng.choice([16, 32, 64, 128]))
    shapes += [(d, d), (d,), (d,)]
  params = {f"layer{i:03d}": jnp.asarray(rng.standard_normal(s), jnp.float32)
            for i, s in enumerate(shapes)}
  grads = jax.tree.map(lambda p: 0.01 * p, params)
  n = sum(int(np.prod(s)) for s in shapes)
  base, chain, make, torch_makers = _contenders(algo)
  runners, compiles = {}, {}
  for name, tx in (base, chain):
    fn, runners[name] = optax_runner(tx, params, grads)
    compiles[name] = compile_seconds(fn, params, tx.init(params), grads)
  variants = [("ak.fused (pure JAX, per leaf)", dict(backend="xla", multi_tensor=False)),
              ("ak.fused (pure JAX, multi-tensor)", dict(backend="xla", multi_tensor=True))]
  if kernel:
    variants += [("ak.fused (kernel, per leaf)", dict(backend="kernel", multi_tensor=False)),
                 ("ak.fused (kernel, multi-tensor)", dict(backend="kernel", multi_tensor=True))]
  for name, kw in variants:
    opt = make(**kw)
    fn, runners[name] = fused_runner(opt, params, grads)
    compiles[name] = compile_seconds(fn, params, opt.init(params), grads)
  sizes = [int(np.prod(s)) for s in shapes]
  for name, make_opt in torch_makers.items():
    runners[name] = torch_runner(make_opt, sizes)
  return n, len(shapes), common.interleave(runners, reps), compiles


# --------------------------------------------------------------------------- report


def dense_rows(times, n, baseline, torch_name, nbytes=BYTES_PER_PARAM):
  med = {k: common.median_ms(v) for k, v in times.items()}
  probe = med.get(f"probe ({nbytes} B/param, in place)")
  rows = []
  for name, ms in med.items():
    own = BYTES_PER_PARAM if "plain Adam" in name else nbytes  # the row's own traffic
    gbs = own * n / (ms * 1e-3) / 1e9
    rows.append([name, ms, ms / med[baseline],
                 ms / med[torch_name] if torch_name in med else "-", gbs,
                 f"{100 * gbs / (nbytes * n / (probe * 1e-3) / 1e9):.0f}%" if probe else "-"])
  return rows, med


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--sizes", default="1000000,16000000,64000000")
  ap.add_argument("--quick", action="store_true", help="1M and 4M, fewer repeats")
  ap.add_argument("--no-kernel", action="store_true", help="skip the CPU kernel rows")
  ap.add_argument("--algos", default=",".join(ALGOS),
                  help=f"comma-separated, of {', '.join(ALGOS)} (default: all)")
  ap.add_argument("--no-many-leaves", action="store_true",
                  help="skip the 300-leaf step and compile time scenario")
  args = ap.parse_args(argv)
  algos = args.algos.split(",")
  for a in algos:
    if a not in ALGOS:
      ap.error(f"--algos: unknown {a!r}; choose from {', '.join(ALGOS)}")
  sizes = [1_000_000, 4_000_000] if args.quick else [int(s) for s in args.sizes.split(",")]
  kernel = not args.no_kernel
  if kernel and not ak.cpu_kernel_available():
    try:
      ak.build_cpu_kernel()
    except RuntimeError as e:
      print(f"(no CPU kernel: {e})")
    kernel = ak.cpu_kernel_available()
  print(f"jax {jax.__version__}, optax {optax.__version__}, "
        f"torch {torch.__version__ if torch else 'not installed'}, {os.cpu_count()} CPUs, "
        f"CPU kernel {'on' if kernel else 'off'}")
  result = {"bytes_per_param": BYTES_PER_PARAM, "scenarios": []}
  torch_ref = {"adam": "torch Adam fused", "adamax": "torch Adamax foreach",
               "adamw": "torch AdamW fused", "amsgrad": "torch Adam(amsgrad) fused"}

  for algo in algos:
    baseline = _contenders(algo)[0][0]
    nbytes = BYTES[algo]
    header = ["contender", "median ms", "vs optax",
              "vs torch foreach" if algo == "adamax" else "vs torch fused",
              f"GB/s ({nbytes} B/param)", "of probe"]
    for n in sizes:
      reps = 5 if args.quick else (31 if n <= 2_000_000 else 21 if n <= 20_000_000 else 11)
      times = dense(algo, n, reps, kernel)
      rows, med = dense_rows(times, n, baseline, torch_ref[algo], nbytes)
      print(common.table(f"{algo}, one float32 leaf of {n / 1e6:g}M parameters "
                         f"({reps} interleaved steps, medians; {nbytes} bytes per parameter)",
                         header, rows))
      result["scenarios"].append({"name": f"{algo}_dense", "algo": algo, "params": n,
                                  "reps": reps, "bytes_per_param": nbytes, "median_ms": med,
                                  "samples_s": times})
      sys.stdout.flush()

  for algo in () if args.no_many_leaves else [a for a in ("adam", "adamax") if a in algos]:
    n, leaves, times, compiles = many_leaves(algo, 7 if args.quick else 21, kernel)
    med = {k: common.median_ms(v) for k, v in times.items()}
    base = f"optax.{algo}"
    rows = [[k, ms, ms / med[base], compiles.get(k, "-"),
             compiles[k] / compiles[base] if k in compiles else "-"] for k, ms in med.items()]
    print(common.table(f"{algo}, {leaves} leaves, {n / 1e6:.1f}M parameters (step and "
                       "compile time)", ["contender", "median ms", "vs optax", "compile s",
                                         "compile vs optax"], rows))
    result["scenarios"].append({"name": f"{algo}_many_leaves", "algo": algo, "params": n,
                                "leaves": leaves, "median_ms": med, "compile_s": compiles,
                                "samples_s": times})
    sys.stdout.flush()

  name = "bench_dense" if set(algos) == set(ALGOS) else "bench_dense_" + "_".join(algos)
  print(f"\nwrote {common.write_json(name, result)}")


if __name__ == "__main__":
  main()
