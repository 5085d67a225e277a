"""ak.multi_steps: gradient accumulation of dense and row-sparse gradients.

References: for sparse leaves, one ``ak.sparse_adam`` step on the averaged gradient (the
micro-steps' ids and values concatenated, values divided by k) and, for ``lazy=False``,
float64 NumPy Adam on the dense mean; for dense leaves, ``optax.MultiSteps``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import NumpyAdam
from registry import NAMES, REGISTRY
from test_suite import assert_trees_close, make_grads, make_params

import adamkit as ak

N, D, K, LR = 40, 3, 3, 0.05
IDS = ([3, 7, 3, 12], [7, 0, 39, 39], [12, 3, 21, 5])  # duplicates within and across steps


def _params():
  return {"emb": jnp.linspace(-1.0, 1.0, N * D).reshape(N, D), "w": jnp.linspace(0.5, 1.0, D)}


def _grads(step):
  ids = jnp.array(IDS[step % K])
  key = jax.random.key(step)
  return {"emb": ak.RowSparse(ids, jax.random.normal(key, (ids.shape[0], D)), N),
          "w": jax.random.normal(jax.random.fold_in(key, 1), (D,))}


def _mean(grads_seq):
  """The averaged gradient as one RowSparse: the concatenated ids and values / k."""
  k = len(grads_seq)
  ids = jnp.concatenate([g["emb"].indices for g in grads_seq])
  values = jnp.concatenate([g["emb"].values for g in grads_seq]) / k
  return {"emb": ak.RowSparse(ids, values, N), "w": sum(g["w"] for g in grads_seq) / k}


def _run(tx, params, grads_seq, state=None):
  state = tx.init(params) if state is None else state
  update = jax.jit(tx.update)
  for g in grads_seq:
    u, state = update(g, state, params)
    params = ak.apply_updates(params, u)
  return params, state


@pytest.mark.parametrize("lazy", [True, False])
def test_k_micro_steps_equal_one_step_on_the_mean(lazy):
  params = _params()
  inner = lambda: ak.sparse_adam(LR, lazy=lazy, weight_decay=0.01)  # noqa: E731
  tx = ak.multi_steps(inner(), K, ids_per_step={"emb": 4})
  grads = [_grads(s) for s in range(2 * K)]
  p, state = _run(tx, params, grads)
  # two gradient steps, each on the mean of its K micro-steps
  ref, _ = _run(inner(), params, [_mean(grads[:K]), _mean(grads[K:])])
  chex.assert_trees_all_close(p, ref, rtol=1e-6, atol=1e-7)
  assert int(state.gradient_step) == 2 and int(state.mini_step) == 0
  if lazy:  # only the rows some micro-step touched move
    touched = np.unique(np.concatenate(IDS))
    moved = np.flatnonzero(np.any(np.asarray(p["emb"]) != np.asarray(params["emb"]), axis=1))
    np.testing.assert_array_equal(moved, touched)


def test_non_lazy_equals_float64_dense_adam_on_the_dense_mean():
  params = _params()
  # eps comparable to the gradients: Adam's direction then depends on their scale (the mean)
  tx = ak.multi_steps(ak.sparse_adam(LR, eps=0.1, lazy=False), K, ids_per_step={"emb": 4})
  grads = [_grads(s) for s in range(2 * K)]
  p, _ = _run(tx, params, grads)
  ref = NumpyAdam(LR, eps=0.1)
  want = {k: np.asarray(v, np.float64) for k, v in params.items()}
  for block in (grads[:K], grads[K:]):
    mean = {"emb": sum(np.asarray(g["emb"].todense(), np.float64) for g in block) / K,
            "w": sum(np.asarray(g["w"], np.float64) for g in block) / K}
    want = ref.step(want, mean)
  for name in want:
    np.testing.assert_allclose(np.asarray(p[name]), want[name], rtol=2e-5, atol=2e-6)


def test_between_gradient_steps_nothing_moves():
  params = _params()
  tx = ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step={"emb": 4})
  assert isinstance(tx, optax.GradientTransformationExtraArgs) and tx.gradient_transformation() is tx
  state = tx.init(params)
  for s in range(K - 1):
    u, new_state = jax.jit(tx.update)(_grads(s), state, params)
    assert not bool(tx.has_updated(new_state))
    # a RowSparse that addresses no row, and zeros; the inner state is untouched
    assert isinstance(u["emb"], ak.RowSparse)
    np.testing.assert_array_equal(u["emb"].indices, np.full(u["emb"].indices.shape, N))
    assert float(jnp.max(jnp.abs(u["emb"].values))) == 0.0 and float(jnp.max(jnp.abs(u["w"]))) == 0
    chex.assert_trees_all_equal(new_state.inner_opt_state, state.inner_opt_state)
    np.testing.assert_array_equal(ak.apply_updates(params, u)["emb"], params["emb"])
    state = new_state
  u, state = jax.jit(tx.update)(_grads(K - 1), state, params)
  assert bool(tx.has_updated(state))
  # the accumulator is empty again after the gradient step
  np.testing.assert_array_equal(state.acc_grads["emb"].indices, np.full((K * 4,), N))
  assert float(jnp.max(jnp.abs(state.acc_grads["emb"].values))) == 0.0


def test_fewer_ids_than_declared_and_sum():
  params = _params()
  grads = [_grads(s) for s in range(K)]
  grads[1] = {"emb": ak.RowSparse(jnp.array([1, 1]), jnp.ones((2, D)), N), "w": grads[1]["w"]}
  tx = ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step={"emb": 4}, use_grad_mean=False)
  p, _ = _run(tx, params, grads)
  total = _mean(grads)
  total = {"emb": total["emb"].with_values(total["emb"].values * K), "w": total["w"] * K}
  ref, _ = _run(ak.sparse_adam(LR), params, [total])
  chex.assert_trees_all_close(p, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("use_grad_mean", [True, False])
@pytest.mark.parametrize("schedule", [2, lambda step: jnp.where(step < 1, 2, 3)], ids=["int", "fn"])
def test_dense_leaves_equal_optax_multisteps(schedule, use_grad_mean):
  params = {"a": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.ones(4, jnp.bfloat16)}
  leaves, treedef = jax.tree.flatten(params)
  grads = [treedef.unflatten([jax.random.normal(jax.random.key(10 * s + i), x.shape, x.dtype)
                              for i, x in enumerate(leaves)]) for s in range(7)]
  ours = ak.multi_steps(ak.adam(LR, weight_decay=0.01), schedule, use_grad_mean=use_grad_mean)
  theirs = optax.MultiSteps(ak.adam(LR, weight_decay=0.01), schedule, use_grad_mean=use_grad_mean)
  p, s = _run(ours, params, grads)
  with jax.numpy_dtype_promotion("standard"):  # optax.MultiSteps divides by an int
    q, t = _run(theirs, params, grads)
  chex.assert_trees_all_close(p, q, rtol=1e-6, atol=1e-7)
  assert (int(s.mini_step), int(s.gradient_step)) == (int(t.mini_step), int(t.gradient_step))
  chex.assert_trees_all_close(s.acc_grads, t.acc_grads, rtol=1e-6, atol=1e-7)
  assert bool(ours.has_updated(s)) == bool(theirs.has_updated(t))


@pytest.mark.parametrize("name", NAMES)
def test_every_registry_optimizer_dense(name):
  """k = 2 micro-steps == one step on the mean, for every registry optimizer (the
  offloaded ones included: ak.multi_steps goes outside ak.offload, optax.MultiSteps cannot)."""
  params = make_params()
  g0, g1 = make_grads(params, 10), make_grads(params, 11)
  p, _ = _run(ak.multi_steps(REGISTRY[name](0.01), 2), params, [g0, g1])
  tx = REGISTRY[name](0.01)
  u, _ = jax.jit(tx.update)(jax.tree.map(lambda a, b: (a + b) / 2, g0, g1), tx.init(params), params)
  assert_trees_close(p, optax.apply_updates(params, u), rtol=1e-5, atol=1e-6)


def test_one_compilation_over_many_micro_steps():
  params = _params()
  tx = ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step={"emb": 4})

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates), state

  state = tx.init(params)
  for s in range(3 * K + 1):
    params, state = step(params, state, _grads(s))
  assert step._cache_size() == 1
  chex.clear_trace_counter()
  # eval_shape init (abstract params) gives the same state shapes
  abstract = jax.eval_shape(tx.init, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params()))
  chex.assert_trees_all_equal_shapes_and_dtypes(abstract, tx.init(_params()))


def test_skip_function_drops_a_micro_step():
  params = _params()
  grads = [_grads(s) for s in range(K)]
  bad = {"emb": grads[0]["emb"].with_values(grads[0]["emb"].values.at[0, 0].set(jnp.nan)),
         "w": grads[0]["w"]}
  tx = ak.multi_steps(ak.sparse_adam(LR, weight_decay=0.1), K, ids_per_step={"emb": 4},
                      should_skip_update_fn=optax.skip_not_finite)
  p, state = _run(tx, params, [grads[0], bad, *grads[1:]])
  ref, _ = _run(ak.sparse_adam(LR, weight_decay=0.1), params, [_mean(grads)])
  chex.assert_trees_all_close(p, ref, rtol=1e-6, atol=1e-7)
  assert int(state.skip_state["num_not_finite"]) == 0  # the last micro-step was finite


def test_million_row_table_builds_no_dense_gradient():
  """1M x 8 table, k = 4: the jitted micro-step's scratch is O(k n D), never (N, D)."""
  n_rows, d, k, n = 1_000_000, 8, 4, 64
  params = {"emb": jnp.zeros((n_rows, d)), "w": jnp.ones(d)}
  tx = ak.multi_steps(ak.sparse_adam(0.01), k, ids_per_step={"emb": n})

  def step(params, state, ids, values):
    grads = {"emb": ak.RowSparse(ids, values, n_rows), "w": jnp.ones(d)}
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates), state

  state = tx.init(params)
  assert state.acc_grads["emb"].values.shape == (k * n, d)
  jstep = jax.jit(step, donate_argnums=(0, 1))
  ids, values = jnp.arange(n) * 15_000, jnp.ones((n, d))
  compiled = jstep.lower(params, state, ids, values).compile()
  mem = compiled.memory_analysis()
  if mem is not None:  # the table is 32 MB; the step's scratch must be tiny
    assert mem.temp_size_in_bytes < n_rows * d * 4 // 50, mem.temp_size_in_bytes
    # table, m and v are updated in place: their outputs alias the donated inputs
    assert mem.alias_size_in_bytes >= 3 * n_rows * d * 4, mem.alias_size_in_bytes
  for _ in range(k):
    params, state = jstep(params, state, ids, values)
  moved = np.flatnonzero(np.any(np.asarray(params["emb"]) != 0, axis=1))
  np.testing.assert_array_equal(moved, np.asarray(ids))


def test_outside_offload_equals_plain():
  params = _params()
  grads = [_grads(s) for s in range(2 * K)]
  tx = ak.multi_steps(ak.offload(ak.sparse_adam(LR), mode="state"), K, ids_per_step={"emb": 4})
  p, state = _run(tx, params, grads)
  ref, _ = _run(ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step={"emb": 4}), params, grads)
  chex.assert_trees_all_close(p, ref, rtol=1e-6, atol=1e-7)
  # the moments stay in host memory; 0-d leaves (the count) stay on the device (ak.offload)
  leaves = jax.tree.leaves(state.inner_opt_state)
  assert {x.sharding.memory_kind for x in leaves if x.ndim} == {"pinned_host"}
  assert {x.sharding.memory_kind for x in leaves if not x.ndim} == {"device"}


@pytest.mark.parametrize("mode", ["state", "compute"])
def test_dense_accumulation_outside_offload_both_modes(mode):
  """Where optax.MultiSteps outside ak.offload fails (its lax.cond mixes host and device
  scalars), ak.multi_steps works, with optax.MultiSteps's numbers."""
  params = {"w": jnp.linspace(-1.0, 1.0, 4)}
  grads = [{"w": jnp.full(4, float(s + 1))} for s in range(4)]
  p, _ = _run(ak.multi_steps(ak.offload(ak.adam(LR), mode=mode), 2), params, grads)
  with jax.numpy_dtype_promotion("standard"):
    q, _ = _run(optax.MultiSteps(ak.adam(LR), 2), params, grads)
  chex.assert_trees_all_close(p, q, rtol=1e-6, atol=1e-7)


def test_errors_name_the_way():
  params = _params()
  g = _grads(0)
  with pytest.raises(TypeError, match=r"ids_per_step=\{'emb': 4\}"):
    tx = ak.multi_steps(ak.sparse_adam(LR), K)
    tx.update(g, tx.init(params), params)
  with pytest.raises(ValueError, match="more than ids_per_step"):
    tx = ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step={"emb": 3})
    tx.update(g, tx.init(params), params)
  with pytest.raises(TypeError, match="dense gradient"):
    tx = ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step={"emb": 4})
    tx.update({"emb": g["emb"].todense(), "w": g["w"]}, tx.init(params), params)
  with pytest.raises(ValueError, match=r"not leaves of the params"):
    ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step={"embed": 4}).init(params)
  with pytest.raises(TypeError, match="must be an int with `ids_per_step`"):
    ak.multi_steps(ak.sparse_adam(LR), lambda s: 2, ids_per_step={"emb": 4})
  with pytest.raises(ValueError, match="every_k_schedule"):
    ak.multi_steps(ak.adam(LR), 0)
  with pytest.raises(TypeError, match="every_k_schedule"):
    ak.multi_steps(ak.adam(LR), 2.0)
  with pytest.raises(ValueError, match=r"ids_per_step\['emb'\]"):
    ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step={"emb": 0})
  with pytest.raises(TypeError, match="ids_per_step"):
    ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step=4)
  with pytest.raises(TypeError, match="`tx`"):
    ak.multi_steps(ak.fused_adam(LR).step, K)  # a step function, not a transform
  # inside ak.offload the rows are renumbered per micro-step: the error names the way
  tx = ak.offload(ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step={"emb": 4}), mode="state")
  with pytest.raises(TypeError, match=r"ak\.multi_steps\(ak\.offload\(tx"):
    tx.update(g, tx.init(params), params)


def test_state_dict_round_trip_names_the_buffer():
  params = _params()
  tx = ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step={"emb": 4})
  _, state = _run(tx, params, [_grads(0)])
  flat = ak.state_dict(state, params)
  assert {"state.acc_grads.emb.indices", "state.acc_grads.emb.values", "emb.moment1",
          "state.mini_step"} <= set(flat)
  np.testing.assert_array_equal(flat["state.acc_grads.emb.indices"][:4], IDS[0])
  restored = ak.load_state_dict(flat, tx.init(params))
  chex.assert_trees_all_equal(restored, state)
  # resumes: the rest of the gradient step from the restored state == uninterrupted
  rest = [_grads(s) for s in range(1, K)]
  chex.assert_trees_all_equal(_run(tx, params, rest, restored)[0], _run(tx, params, rest, state)[0])


def test_optax_multisteps_refuses_row_sparse():
  """optax.MultiSteps maps over (updates, zeros_like(params)): JAX refuses the RowSparse
  node against the dense table before any adamkit code runs (documented)."""
  params = _params()
  tx = optax.MultiSteps(ak.sparse_adam(LR), K)
  with jax.numpy_dtype_promotion("standard"):
    with pytest.raises(ValueError, match="RowSparse"):
      jax.jit(tx.update)(_grads(0), tx.init(params), params)


nnx = pytest.importorskip("flax.nnx")


class _Tower(nnx.Module):
  def __init__(self, rngs):
    self.embedding = nnx.Param(jax.random.normal(rngs.params(), (N, D)))
    self.w = nnx.Param(jnp.ones(D))

  def __call__(self, ids):
    return ak.lookup(self.embedding, ids) @ self.w[...]


def test_nnx_optimizer_accumulates_sparse_gradients():
  batches = [(jnp.array(ids), jnp.linspace(-1.0, 1.0, 4) * (s + 1)) for s, ids in enumerate(IDS)]
  model = _Tower(nnx.Rngs(0))
  start = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  tx = lambda: ak.multi_steps(ak.sparse_adam(LR), K, ids_per_step={"embedding": 4})  # noqa: E731
  opt = nnx.Optimizer(model, tx(), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, ids, y):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    pure = lambda p: jnp.mean((nnx.merge(graphdef, p, rest, copy=True)(ids) - y) ** 2)  # noqa: E731
    _, grads = ak.value_and_sparse_grad(pure)(params, {"embedding": ids})
    opt.update(model, grads)

  for ids, y in batches:
    step(model, opt, ids, y)
  got = nnx.to_pure_dict(nnx.state(model, nnx.Param))

  def loss(p, ids, y):
    return jnp.mean((ak.lookup(p["embedding"], ids) @ p["w"] - y) ** 2)

  grads = [ak.value_and_sparse_grad(loss)(start, {"embedding": ids}, ids, y)[1]
           for ids, y in batches]
  mean = {"embedding": ak.RowSparse(
      jnp.concatenate([g["embedding"].indices for g in grads]),
      jnp.concatenate([g["embedding"].values for g in grads]) / K, N),
      "w": sum(g["w"] for g in grads) / K}
  ref, _ = _run(ak.sparse_adam(LR), start, [mean])
  chex.assert_trees_all_close(got, ref, rtol=1e-6, atol=1e-7)
