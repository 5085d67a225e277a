"""The device benchmark: adamkit's steps on a real GPU or TPU against ``optax.adamw`` float32.

For a 23.1M-parameter transformer-shaped tree (``--tree leaf``: one 4096x4096 leaf) it
prints, per contender, the jitted optimizer step's median time (contenders interleaved,
params and state donated) and the peak device memory of a process that only initialises
and steps that contender (``device.memory_stats()["peak_bytes_in_use"]``, one subprocess
each, so no contender's peak includes another's), as ratios to ``optax.adamw`` float32.
Contenders: ``ak.adamw`` float32, 8-bit, 4-bit and fp8 moments, bf16 params with stochastic
rounding, and ``ak.offload`` of ``ak.adamw`` in both modes.

    python benchmarks/accelerator.py            # on a GPU or TPU machine, under 8 minutes
    python benchmarks/accelerator.py --allow-cpu --steps 5 --reps 3   # a smoke run here

On a CPU the figures are CPU figures (the table says which platform it measured); the
compile-time figures for TPU and GPU targets without hardware are ``ak.memory_report``'s.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import optax

import adamkit as ak
from adamkit import _targets

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import common  # noqa: E402

CONTENDERS = {  # name -> (factory, param dtype)
    "optax.adamw f32": (lambda: optax.adamw(1e-3), jnp.float32),
    "ak.adamw f32": (lambda: ak.adamw(1e-3), jnp.float32),
    "ak.adamw 8bit": (lambda: ak.adamw(1e-3, mu_dtype="8bit", nu_dtype="8bit"), jnp.float32),
    "ak.adamw 4bit": (lambda: ak.adamw(1e-3, mu_dtype="4bit", nu_dtype="4bit"), jnp.float32),
    "ak.adamw fp8": (lambda: ak.adamw(1e-3, mu_dtype="fp8", nu_dtype="fp8"), jnp.float32),
    "bf16 + stochastic": (lambda: ak.param_rounding(ak.adamw(1e-3), "stochastic"),
                          jnp.bfloat16),
    "offload state": (lambda: ak.offload(ak.adamw(1e-3), mode="state"), jnp.float32),
    "offload compute": (lambda: ak.offload(ak.adamw(1e-3), mode="compute"), jnp.float32),
}


def make(name: str, tree: str, seed: int = 0):
  """Params, state, gradients and the donated jitted step of one contender."""
  factory, dtype = CONTENDERS[name]
  shapes = (_targets.transformer_shapes(dtype=dtype) if tree == "transformer"
            else {"w": jax.ShapeDtypeStruct((4096, 4096), dtype)})
  keys = iter(jax.random.split(jax.random.key(seed), 2 * len(jax.tree.leaves(shapes))))
  draw = lambda s: (0.02 * jax.random.normal(next(keys), s.shape, jnp.float32)).astype(s.dtype)
  params, grads = jax.tree.map(draw, shapes), jax.tree.map(draw, shapes)
  tx = factory()
  state = jax.jit(tx.init)(params)
  step = jax.jit(_targets.step_fn(tx), donate_argnums=(0, 1))
  return params, state, grads, step


def peak_of(name: str, tree: str, steps: int) -> dict:
  """In this process (a fresh one): the device's peak bytes after ``steps`` steps."""
  params, state, grads, step = make(name, tree)
  for _ in range(steps):
    params, state = step(params, state, grads)
  jax.block_until_ready((params, state))
  stats = jax.devices()[0].memory_stats() or {}
  return {"peak": stats.get("peak_bytes_in_use"), "params": _targets.params_count(params)}


def peaks(args) -> dict:
  out = {}
  for name in CONTENDERS:
    done = subprocess.run([sys.executable, __file__, "--peak-of", name, "--tree", args.tree,
                           "--steps", "3"], capture_output=True, text=True, timeout=300)
    out[name] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
        "error": done.stderr[-500:]}
  return out


def times(args) -> dict:
  runners = {}
  for name in CONTENDERS:
    params, state, grads, step = make(name, args.tree)
    runners[name] = common.stateful_runner(lambda p, s, g, step=step: step(p, s, g),
                                           (params, state), (grads,))
  got = common.interleave(runners, args.reps, warmup=2, shuffle=True)
  return {k: common.median_ms(v) for k, v in got.items()}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tree", choices=("transformer", "leaf"), default="transformer")
  ap.add_argument("--reps", type=int, default=50, help="timed rounds (interleaved)")
  ap.add_argument("--allow-cpu", action="store_true", help="run on a CPU (a smoke run)")
  ap.add_argument("--peak-of", help=argparse.SUPPRESS)
  ap.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.peak_of:
    print(json.dumps(peak_of(args.peak_of, args.tree, args.steps)))
    return
  platform = jax.default_backend()
  if platform == "cpu" and not args.allow_cpu:
    sys.exit("benchmarks/accelerator.py measures a GPU or TPU; this process sees only the "
             "CPU (pass --allow-cpu for a smoke run, whose figures are CPU figures).")
  t0 = time.time()
  ms, mem = times(args), peaks(args)
  base_ms, base_peak = ms["optax.adamw f32"], mem["optax.adamw f32"].get("peak")
  rows = []
  for name in CONTENDERS:
    peak = mem[name].get("peak")
    rows.append([name, ms[name], ms[name] / base_ms,
                 "n/a" if peak is None else peak / 2**20,
                 "n/a" if not (peak and base_peak) else peak / base_peak])
  title = (f"{platform}: {jax.devices()[0].device_kind}, {args.tree} tree, "
           f"{mem['optax.adamw f32'].get('params', 0):,} params, {args.reps} interleaved rounds")
  print(common.table(title, ["step", "median ms", "x optax f32", "peak MiB", "x optax f32"],
                     rows))
  print(f"\n({time.time() - t0:.0f} s; peak: memory_stats()['peak_bytes_in_use'] of a "
        "process that steps one contender)")
  common.write_json(f"accelerator_{platform}_{args.tree}", {
      "ms": ms, "peak": mem, "reps": args.reps, "tree": args.tree})


if __name__ == "__main__":
  main()
