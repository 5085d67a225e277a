"""A lazy sparse Adam step on a table row-sharded over 8 devices, against one device.

One step of ``ak.sparse_adam`` (``update`` + ``ak.apply_updates``, jitted, table and
state donated) on an ``(N, D)`` float32 table with ``k`` random ids, timed interleaved
(one step of each contender per round) and reported as medians:

* ``1 device``: the table on one CPU device, default backend (the C++ kernel when built);
* ``1 device, xla`` (``--with-xla``): the same with ``backend="xla"``;
* ``8 devices, routed``: the table sharded ``P("rows", None)`` over 8 CPU devices on a
  mesh with an Explicit axis: each device updates the rows it owns (adamkit/_row_sharded.py);
* ``8 devices, unrouted``: the same table with the routing switched off, i.e. XLA's own
  partitioning of the gathers and scatters (every device processes all k ids): the path
  of adamkit before issue 12;
* ``8 devices, Auto axes, routed``: the common code, ``Mesh(devices, ("rows",))`` (an
  Auto axis) and ``jax.jit`` of the step: routed with the split that ``init`` recorded
  from the concrete params;
* ``8 devices, Auto axes, unrouted``: the same with the record dropped (as after an
  ``init`` on abstract or traced params): XLA's partitioning, adamkit's path on Auto
  axes before issue 21.

The 8 "devices" are XLA:CPU host devices sharing this machine's cores, so the ratio
shows what routing saves in work per device, not a real 8-chip speed-up.

Run:  python benchmarks/bench_row_sharded.py [--rows 4000000] [--dim 64] [--k 4096]
      [--reps 30] [--with-xla] [--no-auto]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import adamkit as ak  # noqa: E402
from adamkit import _row_sharded  # noqa: E402


@contextlib.contextmanager
def unrouted():
  """adamkit without the row routing (the hooks see no row layout): XLA partitions the
  gathers and scatters itself. Only for this comparison."""
  saved = _row_sharded.row_layout
  _row_sharded.row_layout = lambda x: None
  try:
    yield
  finally:
    _row_sharded.row_layout = saved


def make_runner(table, ids, values, backend, routed=True):
  n = table.shape[0]
  tx = ak.sparse_adam(1e-3, backend=backend)

  def step(params, state, ids, values):
    grads = {"emb": ak.RowSparse.tree_unflatten(n, (ids, values))}
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates, backend=backend), state

  params = {"emb": table}
  state = tx.init(params)
  if not routed:  # Auto axes: no split recorded; Explicit axes: none read from the types
    state = _row_sharded.forget(state)
  with contextlib.nullcontext() if routed else unrouted():
    traced = jax.jit(step, donate_argnums=(0, 1)).trace(params, state, ids, values)
    compiled = traced.lower().compile()
  sharded = len(table.sharding.device_set) > 1
  assert ("shard_map" in str(traced.jaxpr)) == (routed and sharded), "routing not as named"
  return common.stateful_runner(compiled, (params, state), (ids, values))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, default=4_000_000)
  ap.add_argument("--dim", type=int, default=64)
  ap.add_argument("--k", type=int, default=4096)
  ap.add_argument("--reps", type=int, default=30)
  ap.add_argument("--with-xla", action="store_true")
  ap.add_argument("--no-auto", action="store_true", help="skip the two Auto-axes contenders")
  args = ap.parse_args()
  n, dim, k = args.rows - args.rows % 8, args.dim, args.k

  rng = np.random.default_rng(0)
  host = (0.01 * rng.standard_normal((n, dim))).astype(np.float32)
  ids = rng.integers(0, n, k).astype(np.int32)
  values = rng.standard_normal((k, dim)).astype(np.float32)

  one = jax.devices()[0]
  explicit = jax.make_mesh((8,), ("rows",), axis_types=(AxisType.Explicit,))
  auto = Mesh(np.array(jax.devices()[:8]), ("rows",))  # Auto axes: the common code

  def on_one():
    return jax.device_put(host, one), jax.device_put(ids, one), jax.device_put(values, one)

  def on_mesh(mesh):
    rows, rep = NamedSharding(mesh, P("rows", None)), NamedSharding(mesh, P())
    return jax.device_put(host, rows), jax.device_put(ids, rep), jax.device_put(values, rep)

  runners = {"1 device": make_runner(*on_one(), "auto")}
  if args.with_xla:
    runners["1 device, xla"] = make_runner(*on_one(), "xla")
  runners["8 devices, routed"] = make_runner(*on_mesh(explicit), "auto")
  runners["8 devices, unrouted"] = make_runner(*on_mesh(explicit), "auto", routed=False)
  if not args.no_auto:
    runners["8 devices, Auto axes, routed"] = make_runner(*on_mesh(auto), "auto")
    runners["8 devices, Auto axes, unrouted"] = make_runner(*on_mesh(auto), "auto",
                                                            routed=False)

  times = common.interleave(runners, args.reps)
  base = common.median_ms(times["1 device"])
  out = [[name, f"{common.median_ms(t):.2f}", f"{common.median_ms(t) / base:.2f}x"]
         for name, t in times.items()]
  print(common.table(f"lazy sparse_adam step, {n:,} x {dim} float32 table, k = {k} ids "
                     f"(median of {args.reps}, interleaved)",
                     ["contender", "ms", "vs 1 device"], out))
  # Communication of the routed step, per device and step (ids and rows arrive replicated):
  # the psum of the (k, dim) float32 row updates.
  print(f"routed step: all-reduce of k x dim x 4 = {k * dim * 4 / 2**20:.2f} MiB of row updates;"
        f" an id batch arriving sharded adds an all-gather of k x (4 + 4 dim) = "
        f"{k * (4 + 4 * dim) / 2**20:.2f} MiB")
  common.write_json("row_sharded", {"rows": n, "dim": dim, "k": k, "times_s": times})


if __name__ == "__main__":
  main()
