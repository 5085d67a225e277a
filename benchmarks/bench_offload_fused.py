"""The offloaded fused step (``ak.offload(ak.fused_adam(...))``) against its neighbours.

One float32 leaf of ``--n`` parameters (default 16M), Adam with PyTorch's epsilon
placement (``eps_mode="corrected"``), the same fixed gradient every step. Contenders, run
interleaved (see common.py), medians of ``--reps`` donated jitted steps:

* ``ak.fused_adam``, no offload (the CPU kernel; the pure-JAX path without a compiler);
* ``ak.offload(ak.fused_adam)``, ``mode="compute"`` (kernel and pure-JAX path) and
  ``mode="state"``;
* ``ak.offload(ak.adam)``, ``mode="compute"`` (the optax protocol: update, then
  ``optax.apply_updates`` on the device);
* ``torch.optim.Adam(fused=True)`` (optional: ``pip install adamkit[bench]``).

On CPU, "device" and "pinned_host" are the same RAM: the ratios measure what offloading
costs in copies and host-annotated computation, not a PCIe link.

  python benchmarks/bench_offload_fused.py            # 16M parameters
  python benchmarks/bench_offload_fused.py --n 1000000 --reps 5   # a quick smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# bench_dense first: it sets OMP_WAIT_POLICY before torch starts.
from bench_dense import B1, B2, EPS, LR, fused_runner, optax_runner, torch, torch_runner  # noqa: E402, I001

import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import adamkit as ak  # noqa: E402


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--n", type=int, default=16 * 2**20)
  ap.add_argument("--reps", type=int, default=21)
  args = ap.parse_args(argv)
  kernel = ak.cpu_kernel_available()
  if not kernel:
    try:
      ak.build_cpu_kernel()
    except RuntimeError as e:
      print(f"(no CPU kernel: {e})")
    kernel = ak.cpu_kernel_available()

  n = args.n
  key = jax.random.key(0)
  params = {"w": jax.random.normal(key, (n,), jnp.float32)}
  grads = {"w": 0.1 * jax.random.normal(jax.random.fold_in(key, 1), (n,), jnp.float32)}

  def fused(**kw):
    return ak.fused_adam(LR, B1, B2, EPS, eps_mode="corrected", **kw)

  base = "ak.fused_adam, no offload"
  runners = {base: fused_runner(fused(), params, grads)[1]}
  runners["offload(fused_adam), compute"] = fused_runner(
      ak.offload(fused(), mode="compute"), params, grads)[1]
  runners["offload(fused_adam backend='xla'), compute"] = fused_runner(
      ak.offload(fused(backend="xla"), mode="compute"), params, grads)[1]
  runners["offload(fused_adam), state"] = fused_runner(
      ak.offload(fused(), mode="state"), params, grads)[1]
  runners["offload(ak.adam), compute"] = optax_runner(
      ak.offload(ak.adam(LR, B1, B2, EPS, eps_mode="corrected"), mode="compute"),
      params, grads)[1]
  if torch is not None:
    runners["torch Adam fused"] = torch_runner(
        lambda ps: torch.optim.Adam(ps, lr=LR, betas=(B1, B2), eps=EPS, fused=True), [n])
  times = common.interleave(runners, args.reps)

  med = {k: common.median_ms(v) for k, v in times.items()}
  tname = "torch Adam fused"
  rows = [[k, ms, ms / med[base], ms / med[tname] if tname in med else "-",
           28 * n / (ms * 1e-3) / 1e9] for k, ms in med.items()]
  print(f"jax {jax.__version__}, torch {torch.__version__ if torch else 'not installed'}, "
        f"{os.cpu_count()} CPUs, backend {jax.default_backend()}, "
        f"CPU kernel {'on' if kernel else 'off'}")
  print(common.table(f"Adam, one float32 leaf of {n / 2**20:.3g}Mi parameters ({args.reps} "
                     "interleaved donated steps, medians)",
                     ["contender", "median ms", "vs fused no offload", "vs torch fused",
                      "GB/s (28 B/param)"], rows))
  path = common.write_json("bench_offload_fused", {"params": n, "median_ms": med,
                                                   "samples_s": times})
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
