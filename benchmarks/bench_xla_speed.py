"""The pure-XLA steps on this CPU: what a GPU or TPU runs, timed where there is no GPU or TPU.

On an accelerator every adamkit step is XLA's (the C++ kernel is CPU-only), so the XLA
program's cost on a CPU is this project's proxy for it (a proxy only: an XLA:CPU time is
not a GPU or TPU time). One AdamW step (update + ``optax.apply_updates``, jitted with
params and state donated) of a float32 model, against ``optax.adamw`` float32 on the same
model in the same run: ``ak.adamw`` float32 and with 8-bit, 4-bit and fp8 moments, the
8-bit one compiled with the CPU kernel off (XLA's own loop writes the new codes) and, for
comparison, with it on. Trees: a single 4096 x 4096 leaf (16.8M parameters) and the
23.1M-parameter transformer-shaped tree of the accelerator tier
(``adamkit._targets.transformer_shapes``: leaves of many sizes, norm scales under
``min_size``). Contenders run interleaved, each round in its own shuffled order; medians
of wall time and of the process's CPU time per step.

    python benchmarks/bench_xla_speed.py                  # both trees, 15 rounds
    python benchmarks/bench_xla_speed.py --tree leaf --reps 31
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import adamkit as ak  # noqa: E402
from adamkit import _quant_ops, _targets  # noqa: E402

BASE = "optax.adamw f32"
CONTENDERS = {  # name -> (factory, kernel allowed)
    BASE: (lambda: optax.adamw(1e-3), True),
    "ak.adamw f32": (lambda: ak.adamw(1e-3), True),
    "ak.adamw 8bit": (lambda: ak.adamw(1e-3, mu_dtype="8bit", nu_dtype="8bit"), False),
    "ak.adamw 4bit": (lambda: ak.adamw(1e-3, mu_dtype="4bit", nu_dtype="4bit"), False),
    "ak.adamw fp8": (lambda: ak.adamw(1e-3, mu_dtype="fp8", nu_dtype="fp8"), False),
    "ak.adamw 8bit (CPU kernel)": (lambda: ak.adamw(1e-3, mu_dtype="8bit", nu_dtype="8bit"),
                                   True),
}
TREES = {"leaf": lambda: {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)},
         "transformer": _targets.transformer_shapes}


def runner(factory, kernel: bool, shapes, cpu: list):
  """A timer of one donated step of ``factory()`` on ``shapes`` (random params and
  gradients), compiled with the CPU kernel off where ``kernel`` is false."""
  leaves = jax.tree.leaves(shapes)
  keys = iter(jax.random.split(jax.random.key(0), 2 * len(leaves)))
  draw = lambda s: 0.02 * jax.random.normal(next(keys), s.shape, s.dtype)  # noqa: E731
  params, grads = jax.tree.map(draw, shapes), jax.tree.map(draw, shapes)
  tx = factory()
  state = jax.jit(tx.init)(params)
  step = jax.jit(_targets.step_fn(tx), donate_argnums=(0, 1))
  with mock.patch.object(_quant_ops, "_on_kernel", (lambda *a: False) if not kernel
                         else _quant_ops._on_kernel):  # read while tracing
    step = step.lower(params, state, grads).compile()
  return common.with_cpu_time(common.stateful_runner(step, (params, state), (grads,)), cpu)


def measure(tree: str, reps: int) -> list[list]:
  shapes = TREES[tree]()
  cpu = {k: [] for k in CONTENDERS}
  runners = {k: runner(f, kernel, shapes, cpu[k]) for k, (f, kernel) in CONTENDERS.items()}
  wall = common.interleave(runners, reps, warmup=3, shuffle=True)
  ms = {k: common.median_ms(v) for k, v in wall.items()}
  cpu_ms = {k: common.median_ms(v[-reps:]) for k, v in cpu.items()}
  return [[tree, name, ms[name], ms[name] / ms[BASE], cpu_ms[name], cpu_ms[name] / cpu_ms[BASE]]
          for name in CONTENDERS]


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tree", choices=(*TREES, "both"), default="both")
  ap.add_argument("--reps", type=int, default=15, help="timed rounds (interleaved)")
  args = ap.parse_args(argv)
  if not ak.cpu_kernel_available():
    ak.build_cpu_kernel()
  t0 = time.time()
  rows = [r for tree in (TREES if args.tree == "both" else [args.tree])
          for r in measure(tree, args.reps)]
  print(common.table(f"pure-XLA steps on {os.cpu_count()} CPU cores, {args.reps} interleaved "
                     "rounds (medians)",
                     ["tree", "step", "ms", "x optax f32", "CPU ms", "CPU x optax f32"], rows))
  print(f"\n({time.time() - t0:.0f} s; jax {jax.__version__}; XLA:CPU times, not GPU or TPU "
        "times)")
  common.write_json("bench_xla_speed", {"reps": args.reps, "rows": rows})


if __name__ == "__main__":
  main()
