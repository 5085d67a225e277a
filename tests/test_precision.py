"""Mixed precision: low-precision moments, float32 master weights, float32 hyperparameters.

References are float64 NumPy loops that round where the implementation must round (the
stored moment, the params' cast) and nowhere else.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import adamkit as ak

B1, B2, EPS = 0.9, 0.999, 1e-8


def numpy_adam(params, grads_seq, lr, *, store=np.float32, master=False, low=None):
  """Adam ("corrected"): moments in float32, rounded to ``store`` in the state, the rest in
  float64; with
  ``master`` the params are a float64->float32 master and ``low`` the visible cast."""
  p = np.asarray(params, np.float64)
  m = np.zeros_like(p)
  v = np.zeros_like(p)
  for t, g in enumerate(grads_seq, start=1):
    g = np.asarray(g, np.float64)
    # The step uses the fresh moments; the state keeps them rounded to ``store`` (as optax's
    # mu_dtype). For a low-precision store, round the float32 value the implementation has.
    b1, b2, g32 = np.float32(B1), np.float32(B2), g.astype(np.float32)
    m_new = b1 * m.astype(np.float32) + (np.float32(1) - b1) * g32
    v_new = b2 * v.astype(np.float32) + (np.float32(1) - b2) * (g32 * g32)
    u = (m_new / (1 - B1**t)) / (np.sqrt(v_new / (1 - B2**t)) + EPS)
    m = m_new.astype(store).astype(np.float64)
    v = v_new.astype(store).astype(np.float64)
    p = p - lr * u
    if master:
      p = p.astype(np.float32).astype(np.float64)
  return p if low is None else p.astype(low)


def grads(n, shape, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(shape).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("moment_dtype", [jnp.bfloat16, jnp.float32])
def test_nu_dtype_and_mu_dtype(moment_dtype):
  tx = ak.adam(0.01, eps_mode="corrected", mu_dtype=moment_dtype, nu_dtype=moment_dtype)
  params = {"w": jnp.asarray(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))}
  state = tx.init(params)
  gs = grads(4, (3, 4))
  for g in gs:
    updates, state = tx.update({"w": jnp.asarray(g)}, state, params)
    params = optax.apply_updates(params, updates)
  inner = optax.tree_utils.tree_get(state, "nu")
  assert inner["w"].dtype == moment_dtype
  assert optax.tree_utils.tree_get(state, "mu")["w"].dtype == moment_dtype
  store = ml_dtypes.bfloat16 if moment_dtype == jnp.bfloat16 else np.float32
  expected = numpy_adam(np.linspace(-1, 1, 12).reshape(3, 4), gs, 0.01, store=store)
  np.testing.assert_allclose(np.asarray(params["w"], np.float64), expected, rtol=1e-5, atol=1e-6)


def test_bf16_nu_differs_from_f32_nu():
  """The option does something: bf16 storage changes the second moment."""
  g = {"w": jnp.asarray(grads(1, (64,))[0])}
  nus = []
  for dt in (jnp.bfloat16, jnp.float32):
    tx = ak.scale_by_adam(nu_dtype=dt)
    _, s = tx.update(g, tx.init({"w": jnp.zeros(64)}))
    nus.append(np.asarray(s.nu["w"], np.float64))
  assert not np.array_equal(nus[0], nus[1])
  np.testing.assert_allclose(nus[0], nus[1], rtol=1e-2)


@pytest.mark.parametrize("low", [jnp.bfloat16, jnp.float16])
def test_master_weights_match_float32_training(low):
  lr = 1e-3
  low_np = ml_dtypes.bfloat16 if low == jnp.bfloat16 else np.float16
  p0 = np.linspace(-2, 2, 16).astype(low_np)
  gs = grads(6, (16,), seed=3, dtype=low_np)
  tx = ak.master_weights(ak.adam(lr, eps_mode="corrected"))
  params = {"w": jnp.asarray(p0), "b": jnp.ones(3, jnp.float32)}
  state = tx.init(params)
  assert state.master["w"].dtype == jnp.float32 and state.master["b"] is None
  for g in gs:
    updates, state = tx.update({"w": jnp.asarray(g), "b": jnp.ones(3)}, state, params)
    params = optax.apply_updates(params, updates)
  master = numpy_adam(p0.astype(np.float64), [g.astype(np.float64) for g in gs], lr,
                      master=True)
  np.testing.assert_allclose(np.asarray(state.master["w"], np.float64), master, rtol=1e-6,
                             atol=1e-7)
  # The visible params are the master cast to the low dtype, exactly.
  np.testing.assert_array_equal(np.asarray(params["w"]),
                                np.asarray(state.master["w"]).astype(low_np))
  assert params["w"].dtype == low
  # Without a master, the same steps are lost to bf16/fp16 rounding of the params.
  plain = ak.adam(lr, eps_mode="corrected")
  q = {"w": jnp.asarray(p0)}
  s = plain.init(q)
  for g in gs:
    u, s = plain.update({"w": jnp.asarray(g)}, s, q)
    q = optax.apply_updates(q, u)
  assert not np.array_equal(np.asarray(q["w"]), np.asarray(params["w"]))


def test_master_weights_jit_and_float32_passthrough():
  tx = ak.master_weights(ak.adamax(0.1))
  params = {"a": jnp.ones(4, jnp.float32), "h": jnp.ones(4, jnp.bfloat16)}
  step = jax.jit(tx.update)
  state = tx.init(params)
  g = {"a": jnp.full(4, 0.5), "h": jnp.full(4, 0.5, jnp.bfloat16)}
  updates, state2 = step(g, state, params)
  ref_u, _ = ak.adamax(0.1).update({"a": g["a"]}, ak.adamax(0.1).init({"a": params["a"]}),
                                   {"a": params["a"]})
  np.testing.assert_array_equal(np.asarray(updates["a"]), np.asarray(ref_u["a"]))
  assert updates["h"].dtype == jnp.bfloat16
  assert jax.tree.map(lambda x: x.dtype, state2) == jax.tree.map(lambda x: x.dtype, state)
  with pytest.raises(ValueError, match="params"):
    tx.update(g, state)


def test_inject_hyperparams_keeps_float32_for_bf16_params():
  params = {"w": jnp.ones(4, jnp.bfloat16)}
  tx = ak.inject_hyperparams(ak.adam, static_args=("eps_mode",))(
      learning_rate=1e-3, b2=0.999, eps_mode="corrected")
  state = tx.init(params)
  b2 = state.hyperparams["b2"]
  assert b2.dtype == jnp.float32 and float(b2) == np.float32(0.999)
  assert jnp.bfloat16(0.999) == 1.0  # what b2 would become in the params' dtype
  # The injected step equals the plain one (same float32 hyperparameters).
  g = {"w": jnp.full(4, 0.25, jnp.bfloat16)}
  plain = ak.adam(1e-3, b2=0.999, eps_mode="corrected")
  u1, _ = jax.jit(tx.update)(g, state, params)
  u2, _ = plain.update(g, plain.init(params), params)
  np.testing.assert_array_equal(np.asarray(u1["w"]), np.asarray(u2["w"]))


def test_bias_corrections_stay_float32_with_bf16_params():
  """b2**t in bf16 would be 1 - 2**-8 granular; the second step must see 1 - 0.999**2."""
  tx = ak.scale_by_adam(eps_mode="corrected", eps=1e-30)
  params = {"w": jnp.zeros(1, jnp.bfloat16)}
  s = tx.init(params)
  g1, g2 = jnp.ones(1, jnp.bfloat16), jnp.full(1, 2.0, jnp.bfloat16)
  _, s = tx.update({"w": g1}, s)
  u, s = tx.update({"w": g2}, s)
  m = (1 - B1) * B1 * 1 + (1 - B1) * 2
  v = (1 - B2) * B2 * 1 + (1 - B2) * 4
  expected = (m / (1 - B1**2)) / np.sqrt(v / (1 - B2**2))
  # bf16 moments and update round to 8 bits; a bf16 bias correction would be off by ~40%.
  np.testing.assert_allclose(float(u["w"][0]), expected, rtol=2e-2)
