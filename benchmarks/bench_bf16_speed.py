"""bf16 params without a float32 master copy, section "speed": one AdamW step on 16M
parameters, on CPU.

One bf16 leaf of 4096 x 4096 with bf16 gradients, AdamW (lr 1e-3, betas 0.9/0.999, eps
1e-8, weight decay 0.01 on every parameter), float32 moments, gradients fixed. For each
rounding (``"nearest"``, ``"stochastic"``, ``"kahan"``), three forms of the same step:

* ``ak.fused_adamw(..., param_rounding=method)`` on its C++ kernel (reads p and g as 2
  bytes, m and v as 4, the Kahan buffer as 2; float32 arithmetic; writes p, m, v and the
  buffer in the same pass: 20 bytes per parameter, 24 with Kahan);
* the same fused step on XLA (``backend="xla"``);
* the chain form ``ak.param_rounding(ak.adamw(...), method)``, its ``update`` and
  ``optax.apply_updates`` in one jitted function.

References: ``optax.adamw`` on float32 params and gradients (the reference of the ratios)
and ``ak.fused_adamw`` in float32 on its kernel. Every step is jitted with params and
state donated, ``block_until_ready`` inside the timing; contenders run interleaved (see
common.py) and the table gives medians of the wall time and of the CPU time per step
(``time.process_time``, every thread of the process). The machine is shared: read the
ratios, and under heavy load the CPU times.

  python benchmarks/bench_bf16_speed.py              # 15 rounds
  python benchmarks/bench_bf16_speed.py --reps 31
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import adamkit as ak  # noqa: E402

LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
SHAPE = (4096, 4096)
METHODS = ("nearest", "stochastic", "kahan")
REFERENCE = "optax.adamw f32"


def donated_runner(step, params, state, grads):
  fn = jax.jit(step, donate_argnums=(0, 1))
  return common.stateful_runner(fn, (jax.tree.map(jnp.copy, params), state), (grads,))


def fused_runner(opt, params, grads):
  p = jax.tree.map(jnp.copy, params)
  return donated_runner(lambda p, s, g: opt.step(p, s, grads=g), p, opt.init(p), grads)


def optax_runner(tx, params, grads):
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  p = jax.tree.map(jnp.copy, params)
  return donated_runner(step, p, tx.init(p), grads)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=15)
  args = ap.parse_args()
  if not ak.cpu_kernel_available():
    ak.build_cpu_kernel()

  key = jax.random.key(0)
  p32 = {"w": jax.random.normal(key, SHAPE, jnp.float32)}
  g32 = {"w": 0.1 * jax.random.normal(jax.random.fold_in(key, 1), SHAPE, jnp.float32)}
  p16, g16 = (jax.tree.map(lambda x: x.astype(jnp.bfloat16), t) for t in (p32, g32))
  kw = dict(weight_decay=WD, weight_decay_mask=None)
  seeded = lambda m: {"seed": 0} if m == "stochastic" else {}  # noqa: E731

  runners = {
      REFERENCE: optax_runner(optax.adamw(LR, B1, B2, EPS, weight_decay=WD), p32, g32),
      "ak.fused_adamw f32 (kernel)": fused_runner(
          ak.fused_adamw(LR, B1, B2, EPS, backend="kernel", **kw), p32, g32),
  }
  for m in METHODS:
    for backend in ("kernel", "xla"):
      opt = ak.fused_adamw(LR, B1, B2, EPS, param_rounding=m, backend=backend, **seeded(m), **kw)
      runners[f"fused bf16 {m} ({backend})"] = fused_runner(opt, p16, g16)
    chain = ak.param_rounding(ak.adamw(LR, B1, B2, EPS, **kw), m, **seeded(m))
    runners[f"chain bf16 {m}"] = optax_runner(chain, p16, g16)

  cpu = {k: [] for k in runners}
  runners = {k: common.with_cpu_time(run, cpu[k]) for k, run in runners.items()}
  times = common.interleave(runners, args.reps, warmup=3)
  med = {k: common.median_ms(v) for k, v in times.items()}
  med_cpu = {k: common.median_ms(v[-args.reps:]) for k, v in cpu.items()}
  ref, ref_cpu = med[REFERENCE], med_cpu[REFERENCE]
  rows = [[name, ms, ms / ref, med_cpu[name], med_cpu[name] / ref_cpu]
          for name, ms in med.items()]
  print(common.table(f"AdamW step, {SHAPE[0]}x{SHAPE[1]} = 16.8M parameters (bf16 rows: bf16 "
                     f"params and gradients, float32 moments), median of {args.reps} "
                     "interleaved rounds",
                     ["contender", "ms", f"x {REFERENCE}", "CPU ms", "CPU x optax"], rows))
  path = common.write_json("bench_bf16_speed", {
      "shape": SHAPE, "reps": args.reps, "median_ms": med, "median_cpu_ms": med_cpu,
      "samples_s": times, "cpu_samples_s": cpu, "load_average": os.getloadavg()})
  print(f"\nwritten: {path}")


if __name__ == "__main__":
  main()
