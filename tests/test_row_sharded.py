"""A lazy sparse step on a table row-sharded over 8 devices: each shard updates its rows.

The routed path (adamkit/_row_sharded.py) must give the one-device numbers bit for bit,
including ids that pile onto one shard (several rounds), repeated ids, out-of-range ids
dropped inside jit, and never hold an (N, dim) array. On meshes with Auto axes a jitted
step routes with the split recorded at init (the jaxpr holds the shard_map), and keeps
XLA's partitioning where init saw no split (abstract or traced params) or the state has
left the recorded mesh. Quantized moments (blocks within rows) route the same way: their
codes and scales are split like the table, and each shard requantizes its rows into the
one-device codes, the 4-bit dither keyed on the rows' global ids.
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


def _mesh(shape=(8,), names=("rows",), axis_type=AxisType.Explicit):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


# Moment formats: float32, and quantized (mu and nu; blocks of 4 or one 8-element block per
# row; a 4-bit mu with a float nu).
MOMENTS = {
    "float": {},
    "8bit": dict(mu_dtype=ak.Quantized("8bit", block_size=4, min_size=0),
                 nu_dtype=ak.Quantized("8bit", block_size=4, min_size=0)),
    "4bit": dict(mu_dtype=ak.Quantized("4bit", block_size=8, min_size=0),
                 nu_dtype=ak.Quantized("4bit", block_size=8, min_size=0)),
    "4bit_mu": dict(mu_dtype=ak.Quantized("4bit", block_size=4, min_size=0)),
}


def _routed(fn, *args) -> bool:
  """Whether jitted ``fn`` on ``args`` runs the per-device lazy step: a shard_map with the
  psum of the update rows (on Explicit axes the row scatter of ak.apply_updates is a
  shard_map too, without a psum)."""
  jaxpr = str(jax.jit(fn).trace(*args).jaxpr)
  return "shard_map" in jaxpr and "psum" in jaxpr


def _moment_arrays(state):
  """The arrays of the state's moments that lead with the table's rows (codes and scales of
  quantized moments)."""
  return [x for x in jax.tree.leaves(state) if x.ndim and x.shape[0] == N]


def _step(tx, n=N):
  def step(params, state, ids, values):
    grads = {"emb": ak.RowSparse.tree_unflatten(n, (ids, values))}
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates, backend="xla"), state
  return step


def _ids(kind, rng):
  if kind == "uniform":
    return rng.integers(0, N, K)
  if kind == "one_shard":  # every id in the first shard: 512 ids > cap = 128, 4 rounds
    return rng.integers(0, N // 8, K)
  if kind == "repeats":
    return rng.integers(0, 40, K)
  return np.concatenate([rng.integers(0, N, K - 3), [-1, N, 5]])  # dropped inside jit


def _train(params, ids, values, tx, steps=2, state=None):
  step = jax.jit(_step(tx))
  state = tx.init(params) if state is None else state
  for _ in range(steps):
    params, state = step(params, state, ids, values)
  return params, state


def _assert_same(a, b, ulp=0, start=None):
  """Bit for bit; with ``ulp``, float arrays within ``ulp`` float32 ulps of the largest
  magnitude summed into each element (its value in either tree, and in ``start``, the
  table before training, where the shapes agree: a param that cancels to near zero may
  differ by an ulp of what it started from). Integer arrays, the codes of quantized
  moments, still bit for bit."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    if ulp and np.issubdtype(x.dtype, np.floating):
      big = np.maximum(np.abs(x), np.abs(y))
      if start is not None and np.shape(start) == x.shape:
        big = np.maximum(big, np.abs(start))
      err = np.abs(y.astype(np.float64) - x) / np.spacing(big.astype(x.dtype))
      assert err.max(initial=0) <= ulp, f"{err.max()} ulps of the largest term (at most {ulp})"
    else:
      np.testing.assert_array_equal(y, x)


# XLA on CPU contracts ``a * b + c`` into FMAs as each program's fusions allow. Float
# moments step the same fusions on one device and routed, bit for bit; quantized ones
# (gather, dequantize, step, requantize: the new row feeds the update and its block's
# maximum) may round an element differently in the last bit (on jax 0.12, 2 ulps of the
# table's starting value in the params after two steps, which is 128 ulps of a param that
# cancels to 0.0016), so params and scales are compared to 4 ulps of the largest value
# summed into them, the codes exactly (the 4-bit dither never reads a value's bits).
ULPS = {"float": 0, "8bit": 4, "4bit": 4, "4bit_mu": 4}


@pytest.mark.parametrize("moments", ["float", "8bit", "4bit"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("kind", ["uniform", "one_shard", "repeats", "bad_ids"])
@pytest.mark.parametrize("unique_ids", [False, True])
def test_sparse_adam_equals_one_device(kind, unique_ids, axis_type, moments):
  """Same table, moments (codes and scales bit for bit) as one device; untouched rows keep
  their bits; the table and every moment array stay split by rows."""
  rng = np.random.default_rng(0)
  table = rng.standard_normal((N, DIM)).astype(np.float32)
  ids = _ids(kind, rng).astype(np.int32)
  if unique_ids:
    ids = np.unique(ids)
  values = rng.standard_normal((len(ids), DIM)).astype(np.float32)
  tx = ak.sparse_adam(0.1, weight_decay=0.01, unique_ids=unique_ids, backend="xla",
                      **MOMENTS[moments])
  mesh = _mesh(axis_type=axis_type)
  rows, rep = NamedSharding(mesh, P("rows", None)), NamedSharding(mesh, P())
  sharded = {"emb": jax.device_put(table, rows)}
  assert _row_sharded.row_layout(sharded["emb"]).num_shards == 8
  batch = jax.device_put(ids, rep), jax.device_put(values, rep)
  assert _routed(_step(tx), sharded, tx.init(sharded), *batch)

  one = _train({"emb": jnp.asarray(table)}, ids, values, tx)
  eight = _train(sharded, *batch, tx)
  _assert_same(one, eight, ULPS[moments], start=table)
  assert eight[0]["emb"].sharding.is_equivalent_to(rows, 2)
  arrays = _moment_arrays(eight[1])
  assert len(arrays) == (2 if moments == "float" else 4)
  assert all(x.sharding.is_equivalent_to(NamedSharding(mesh, P("rows")), x.ndim) for x in arrays)
  touched = np.unique(ids[(ids >= 0) & (ids < N)])
  moved = np.flatnonzero(np.any(np.asarray(eight[0]["emb"]) != table, axis=1))
  np.testing.assert_array_equal(moved, touched)
  untouched = np.setdiff1d(np.arange(N), touched)
  for new, old in zip(arrays, _moment_arrays(tx.init({"emb": jnp.asarray(table)})), strict=True):
    np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(old)[untouched])


def _auto_table(rng, shape=(8,), names=("rows",)):
  mesh = _mesh(shape, names, AxisType.Auto)
  axes = names if len(names) > 1 else names[0]
  rows, rep = NamedSharding(mesh, P(axes, None)), NamedSharding(mesh, P())
  table = rng.standard_normal((N, DIM)).astype(np.float32)
  ids = rng.integers(0, N, K).astype(np.int32)
  values = rng.standard_normal((K, DIM)).astype(np.float32)
  return table, {"emb": jax.device_put(table, rows)}, (jax.device_put(ids, rep),
                                                       jax.device_put(values, rep))


@pytest.mark.parametrize("moments", ["float", "4bit_mu"])
def test_auto_axes_two_axis_split_and_one_trace(moments):
  """Rows over both Auto axes of a 2 x 4 mesh; the split is static data of the state: the
  second step reuses the first's trace."""
  rng = np.random.default_rng(3)
  table, sharded, batch = _auto_table(rng, (2, 4), ("data", "model"))
  tx = ak.sparse_adam(0.1, weight_decay=0.01, nesterov=True, backend="xla", **MOMENTS[moments])
  state = tx.init(sharded)
  traces = []
  step = jax.jit(lambda *a: traces.append(1) or _step(tx)(*a))
  assert _routed(_step(tx), sharded, state, *batch)
  params = sharded
  for _ in range(3):
    params, state = step(params, state, *batch)
  assert len(traces) == 1
  _assert_same(_train({"emb": jnp.asarray(table)}, *batch, tx, steps=3), (params, state),
               ULPS[moments], start=table)


def test_auto_axes_split_unknown_at_init_keeps_xla():
  """Params traced or abstract at init leave no record: XLA partitions the step, with the
  same numbers. A ShapeDtypeStruct carrying the sharding records it (a restore target)."""
  rng = np.random.default_rng(4)
  table, sharded, batch = _auto_table(rng)
  tx = ak.sparse_adam(0.1, backend="xla")
  one = _train({"emb": jnp.asarray(table)}, *batch, tx)
  for state in (jax.jit(tx.init)(sharded), jax.eval_shape(tx.init, sharded)):
    assert not any(_row_sharded.is_split(x) for x in
                   jax.tree.leaves(state, is_leaf=_row_sharded.is_split))
  state = jax.jit(tx.init)(sharded)
  assert not _routed(_step(tx), sharded, state, *batch)
  _assert_same(one, _train(sharded, *batch, tx, state=state))

  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          sharded)
  assert jax.tree.structure(tx.init(abstract)) == jax.tree.structure(tx.init(sharded))


def test_auto_axes_state_off_its_mesh_keeps_xla():
  """A routed state whose arrays now live elsewhere (made afresh on one device, or on
  another mesh) is not routed: the step runs where its arrays are."""
  rng = np.random.default_rng(5)
  table, sharded, batch = _auto_table(rng)
  tx = ak.sparse_adam(0.1, backend="xla")
  state = tx.init(sharded)
  one = _train({"emb": jnp.asarray(table)}, *batch, tx)
  dev = jax.devices()[0]
  params, state, batch = jax.tree.map(lambda x: jax.device_put(np.asarray(x), dev),
                                      (sharded, state, batch))
  assert not _routed(_step(tx), params, state, *batch)
  _assert_same(one, _train(params, *batch, tx, state=state))

  other = _mesh((2, 4), ("a", "b"), AxisType.Auto)
  put = lambda x: jax.device_put(np.asarray(x), NamedSharding(  # noqa: E731
      other, P(("a", "b")) if np.ndim(x) else P()))
  params, state = jax.tree.map(put, (sharded, tx.init(sharded)))
  assert not _routed(_step(tx), params, state, *batch)


def test_auto_axes_groups_checkpoints_and_offload(tmp_path):
  """The record survives parameter groups, ak.state_dict / ak.load_state_dict and an orbax
  restore into a fresh init; checkpoints do not depend on it; an offloaded state (host
  memory) carries none."""
  ocp = pytest.importorskip("orbax.checkpoint")
  rng = np.random.default_rng(6)
  table, sharded, batch = _auto_table(rng)
  rep = NamedSharding(sharded["emb"].sharding.mesh, P())
  params = {**sharded, "w": jax.device_put(jnp.ones(3), rep)}
  tx = ak.sparse_adam(0.1, groups=[ak.Group("w", lr=0.01)], backend="xla")

  def step(params, state, ids, values):
    grads = {"emb": ak.RowSparse.tree_unflatten(N, (ids, values)), "w": jnp.ones(3)}
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates, backend="xla"), state

  state = tx.init(params)
  assert _routed(step, params, state, *batch)
  one_p = {"emb": jnp.asarray(table), "w": jnp.ones(3)}
  one = jax.jit(step)(one_p, tx.init(one_p), *batch)
  params, state = jax.jit(step)(params, state, *batch)  # every leaf on the mesh now
  _assert_same(one, (params, state))
  one = jax.jit(step)(*one, *batch)

  flat = ak.state_dict(state)
  assert all(name.endswith(("moment1", "moment2", "step")) or name.startswith("state.")
             for name in flat)
  restored = ak.load_state_dict(flat, tx.init(params))
  assert jax.tree.structure(restored) == jax.tree.structure(state)

  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "routed", state)
  ckptr.wait_until_finished()
  # The structure of an init that saw no split, the placement of the live state.
  unrouted = jax.tree.structure(jax.eval_shape(tx.init, params)).unflatten(
      jax.tree.leaves(state))
  for like in (state, unrouted):  # either record restores from the same files
    back = ckptr.restore(tmp_path / "routed", jax.tree.map(ocp.utils.to_shape_dtype_struct, like))
    assert jax.tree.structure(back) == jax.tree.structure(like)
    assert _routed(step, params, back, *batch) == (like is state)
    _assert_same(one, jax.jit(step)(params, back, *batch))

  off = ak.offload(ak.sparse_adam(0.1, backend="xla"), mode="state").init(sharded)
  assert not any(_row_sharded.is_split(x)
                 for x in jax.tree.leaves(off, is_leaf=_row_sharded.is_split))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_amsgrad_keeps_xla(axis_type):
  """AMSGrad's three buffers (quantized here) are not routed: XLA partitions the step, with
  the one-device numbers."""
  rng = np.random.default_rng(7)
  mesh = _mesh(axis_type=axis_type)
  rows, rep = NamedSharding(mesh, P("rows", None)), NamedSharding(mesh, P())
  table = rng.standard_normal((N, DIM)).astype(np.float32)
  ids = rng.integers(0, N, K).astype(np.int32)
  values = rng.standard_normal((K, DIM)).astype(np.float32)
  tx = ak.sparse_adam(0.1, amsgrad=True, backend="xla", **MOMENTS["8bit"])
  sharded = {"emb": jax.device_put(table, rows)}
  batch = jax.device_put(ids, rep), jax.device_put(values, rep)
  assert not _routed(_step(tx), sharded, tx.init(sharded), *batch)
  _assert_same(_train({"emb": jnp.asarray(table)}, ids, values, tx), _train(sharded, *batch, tx))


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


@pytest.mark.parametrize("moments", ["float", "8bit"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_no_table_sized_temporaries(axis_type, moments):
  """The compiled step holds no (N, dim) array beyond the donated table and moments: its
  scratch per device is far below one shard of the table."""
  mesh = _mesh(axis_type=axis_type)
  rows, rep = NamedSharding(mesh, P("rows", None)), NamedSharding(mesh, P())
  n = 1 << 16
  tx = ak.sparse_adam(0.1, backend="xla", **MOMENTS[moments])
  params = {"emb": jax.device_put(np.zeros((n, DIM), np.float32), rows)}
  state = tx.init(params)

  def step(params, state, ids, values):
    updates, state = tx.update({"emb": ak.RowSparse.tree_unflatten(n, (ids, values))}, state,
                               params)
    return ak.apply_updates(params, updates, backend="xla"), state

  ids = jax.device_put(np.arange(K, dtype=np.int32) * 7, rep)
  values = jax.device_put(np.ones((K, DIM), np.float32), rep)
  assert _routed(step, params, state, ids, values)
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
