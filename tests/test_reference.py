"""adamkit against the independent float64 NumPy reference, over random settings."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import NumpyAdam

import adamkit as ak

SETTINGS = settings(max_examples=15, deadline=None, derandomize=True, database=None)
STEPS = 4

shapes = st.sampled_from([(3,), (2, 3), (2, 1, 3), (4, 2, 2, 2)])
betas = st.floats(0.5, 0.999)
hyper = st.fixed_dictionaries({
    "lr": st.floats(1e-4, 0.3), "b1": betas, "b2": betas,
    "eps": st.sampled_from([1e-8, 1e-6, 1e-3, 0.1]),
})


def run_both(tx, ref, params, grads_seq):
  state = tx.init(params)
  worst = 0.0
  ref_params = params
  for g in grads_seq:
    updates, state = jax.jit(tx.update)(g, state, params)
    params = optax.apply_updates(params, updates)
    ref_params = ref.step(ref_params, g)
    for k in params:
      scale = max(1.0, float(np.max(np.abs(ref_params[k]))))
      worst = max(worst, float(np.max(np.abs(np.asarray(params[k], np.float64) - ref_params[k]))) / scale)
  return worst


def make_problem(seed, shape):
  rng = np.random.default_rng(seed)
  params = {"layer.weight": jnp.asarray(rng.normal(size=shape), jnp.float32),
            "bn.gamma": jnp.asarray(rng.normal(size=shape[:1]), jnp.float32)}
  grads = [{k: jnp.asarray(rng.normal(size=v.shape) * rng.choice([1e-3, 1.0, 10.0]), jnp.float32)
            for k, v in params.items()} for _ in range(STEPS)]
  return params, grads


@SETTINGS
@given(h=hyper, shape=shapes, seed=st.integers(0, 2**16), eps_mode=st.sampled_from(["hat", "corrected"]),
       nesterov=st.booleans(), wd=st.sampled_from([0.0, 0.05]), loss_scale=st.sampled_from([1.0, 128.0]))
def test_adam_matches_float64_reference(h, shape, seed, eps_mode, nesterov, wd, loss_scale):
  params, grads = make_problem(seed, shape)
  grads = [{k: g * loss_scale for k, g in gs.items()} for gs in grads]
  tx = ak.adam(h["lr"], h["b1"], h["b2"], h["eps"], eps_mode=eps_mode, nesterov=nesterov,
               weight_decay=wd, loss_scale=loss_scale)
  ref = NumpyAdam(h["lr"], h["b1"], h["b2"], h["eps"], eps_mode=eps_mode, nesterov=nesterov,
                  weight_decay=wd, loss_scale=loss_scale, decay=lambda k: "gamma" not in k)
  assert run_both(tx, ref, params, grads) < 2e-5


@SETTINGS
@given(h=hyper, shape=shapes, seed=st.integers(0, 2**16), wd=st.sampled_from([0.0, 0.05]),
       l1=st.booleans())
def test_adamax_matches_float64_reference(h, shape, seed, wd, l1):
  params, grads = make_problem(seed, shape)
  decay = ak.L1Decay(wd) if l1 else wd
  tx = ak.adamax(h["lr"], h["b1"], h["b2"], h["eps"], weight_decay=decay, weight_decay_mask=None)
  ref = NumpyAdam(h["lr"], h["b1"], h["b2"], h["eps"], algo="adamax", weight_decay=wd, l1=l1)
  assert run_both(tx, ref, params, grads) < 2e-5


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**16),
       clip=st.sampled_from([("global", 0.5), ("norm", 0.3), ("value", 0.2)]))
def test_clip_centralize_matches_reference(shape, seed, clip):
  params, grads = make_problem(seed, shape)
  kind, c = clip
  grad_clip = {"global": ak.ClipGradByGlobalNorm, "norm": ak.ClipGradByNorm,
               "value": ak.ClipGradByValue}[kind](c)
  tx = ak.adam(0.01, weight_decay=0.1, grad_clip=grad_clip, grad_centralization=True,
               eps_mode="corrected", weight_decay_mask=None)
  ref = NumpyAdam(0.01, weight_decay=0.1, clip=clip, gc=lambda k: True, eps_mode="corrected")
  assert run_both(tx, ref, params, grads) < 2e-5


def beta_rounding(b):
  """Relative error that float32 rounding of beta puts into 1 - beta."""
  return abs(float(np.float32(b)) - b) / (1.0 - b)


@SETTINGS
@given(h=hyper, shape=shapes, seed=st.integers(0, 2**16))
def test_corrected_mode_equals_optax_adam(h, shape, seed):
  params, grads = make_problem(seed, shape)
  ours = ak.adam(h["lr"], h["b1"], h["b2"], h["eps"], eps_mode="corrected")
  theirs = optax.adam(h["lr"], h["b1"], h["b2"], h["eps"])
  # optax takes 1 - beta in float64 but beta**t from float32 beta; adamkit (like the
  # float32 kernels of MindSpore and Paddle) takes both from float32 beta. The two agree
  # up to the rounding of beta itself, amplified by 1 / (1 - beta).
  rtol = 2e-6 + beta_rounding(h["b1"]) + beta_rounding(h["b2"])
  s1, s2 = ours.init(params), theirs.init(params)
  for g in grads:
    u1, s1 = ours.update(g, s1, params)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int32 counts and floats
      u2, s2 = theirs.update(g, s2, params)
    for k in params:
      # judged against the leaf's scale: cancellation in m makes single small elements
      # relatively noisier
      np.testing.assert_allclose(u1[k], u2[k], rtol=rtol,
                                 atol=rtol * float(jnp.max(jnp.abs(u2[k]))))


def test_corrected_mode_equals_optax_bitwise_for_exact_betas():
  # With betas exactly representable in float32 the two agree to a couple of ulps.
  params, grads = make_problem(7, (4, 3))
  ours = ak.adam(0.1, 0.875, 0.9990234375, 1e-8, eps_mode="corrected")
  theirs = optax.adam(0.1, 0.875, 0.9990234375, 1e-8)
  s1, s2 = ours.init(params), theirs.init(params)
  for g in grads:
    u1, s1 = ours.update(g, s1, params)
    with jax.numpy_dtype_promotion("standard"):
      u2, s2 = theirs.update(g, s2, params)
    for k in params:
      np.testing.assert_allclose(u1[k], u2[k], rtol=5e-7, atol=1e-9)


def test_first_step_is_exact_where_optax_rounds():
  # t = 1, corrected mode: m_hat = g and v_hat = g^2 exactly, so u = lr * g / (|g| + eps).
  params = {"w": jnp.ones(3)}
  g = {"w": jnp.array([0.5, -2.0, 4.0])}
  tx = ak.adam(0.25, b2=0.999, eps=1e-8, eps_mode="corrected")
  u, _ = tx.update(g, tx.init(params), params)
  np.testing.assert_allclose(u["w"], [-0.25, 0.25, -0.25], rtol=1e-7)


def test_adamax_eps_outside_the_max_unlike_optax():
  # Once b2 * v dominates |g|, MindSpore's max(b2 v, |g|) + eps and optax's
  # max(b2 v, |g| + eps) part ways: here by half of eps in the denominator.
  params = {"w": jnp.zeros(3)}
  grads = [{"w": jnp.array([1e-8, -2e-8, 3e-8])}, {"w": jnp.zeros(3)}]
  ref = NumpyAdam(1.0, b2=0.5, eps=1e-8, algo="adamax")
  ref_params = {"w": np.zeros(3)}
  ours_tx, theirs_tx = ak.adamax(1.0, b2=0.5, eps=1e-8), optax.adamax(1.0, b2=0.5, eps=1e-8)
  ours_s, theirs_s = ours_tx.init(params), theirs_tx.init(params)
  ours_p = theirs_p = params
  for g in grads:
    ref_params = ref.step(ref_params, g)
    u, ours_s = ours_tx.update(g, ours_s, ours_p)
    ours_p = optax.apply_updates(ours_p, u)
    with jax.numpy_dtype_promotion("standard"):  # optax.adamax mixes int32 and float
      u, theirs_s = theirs_tx.update(g, theirs_s, theirs_p)
    theirs_p = optax.apply_updates(theirs_p, u)
  np.testing.assert_allclose(np.asarray(ours_p["w"]), ref_params["w"], rtol=1e-6)
  assert np.max(np.abs(np.asarray(theirs_p["w"]) - ref_params["w"])) > 1e-2


def test_nesterov_differs_from_optax_nadam_as_documented():
  params = {"w": jnp.ones(4)}
  rng = np.random.default_rng(0)
  grads = [{"w": jnp.asarray(rng.normal(size=4), jnp.float32)} for _ in range(3)]
  ref = NumpyAdam(0.1, eps_mode="corrected", nesterov=True)
  assert run_both(ak.adam(0.1, eps_mode="corrected", nesterov=True), ref, params, grads) < 1e-6
  nadam_params = params
  tx = optax.nadam(0.1)
  s = tx.init(params)
  ref = NumpyAdam(0.1, eps_mode="corrected", nesterov=True)
  ref_params = params
  for g in grads:
    with jax.numpy_dtype_promotion("standard"):
      u, s = tx.update(g, s, nadam_params)
    nadam_params = optax.apply_updates(nadam_params, u)
    ref_params = ref.step(ref_params, g)
  assert np.max(np.abs(np.asarray(nadam_params["w"]) - ref_params["w"])) > 1e-4


@pytest.mark.parametrize("form", ["list", "array", "generator", "schedule"])
def test_learning_rate_forms_follow_the_step(form):
  values = [0.1, 0.02, 0.3]
  lr = {"list": values, "array": jnp.asarray(values), "generator": (v for v in values),
        "schedule": lambda c: jnp.asarray(values)[jnp.minimum(c, 2)]}[form]
  params, grads = make_problem(1, (2, 3))
  grads = grads + grads  # 8 steps: steps past the end keep the last rate
  ref = NumpyAdam(values, weight_decay=0.0)
  assert run_both(ak.adam(lr), ref, params, grads) < 2e-5


def test_weight_decay_schedule():
  params, grads = make_problem(2, (3,))
  tx = ak.adam(0.05, weight_decay=lambda c: 0.1 * (c + 1).astype(jnp.float32),
               weight_decay_mask=None)
  ref = NumpyAdam(0.05, weight_decay=lambda t: 0.1 * (t + 1))
  assert run_both(tx, ref, params, grads) < 2e-5


def test_groups_match_reference():
  params, grads = make_problem(3, (2, 3))
  # MindSpore absolute lr for 'layer.*' with centralization; Paddle-style multiplier
  # and its own decay for 'bn.*'.
  tx = ak.adam(0.01, weight_decay=0.05, groups=[
      ak.Group("layer.*", lr=0.03, grad_centralization=True),
      {"params": "bn.*", "learning_rate": 0.5, "weight_decay": 0.2}])
  state = tx.init(params)
  ref_a = NumpyAdam(0.03, weight_decay=0.05, gc=lambda k: True)
  ref_b = NumpyAdam(0.005, weight_decay=0.2)
  ra, rb = {"layer.weight": params["layer.weight"]}, {"bn.gamma": params["bn.gamma"]}
  for g in grads:
    u, state = tx.update(g, state, params)
    params = optax.apply_updates(params, u)
    ra = ref_a.step(ra, {"layer.weight": g["layer.weight"]})
    rb = ref_b.step(rb, {"bn.gamma": g["bn.gamma"]})
  np.testing.assert_allclose(params["layer.weight"], ra["layer.weight"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(params["bn.gamma"], rb["bn.gamma"], rtol=1e-5, atol=1e-6)
  lrs = ak.get_lr(state)
  assert float(lrs["group0"]) == pytest.approx(0.03) and float(lrs["group1"]) == pytest.approx(0.005)


@SETTINGS
@given(h=hyper, shape=shapes, seed=st.integers(0, 2**16), eps_mode=st.sampled_from(["hat", "corrected"]),
       bias_correction=st.booleans(), amsgrad=st.booleans(), wd=st.sampled_from([0.0, 0.05, 0.3]),
       mask=st.sampled_from(["mindspore", "none", "name_rule"]),
       order=st.sampled_from(["mindspore", "paddle"]), loss_scale=st.sampled_from([1.0, 64.0]))
def test_adamw_matches_float64_reference(h, shape, seed, eps_mode, bias_correction, amsgrad, wd,
                                         mask, order, loss_scale):
  # Either framework's literal order of the decoupled decay (MindSpore: u += wd w before the
  # lr; Paddle: w *= 1 - lr wd first) is the same trajectory as ak.adamw's chain.
  params, grads = make_problem(seed, shape)
  grads = [{k: g * loss_scale for k, g in gs.items()} for gs in grads]
  spec, decay = {
      "mindspore": (ak.masks.mindspore_rule(), lambda k: "gamma" not in k),
      "none": (None, lambda k: True),
      "name_rule": (ak.masks.name_rule(lambda n: n.startswith("bn")), lambda k: k.startswith("bn")),
  }[mask]
  tx = ak.adamw(h["lr"], h["b1"], h["b2"], h["eps"], weight_decay=wd, weight_decay_mask=spec,
                bias_correction=bias_correction, eps_mode=eps_mode, amsgrad=amsgrad,
                loss_scale=loss_scale)
  ref = NumpyAdam(h["lr"], h["b1"], h["b2"], h["eps"], eps_mode=eps_mode, weight_decay=wd,
                  decay=decay, bias_correction=bias_correction, amsgrad=amsgrad, decoupled=order,
                  loss_scale=loss_scale)
  assert run_both(tx, ref, params, grads) < 2e-5


@SETTINGS
@given(h=hyper, shape=shapes, seed=st.integers(0, 2**16), eps_mode=st.sampled_from(["hat", "corrected"]),
       nesterov=st.booleans(), wd=st.sampled_from([0.0, 0.05]))
def test_adam_amsgrad_matches_float64_reference(h, shape, seed, eps_mode, nesterov, wd):
  # MindSpore nn.Adam(use_amsgrad=True) ("hat", L2 decay in the gradient) and Paddle
  # Adam(amsgrad=True) ("corrected").
  params, grads = make_problem(seed, shape)
  # a shrinking gradient, so that the running max and v_t part ways (test_adamw.py shows on
  # a fixed sequence that the max changes the trajectory)
  grads = [{k: g * 0.1 ** i for k, g in gs.items()} for i, gs in enumerate(grads)]
  tx = ak.adam(h["lr"], h["b1"], h["b2"], h["eps"], eps_mode=eps_mode, nesterov=nesterov,
               amsgrad=True, weight_decay=wd)
  ref = NumpyAdam(h["lr"], h["b1"], h["b2"], h["eps"], eps_mode=eps_mode, nesterov=nesterov,
                  amsgrad=True, weight_decay=wd, decay=lambda k: "gamma" not in k)
  assert run_both(tx, ref, params, grads) < 2e-5
