"""What a jitted sparse step costs without buffer donation.

``jax.jit`` returns new arrays: unless the step donates its inputs
(``donate_argnums=(0, 1)`` for ``step(params, state, ...)``), XLA cannot update the table
and its moments in place and copies all three, ``O(N)``, to change ``k`` rows. This
times one lazy step on an (N, 64) float32 table, k = 4,096 ids, with and without
donation, for ``ak.sparse_adam`` (``update`` + ``ak.apply_updates``) and the one-pass
``ak.fused_adam(...).step``, next to a dense ``ak.adam`` step on the same table (donated),
interleaved, medians in ms.

Run:  python benchmarks/bench_donation.py [--sizes 100000,1000000] [--reps 15]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from common import interleave, median_ms, stateful_runner, table

import adamkit as ak

D, K = 64, 4096


def contenders(n: int) -> dict:
  ids = jax.random.randint(jax.random.key(0), (K,), 0, n)
  vals = jax.random.normal(jax.random.key(1), (K, D))

  def fresh():
    return jax.device_put({"emb": jnp.zeros((n, D))}, jax.devices()[0])

  tx = ak.sparse_adam(1e-3)

  def sparse_step(params, state):
    updates, state = tx.update({"emb": ak.RowSparse(ids, vals, n)}, state, params)
    return ak.apply_updates(params, updates), state

  fused = ak.fused_adam(1e-3)

  def fused_step(params, state):
    return fused.step(params, state, {"emb": ak.RowSparse(ids, vals, n)})

  dense_tx = ak.adam(1e-3)
  dense_grad = {"emb": ak.RowSparse(ids, vals, n).todense()}

  def dense_step(params, state):
    updates, state = dense_tx.update(dense_grad, state, params)
    return optax.apply_updates(params, updates), state

  runners = {}
  for name, fn, opt in [("sparse_adam", sparse_step, tx), ("fused_adam step", fused_step, fused)]:
    for donate in (True, False):
      params = fresh()
      step = jax.jit(fn, donate_argnums=(0, 1) if donate else ())
      runners[f"{name}, {'donated' if donate else 'not donated'}"] = stateful_runner(
          step, (params, opt.init(params)))
  params = fresh()
  runners["dense ak.adam, donated"] = stateful_runner(
      jax.jit(dense_step, donate_argnums=(0, 1)), (params, dense_tx.init(params)))
  return runners


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="100000,1000000")
  parser.add_argument("--reps", type=int, default=15)
  args = parser.parse_args()
  sizes = [int(s) for s in args.sizes.split(",")]
  results = {n: {k: median_ms(v) for k, v in interleave(contenders(n), args.reps).items()}
             for n in sizes}
  names = list(next(iter(results.values())))
  print(table(f"one lazy step, k={K} ids x {D} float32, median ms", ["rows N", *names],
              [[f"{n:,}", *(results[n][k] for k in names)] for n in sizes]))


if __name__ == "__main__":
  main()
