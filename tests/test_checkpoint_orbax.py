"""orbax-checkpoint save / restore of params + adamkit state: resuming is bit-identical."""

import warnings

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import adamkit as ak

ocp = pytest.importorskip("orbax.checkpoint")

N_ROWS = 50
# quantized formats small enough for these leaves (200 elements at most)
Q8 = ak.Quantized("8bit", block_size=64, min_size=0)
Q4 = ak.Quantized("4bit", block_size=64, min_size=0)


def _params():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return {"emb": 0.1 * jax.random.normal(k1, (N_ROWS, 4)),
          "fc": {"weight": jax.random.normal(k2, (4, 3)), "bias": jnp.zeros(3)},
          "bn": {"gamma": jnp.ones(3), "beta": jnp.zeros(3)},
          "out": 0.5 * jax.random.normal(k3, (3,))}


def _batches(n):
  keys = jax.random.split(jax.random.key(1), n)
  return [(jax.random.randint(k, (16,), 0, N_ROWS), jax.random.normal(k, (16,))) for k in keys]


def _loss(params, ids, y):
  x = ak.lookup(params["emb"], ids)
  h = jnp.tanh(x @ params["fc"]["weight"] + params["fc"]["bias"])
  h = h * params["bn"]["gamma"] + params["bn"]["beta"]
  return jnp.mean((h @ params["out"] - y) ** 2)


def _dense_step(tx):
  @jax.jit
  def step(params, state, ids, y):
    grads = jax.grad(_loss)(params, ids, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def _sparse_step(tx):
  grad_fn = ak.value_and_sparse_grad(_loss)

  @jax.jit
  def step(params, state, ids, y):
    _, grads = grad_fn(params, {"emb": ids}, ids, y)
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates), state
  return step


CASES = {
    "adam_groups_schedule": (lambda: ak.adam(
        optax.exponential_decay(0.05, 3, 0.7), weight_decay=0.01,
        groups=[ak.Group("fc.*", lr_scale=0.5, b2=0.99)]), _dense_step),
    "adamax": (lambda: ak.adamax(0.05, weight_decay=0.01), _dense_step),
    "sparse_adam_lazy": (lambda: ak.sparse_adam(0.05, weight_decay=0.01), _sparse_step),
    "sparse_adam_dense_rows": (lambda: ak.sparse_adam(0.05, lazy=False), _sparse_step),
    "offload_state": (lambda: ak.offload(ak.adam(0.05, weight_decay=0.01), mode="state"),
                      _dense_step),
    "adam_offload_compute": (lambda: ak.adam_offload(0.05, weight_decay=0.01), _dense_step),
    "offload_sparse_state": (lambda: ak.offload(ak.sparse_adam(0.05, weight_decay=0.01),
                                                mode="state"), _sparse_step),
    # quantized moments (issue 19): codes and scales saved and restored as they are
    "adamw_8bit_4bit_groups": (lambda: ak.adamw(
        optax.exponential_decay(0.05, 3, 0.7), amsgrad=True, mu_dtype=Q8, nu_dtype=Q4,
        groups=[ak.Group("fc.*", lr_scale=0.5, b2=0.99)]), _dense_step),
    "offload_8bit_state": (lambda: ak.offload(ak.adam(0.05, mu_dtype=Q8, nu_dtype=Q8),
                                              mode="state"), _dense_step),
}


def _save_restore(path, tree, like):
  """Saves ``tree`` with orbax, restores it into the structure and shardings of ``like``."""
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, tree)
  ckptr.wait_until_finished()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  return ckptr.restore(path, abstract)


@pytest.mark.parametrize("case", sorted(CASES))
def test_orbax_resume_is_bit_identical(case, tmp_path):
  make_tx, make_step = CASES[case]
  tx = make_tx()
  step = make_step(tx)
  batches = _batches(8)
  params = _params()
  state = tx.init(params)
  for ids, y in batches[:4]:
    params, state = step(params, state, ids, y)

  # The restore target comes from a fresh init: only shapes, dtypes and placement matter.
  fresh = {"params": _params(), "opt_state": tx.init(_params())}
  restored = _save_restore(tmp_path / "ckpt", {"params": params, "opt_state": state}, fresh)
  chex.assert_trees_all_equal_structs(restored["opt_state"], state)
  chex.assert_trees_all_equal_dtypes(restored, {"params": params, "opt_state": state})
  chex.assert_trees_all_equal(restored, {"params": params, "opt_state": state})
  kinds = lambda t: [x.sharding.memory_kind for x in jax.tree.leaves(t)]  # noqa: E731
  assert kinds(restored["opt_state"]) == kinds(state)  # offloaded state stays on the host

  raw = restored["opt_state"]
  if "offload" in case:
    # orbax gives host-placed arrays a device type; ak.offload_state copies them to host
    restored["opt_state"] = ak.offload_state(restored["opt_state"], restored["params"])
  p_a, s_a, p_b, s_b = params, state, restored["params"], restored["opt_state"]
  for ids, y in batches[4:]:
    p_a, s_a = step(p_a, s_a, ids, y)
    p_b, s_b = step(p_b, s_b, ids, y)
  chex.assert_trees_all_equal(p_b, p_a)
  chex.assert_trees_all_equal(s_b, s_a)
  if "offload" in case:
    # Without ak.offload_state the run resumes too (a step traced first with the
    # device-typed state: it moves sparse tables whole, and warns), with the same numbers.
    p_c, s_c, step_c = restored["params"], raw, make_step(tx)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", ak.OffloadedStateWarning)
      for ids, y in batches[4:]:
        p_c, s_c = step_c(p_c, s_c, ids, y)
    chex.assert_trees_all_equal(p_c, p_a)
    chex.assert_trees_all_equal(s_c, s_a)
  # The steps after the restore moved the params (the comparison is not vacuous).
  assert float(jnp.max(jnp.abs(p_a["fc"]["weight"] - params["fc"]["weight"]))) > 1e-3


def test_orbax_with_state_dict_names(tmp_path):
  """The flat ``ak.state_dict`` form (framework-style names) also round-trips."""
  tx = ak.adam(0.05, weight_decay=0.01)
  step = _dense_step(tx)
  params, state = _params(), tx.init(_params())
  for ids, y in _batches(3):
    params, state = step(params, state, ids, y)
  flat = ak.state_dict(state, params)
  assert "fc.weight.moment1" in flat
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "flat", flat)
  ckptr.wait_until_finished()
  back = ckptr.restore(tmp_path / "flat")
  chex.assert_trees_all_equal(ak.load_state_dict(back, tx.init(params)), state)


@pytest.mark.parametrize("method", ["stochastic", "kahan"])
def test_orbax_resume_bf16_param_rounding_is_bit_identical(method, tmp_path):
  """bf16 params without a master copy: the key and step (stochastic) or the Kahan buffer
  are state, so a restored run draws the same bits and adds back the same remainders."""
  tx = ak.param_rounding(ak.adamw(0.05, weight_decay=0.01), method, seed=11)
  to_bf16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)  # noqa: E731

  @jax.jit
  def step(params, state, ids, y):
    grads = jax.grad(lambda p: _loss(jax.tree.map(lambda x: x.astype(jnp.float32), p), ids, y))(
        params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  batches = _batches(8)
  params = to_bf16(_params())
  state = tx.init(params)
  for ids, y in batches[:4]:
    params, state = step(params, state, ids, y)
  fresh = {"params": to_bf16(_params()), "opt_state": tx.init(to_bf16(_params()))}
  restored = _save_restore(tmp_path / "ckpt", {"params": params, "opt_state": state}, fresh)
  chex.assert_trees_all_equal_dtypes(restored, {"params": params, "opt_state": state})
  chex.assert_trees_all_equal(restored, {"params": params, "opt_state": state})
  p_a, s_a, p_b, s_b = params, state, restored["params"], restored["opt_state"]
  for ids, y in batches[4:]:
    p_a, s_a = step(p_a, s_a, ids, y)
    p_b, s_b = step(p_b, s_b, ids, y)
  chex.assert_trees_all_equal((p_b, s_b), (p_a, s_a))
  moved = jnp.abs(p_a["fc"]["weight"].astype(jnp.float32) - params["fc"]["weight"].astype(jnp.float32))
  assert float(jnp.max(moved)) > 1e-3
