"""One shared suite over every dense optimizer of adamkit."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from registry import FLAT_STATE, NAMES, OFFLOADED, QUANTIZED, REGISTRY, SPARSE

import adamkit as ak
from adamkit import _quant


def same_layout(x, sharding):
  """``x`` is laid out over devices like ``sharding`` (whatever its memory kind)."""
  return x.sharding.with_memory_kind("device").is_equivalent_to(
      sharding.with_memory_kind("device"), x.ndim)


def make_params(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(0), 3)
  return {
      "conv": {"weight": jax.random.normal(k[0], (4, 2, 3, 3), dtype)},
      "bn": {"gamma": jnp.ones((4,), dtype), "beta": jnp.zeros((4,), dtype)},
      "head": [jax.random.normal(k[1], (8, 4), dtype), None],
      "bias": jax.random.normal(k[2], (4,), dtype),
  }


def make_grads(params, seed):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def run(tx, params, steps=3, jit=True):
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  for s in range(steps):
    updates, state = update(make_grads(params, s), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def assert_trees_close(a, b, rtol=1e-6, atol=1e-7):
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", NAMES)
def test_jit_equals_eager_with_none_leaves(name):
  params = make_params()
  eager_p, eager_s = run(REGISTRY[name](0.01), params, jit=False)
  jit_p, jit_s = run(REGISTRY[name](0.01), params, jit=True)
  assert eager_p["head"][1] is None and jit_p["head"][1] is None
  assert_trees_close(eager_p, jit_p)
  assert_trees_close(eager_s, jit_s)
  # and the params did move
  assert not np.allclose(np.asarray(jit_p["bias"]), np.asarray(params["bias"]))


ONE_PASS = [n for n in NAMES if isinstance(REGISTRY[n](0.01), ak.FusedStep)]


@pytest.mark.parametrize("name", ONE_PASS)
def test_one_pass_step_equals_update_and_apply(name):
  """Every optimizer with a one-pass ``step`` (the fused steps, every offloaded transform)
  trains through it, jitted with params and state donated, as through ``update`` +
  ``optax.apply_updates``."""
  params = make_params()
  want_p, want_s = run(REGISTRY[name](0.01), params)
  tx = REGISTRY[name](0.01)
  step = jax.jit(tx.step, donate_argnums=(0, 1))
  got_p, got_s = jax.tree.map(jnp.copy, params), tx.init(params)
  for s in range(3):
    got_p, got_s = step(got_p, got_s, grads=make_grads(params, s))
  assert_trees_close(got_p, want_p)
  assert_trees_close(got_s, want_s)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_dtypes_and_shapes_are_stable(name, dtype):
  params = make_params(dtype)
  tx = REGISTRY[name](0.01)
  state0 = tx.init(params)
  new_params, state = run(tx, params, steps=2)
  chex.assert_trees_all_equal_shapes_and_dtypes(state0, state)
  chex.assert_trees_all_equal_shapes_and_dtypes(params, new_params)


def _accumulate_outside(name, lr):
  return optax.MultiSteps(REGISTRY[name](lr), every_k_schedule=2)


def _accumulate_inside_offload(name, lr):
  inner, mode = OFFLOADED[name]
  return ak.offload(optax.MultiSteps(inner(lr), every_k_schedule=2).gradient_transformation(),
                    mode=mode)


# optax.MultiSteps around every optimizer; for the offloaded ones also inside the offload.
MULTISTEPS_CASES = [(n, "outside") for n in NAMES] + [(n, "inside_offload") for n in OFFLOADED]


@pytest.mark.parametrize("name", NAMES)
def test_inside_optax_chain(name):
  params = make_params()
  # chain with an optax link in front is accepted and changes the result
  chained = optax.chain(optax.clip(0.1), REGISTRY[name](0.01))
  p_chain, _ = run(chained, params, steps=2)
  p_plain, _ = run(REGISTRY[name](0.01), params, steps=2)
  assert not np.allclose(np.asarray(p_chain["bias"]), np.asarray(p_plain["bias"]))


@pytest.mark.parametrize("name,order", MULTISTEPS_CASES, ids=[f"{n}-{o}" for n, o in MULTISTEPS_CASES])
def test_multisteps(name, order):
  """MultiSteps(k=2) on grads g0, g1 == one step on their mean. Inside an offload in
  mode="compute" MultiSteps' lax.cond cannot be traced on the host: a clear error names
  mode="state" (documented in docs/offload.md)."""
  params = make_params()
  wrap = _accumulate_outside if order == "outside" else _accumulate_inside_offload
  ms = wrap(name, 0.01)
  state = ms.init(params)
  if order == "inside_offload" and OFFLOADED[name][1] == "compute":
    with pytest.raises(RuntimeError, match="Use mode='state'"):
      with jax.numpy_dtype_promotion("standard"):
        jax.jit(ms.update)(make_grads(params, 10), state, params)
    return
  p = params
  g0, g1 = make_grads(params, 10), make_grads(params, 11)
  for g in (g0, g1):
    with jax.numpy_dtype_promotion("standard"):  # optax.MultiSteps divides int by float
      u, state = jax.jit(ms.update)(g, state, p)
    p = optax.apply_updates(p, u)
  tx = REGISTRY[name](0.01)
  mean = jax.tree.map(lambda a, b: (a + b) / 2, g0, g1)
  u, _ = tx.update(mean, tx.init(params), params)
  assert_trees_close(p, optax.apply_updates(params, u), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_apply_if_finite_skips_nan_steps(name):
  params = make_params()
  tx = optax.apply_if_finite(REGISTRY[name](0.01), max_consecutive_errors=3)
  state = tx.init(params)
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), make_grads(params, 0))
  u, state2 = jax.jit(tx.update)(bad, state, params)
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(u))
  assert int(state2.notfinite_count) == 1
  chex.assert_trees_all_equal(state2.inner_state, state.inner_state)


def test_nonfinite_policy():
  params = make_params()
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), make_grads(params, 0))
  # default: NaN propagates, like optax and PyTorch
  tx = ak.adam(0.01)
  u, _ = tx.update(bad, tx.init(params), params)
  assert bool(jnp.isnan(u["bias"][0]))
  # "skip": the step is dropped and the state kept
  tx = ak.adam(0.01, nonfinite="skip")
  state = tx.init(params)
  u, state = tx.update(bad, state, params)
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(u))
  u, state = tx.update(make_grads(params, 1), state, params)
  assert float(jnp.max(jnp.abs(u["bias"]))) > 0


def test_inject_hyperparams_changes_lr_mid_run():
  params = make_params()
  tx = optax.inject_hyperparams(ak.adam)(learning_rate=0.01, b1=0.9)
  state = tx.init(params)
  g = make_grads(params, 0)
  u1, state = jax.jit(tx.update)(g, state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(0.03)
  u2, state = jax.jit(tx.update)(g, state, params)
  # same reference run with a per-step learning-rate list
  ref = ak.adam([0.01, 0.03])
  s = ref.init(params)
  r1, s = ref.update(g, s, params)
  r2, s = ref.update(g, s, params)
  assert_trees_close(u1, r1)
  assert_trees_close(u2, r2)


@pytest.mark.parametrize("name", NAMES)
def test_sharded_params_over_8_devices(name):
  assert jax.device_count() == 8
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  params = make_params()

  def spec(x):
    return P("data", "model") if x.ndim >= 2 and x.shape[0] % 4 == 0 and x.shape[1] % 2 == 0 \
        else P()

  shardings = jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), params)
  sharded = jax.device_put(params, shardings)
  tx = REGISTRY[name](0.01)
  state = tx.init(sharded)
  expected_kind = "pinned_host" if "offload" in name else "device"
  if name in QUANTIZED and name in FLAT_STATE:
    pass  # one flat buffer of codes for every leaf, laid out by XLA
  elif name in QUANTIZED:
    # codes and scales of the (4, 2, 3, 3) leaf: padded blocks (its last axis is no
    # multiple of the block), so they are replicated over the mesh, or, for a sparse
    # optimizer's table layout (blocks within rows), split by rows; tests/test_quantized.py
    # shards a leaf whose rows are whole blocks. Never on one device.
    born = [x for x in jax.tree.leaves(state, is_leaf=_quant.is_qarray)
            if _quant.is_qarray(x) and x.shape == (4, 2, 3, 3)]
    assert born and all((a.sharding.is_fully_replicated or name in SPARSE)
                        and len(a.sharding.device_set) == 8
                        and a.sharding.memory_kind == expected_kind
                        for x in born for a in (x.codes, x.scales))
  else:
    # moments are born with their param's sharding, not on one device
    born = [x for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (4, 2, 3, 3)]
    assert (name in FLAT_STATE) != bool(born and all(same_layout(x, shardings["conv"]["weight"])
                                                     for x in born))

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  p, s = sharded, state
  for i in range(2):
    p, s = step(p, s, jax.device_put(make_grads(params, i), shardings))
  ref_p, _ = run(REGISTRY[name](0.01), params, steps=2)
  assert_trees_close(p, ref_p, rtol=1e-5, atol=1e-6)
  for leaf, sharding in zip(jax.tree.leaves(p), jax.tree.leaves(shardings)):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
  if name in FLAT_STATE or name in QUANTIZED:
    return
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    adam_states = [x for x in jax.tree.leaves(s) if getattr(x, "shape", ()) == (4, 2, 3, 3)]
  assert adam_states and all(same_layout(x, shardings["conv"]["weight"]) for x in adam_states)
  assert all(x.sharding.memory_kind == expected_kind for x in adam_states)
