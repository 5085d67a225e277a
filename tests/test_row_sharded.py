"""A lazy sparse step on a table row-sharded over 8 devices: each shard updates its rows.

The routed path (adamkit/_row_sharded.py) must give the one-device numbers bit for bit,
including ids that pile onto one shard (several rounds), repeated ids, out-of-range ids
dropped inside jit, and never hold an (N, dim) array.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import adamkit as ak
from adamkit import _row_sharded

N, DIM, K = 4096, 8, 512


def _mesh(shape=(8,), names=("rows",)):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


def _ids(kind, rng):
  if kind == "uniform":
    return rng.integers(0, N, K)
  if kind == "one_shard":  # every id in the first shard: 512 ids > cap = 128, 4 rounds
    return rng.integers(0, N // 8, K)
  if kind == "repeats":
    return rng.integers(0, 40, K)
  return np.concatenate([rng.integers(0, N, K - 3), [-1, N, 5]])  # dropped inside jit


def _train(params, ids, values, tx, steps=2):
  @jax.jit
  def step(params, state, ids, values):
    grads = {"emb": ak.RowSparse.tree_unflatten(N, (ids, values))}
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates, backend="xla"), state

  state = tx.init(params)
  for _ in range(steps):
    params, state = step(params, state, ids, values)
  return params, state


@pytest.mark.parametrize("kind", ["uniform", "one_shard", "repeats", "bad_ids"])
@pytest.mark.parametrize("unique_ids", [False, True])
def test_sparse_adam_equals_one_device(kind, unique_ids):
  rng = np.random.default_rng(0)
  table = rng.standard_normal((N, DIM)).astype(np.float32)
  ids = _ids(kind, rng).astype(np.int32)
  if unique_ids:
    ids = np.unique(ids)
  values = rng.standard_normal((len(ids), DIM)).astype(np.float32)
  tx = ak.sparse_adam(0.1, weight_decay=0.01, unique_ids=unique_ids, backend="xla")
  mesh = _mesh()
  rows, rep = NamedSharding(mesh, P("rows", None)), NamedSharding(mesh, P())
  sharded = {"emb": jax.device_put(table, rows)}
  assert _row_sharded.row_layout(sharded["emb"]).num_shards == 8

  one = _train({"emb": jnp.asarray(table)}, ids, values, tx)
  eight = _train(sharded, jax.device_put(ids, rep), jax.device_put(values, rep), tx)
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(eight), strict=True):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
  assert eight[0]["emb"].sharding.is_equivalent_to(rows, 2)
  moments = [x for x in jax.tree.leaves(eight[1]) if x.shape == (N, DIM)]
  assert len(moments) == 2 and all(x.sharding.is_equivalent_to(rows, 2) for x in moments)
  moved = np.flatnonzero(np.any(np.asarray(eight[0]["emb"]) != table, axis=1))
  np.testing.assert_array_equal(moved, np.unique(ids[(ids >= 0) & (ids < N)]))


def test_two_axis_row_split_and_fused_op():
  """Rows split over both axes of a 2 x 4 mesh; the functional MindSpore op routes too."""
  rng = np.random.default_rng(1)
  mesh = _mesh((2, 4), ("data", "model"))
  rows = NamedSharding(mesh, P(("data", "model"), None))
  var = rng.standard_normal((N, DIM)).astype(np.float32)
  ids = rng.integers(0, N, K).astype(np.int32)
  grad = rng.standard_normal((K, DIM)).astype(np.float32)
  z = np.zeros_like(var)
  args = (0.9, 0.999, 0.1, 0.9, 0.999, 1e-8)
  one = jax.jit(ak.fused_sparse_lazy_adam)(var, z, z, *args, grad, ids)
  put = lambda x: jax.device_put(x, rows)  # noqa: E731
  assert _row_sharded.row_layout(put(var)).num_shards == 8
  eight = jax.jit(ak.fused_sparse_lazy_adam)(put(var), put(z), put(z), *args, grad, ids)
  for a, b in zip(one, eight):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_empty_gradient():
  mesh = _mesh()
  rows = NamedSharding(mesh, P("rows", None))
  tx = ak.sparse_adam(0.1, backend="xla")
  params = {"emb": jax.device_put(np.ones((N, DIM), np.float32), rows)}
  grads = {"emb": ak.RowSparse(np.zeros((0,), np.int32), np.zeros((0, DIM), np.float32), N)}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  new = jax.jit(ak.apply_updates)(params, updates)
  np.testing.assert_array_equal(np.asarray(new["emb"]), 1.0)


def test_no_table_sized_temporaries():
  """The compiled step holds no (N, dim) array beyond the donated table and moments: its
  scratch per device is far below one shard of the table."""
  mesh = _mesh()
  rows, rep = NamedSharding(mesh, P("rows", None)), NamedSharding(mesh, P())
  n = 1 << 16
  tx = ak.sparse_adam(0.1, backend="xla")
  params = {"emb": jax.device_put(np.zeros((n, DIM), np.float32), rows)}
  state = tx.init(params)

  def step(params, state, ids, values):
    updates, state = tx.update({"emb": ak.RowSparse.tree_unflatten(n, (ids, values))}, state,
                               params)
    return ak.apply_updates(params, updates, backend="xla"), state

  ids = jax.device_put(np.arange(K, dtype=np.int32) * 7, rep)
  values = jax.device_put(np.ones((K, DIM), np.float32), rep)
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, ids, values).compile()
  shard_bytes = n // 8 * DIM * 4
  assert compiled.memory_analysis().temp_size_in_bytes < shard_bytes / 2


def test_layout_detection():
  mesh = _mesh()
  put = lambda shape, spec: jax.device_put(np.zeros(shape), NamedSharding(mesh, spec))  # noqa: E731
  assert _row_sharded.row_layout(put((16, 16), P(None, "rows"))) is None  # columns split
  assert _row_sharded.row_layout(put((12, 2), P())) is None  # replicated
  assert _row_sharded.row_layout(jnp.zeros((16, 2))) is None  # one device
  layout = _row_sharded.row_layout(put((16, 2), P("rows")))
  assert layout.num_shards == 8 and layout.axes == "rows"


@pytest.mark.skipif(jax.default_backend() == "cpu" or jax.device_count() < 2,
                    reason="needs 2 or more GPU/TPU devices; on CPU the 8 host devices above "
                           "cover the same code")
def test_routed_step_on_accelerators():
  """On real accelerators (pure-JAX path, no C++ kernel) the routed step still equals one
  device, to float32 rounding (device FMA contraction may differ between programs)."""
  rng = np.random.default_rng(2)
  n_dev = jax.device_count()
  n = 512 * n_dev
  mesh = jax.make_mesh((n_dev,), ("rows",), axis_types=(AxisType.Explicit,))
  table = rng.standard_normal((n, DIM)).astype(np.float32)
  ids = rng.integers(0, n, K).astype(np.int32)
  values = rng.standard_normal((K, DIM)).astype(np.float32)
  tx = ak.sparse_adam(0.1)

  def train(params, ids, values):
    @jax.jit
    def step(params, state, ids, values):
      grads = {"emb": ak.RowSparse.tree_unflatten(n, (ids, values))}
      updates, state = tx.update(grads, state, params)
      return ak.apply_updates(params, updates), state
    return step(params, tx.init(params), ids, values)

  one = train({"emb": jax.device_put(table, jax.devices()[0])}, ids, values)
  rep = NamedSharding(mesh, P())
  sharded = {"emb": jax.device_put(table, NamedSharding(mesh, P("rows", None)))}
  many = train(sharded, jax.device_put(ids, rep), jax.device_put(values, rep))
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many), strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
