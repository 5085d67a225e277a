"""ak.adamw (decoupled decay) and AMSGrad: cross-checks against PyTorch and optax, masks,
state, and the wrappers (offload, master weights)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import NumpyAdam

import adamkit as ak

# Betas that are float32 numbers: 1 - beta is then the same in float32 and float64, so
# PyTorch (1 - beta in double) and adamkit (in float32) agree to a few ulps.
EXACT_B1, EXACT_B2 = 0.875, 0.9990234375


def make_params(seed=0):
  rng = np.random.default_rng(seed)
  return {"fc": {"weight": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
                 "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32)},
          "bn": {"gamma": jnp.asarray(1 + rng.normal(size=(4,)) * 0.1, jnp.float32)}}


def shrinking_grads(params, n, seed=1):
  """A large first gradient, then 100x smaller ones: v_t then shrinks (b2 + 1e-4 < 1), so
  AMSGrad's max holds at v_1 and the trajectory differs from Adam's."""
  rng = np.random.default_rng(seed)
  return [jax.tree.map(lambda p, i=i: jnp.asarray(rng.normal(size=p.shape) * (0.01 if i else 1.0),
                                                  jnp.float32), params) for i in range(n)]


def run(tx, params, grads):
  state = tx.init(params)
  for g in grads:
    u, state = jax.jit(tx.update)(g, state, params)
    params = optax.apply_updates(params, u)
  return params, state


def flat(tree):
  return {".".join(str(getattr(k, "key", k)) for k in path): np.asarray(x, np.float64)
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def worst(a, b):
  a, b = flat(a), flat(b)
  return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


# --------------------------------------------------------------- PyTorch (bench extra)


def torch_run(make_opt, params, grads):
  torch = pytest.importorskip("torch")
  names = list(flat(params))
  ts = [torch.tensor(flat(params)[n], dtype=torch.float32, requires_grad=True) for n in names]
  opt = make_opt(ts)
  for g in grads:
    fg = flat(g)
    for t, n in zip(ts, names):
      t.grad = torch.tensor(fg[n], dtype=torch.float32)
    opt.step()
  return {n: t.detach().numpy().astype(np.float64) for n, t in zip(names, ts)}


# float32 rounding over 12 steps: a few ulps of |w| < 4 (2.4e-7 each); with 0.9 / 0.999 also
# the rounding of 1 - beta (see test_reference.py).
@pytest.mark.parametrize("betas,tol", [((EXACT_B1, EXACT_B2), 1e-6), ((0.9, 0.999), 2e-6)])
def test_amsgrad_matches_torch_adam_and_adamw(betas, tol):
  torch = pytest.importorskip("torch")
  params = make_params()
  grads = shrinking_grads(params, 12)
  b1, b2 = betas
  lr, wd = 0.1, 0.05
  cases = [
      # torch.optim.Adam(amsgrad=True, weight_decay): L2 in the gradient, optax's eps form.
      (lambda ts: torch.optim.Adam(ts, lr=lr, betas=betas, weight_decay=wd, amsgrad=True),
       ak.adam(lr, b1, b2, eps_mode="corrected", weight_decay=wd, weight_decay_mask=None,
               amsgrad=True),
       ak.adam(lr, b1, b2, eps_mode="corrected", weight_decay=wd, weight_decay_mask=None)),
      # torch.optim.AdamW(amsgrad=True): w *= 1 - lr wd first, then the step.
      (lambda ts: torch.optim.AdamW(ts, lr=lr, betas=betas, weight_decay=wd, amsgrad=True),
       ak.adamw(lr, b1, b2, weight_decay=wd, weight_decay_mask=None, amsgrad=True),
       ak.adamw(lr, b1, b2, weight_decay=wd, weight_decay_mask=None)),
  ]
  for make_torch, ours, plain in cases:
    theirs = torch_run(make_torch, params, grads)
    mine, _ = run(ours, params, grads)
    err = max(float(np.max(np.abs(flat(mine)[k] - theirs[k]))) for k in theirs)
    # ... and AMSGrad mattered on this sequence: plain Adam(W) lands far from torch's.
    other, _ = run(plain, params, grads)
    miss = max(float(np.max(np.abs(flat(other)[k] - theirs[k]))) for k in theirs)
    print(f"torch amsgrad betas={betas}: ours {err:.3g}, plain Adam {miss:.3g}")
    assert err < tol and miss > 1e-4


# ------------------------------------------------------------------------------ optax


def test_amsgrad_keeps_the_raw_max_unlike_optax_amsgrad():
  # optax.amsgrad takes the max of the bias-corrected nu; adamkit (PyTorch, Paddle,
  # MindSpore) the max of the raw nu. On a large first gradient followed by small ones the
  # two part ways, each exactly as its own formula says.
  params = {"w": jnp.asarray([0.5, -1.0, 2.0], jnp.float32)}
  grads = [{"w": jnp.asarray([1.0, -2.0, 0.5], jnp.float32) * 0.1 ** min(i, 1)}
           for i in range(6)]
  lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
  ours, _ = run(ak.adam(lr, b1, b2, eps, eps_mode="corrected", amsgrad=True), params, grads)
  with jax.numpy_dtype_promotion("standard"):  # optax mixes int32 counts and floats
    theirs, _ = run(optax.amsgrad(lr, b1, b2, eps), params, grads)

  def numpy_amsgrad(max_of_corrected):
    w, m, v, vmax = np.asarray(params["w"], np.float64), 0.0, 0.0, 0.0
    for t, g in enumerate(grads, 1):
      g = np.asarray(g["w"], np.float64)
      m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
      if max_of_corrected:
        vmax = np.maximum(vmax, v / (1 - b2 ** t))
        w = w - lr * (m / (1 - b1 ** t)) / (np.sqrt(vmax) + eps)
      else:
        vmax = np.maximum(vmax, v)
        w = w - lr * (m / (1 - b1 ** t)) / (np.sqrt(vmax / (1 - b2 ** t)) + eps)
    return w

  np.testing.assert_allclose(ours["w"], numpy_amsgrad(False), rtol=0, atol=1e-6)
  np.testing.assert_allclose(theirs["w"], numpy_amsgrad(True), rtol=0, atol=1e-6)
  assert np.max(np.abs(np.asarray(ours["w"]) - np.asarray(theirs["w"]))) > 1e-3


def test_adamw_default_is_optax_adamw_up_to_the_mask():
  params = make_params()
  grads = shrinking_grads(params, 4)
  ours, _ = run(ak.adamw(0.01, EXACT_B1, EXACT_B2, weight_decay=0.1, weight_decay_mask=None),
                params, grads)
  with jax.numpy_dtype_promotion("standard"):
    theirs, _ = run(optax.adamw(0.01, EXACT_B1, EXACT_B2, weight_decay=0.1), params, grads)
  assert worst(ours, theirs) < 1e-6
  # The default mask is MindSpore's: bn.gamma is not decayed, where optax decays it.
  masked, _ = run(ak.adamw(0.01, EXACT_B1, EXACT_B2, weight_decay=0.1), params, grads)
  np.testing.assert_array_equal(masked["fc"]["weight"], ours["fc"]["weight"])
  assert not np.allclose(masked["bn"]["gamma"], ours["bn"]["gamma"], rtol=0, atol=1e-5)


# ------------------------------------------------------------------ the decoupled decay


def test_decay_is_decoupled_from_the_moments_and_scaled_by_the_lr():
  params = make_params()
  grads = shrinking_grads(params, 3)
  _, s_adamw = run(ak.adamw(0.01, weight_decay=0.3), params, grads)
  _, s_plain = run(ak.adamw(0.01, weight_decay=0.0), params, grads)
  _, s_l2 = run(ak.adam(0.01, weight_decay=0.3), params, grads)
  moments = lambda s: {k: v for k, v in ak.state_dict(s).items() if ".moment" in k}  # noqa: E731
  chex.assert_trees_all_equal(moments(s_adamw), moments(s_plain))
  assert not all(np.array_equal(moments(s_l2)[k], moments(s_plain)[k]) for k in moments(s_l2))
  # lr = 0: nothing moves, decay included (the rate multiplies it).
  still, _ = run(ak.adamw(0.0, weight_decay=0.3), params, grads)
  chex.assert_trees_all_equal(still, params)


def test_hat_and_corrected_coincide_without_bias_correction():
  params = make_params()
  grads = shrinking_grads(params, 4)
  a, _ = run(ak.adamw(0.01, eps=1e-6, weight_decay=0.05, bias_correction=False, eps_mode="hat",
                      amsgrad=True), params, grads)
  b, _ = run(ak.adamw(0.01, eps=1e-6, weight_decay=0.05, bias_correction=False,
                      eps_mode="corrected", amsgrad=True), params, grads)
  chex.assert_trees_all_equal(a, b)


@pytest.mark.parametrize("mask,decayed", [
    (ak.masks.mindspore_rule(), {"fc.weight", "fc.bias"}),
    (None, {"fc.weight", "fc.bias", "bn.gamma"}),
    (ak.masks.name_rule(lambda n: not n.endswith("bias")), {"fc.weight", "bn.gamma"}),
    ({"fc": {"weight": True, "bias": False}, "bn": {"gamma": False}}, {"fc.weight"}),
    (lambda p: jax.tree.map(lambda x: x.ndim > 1, p), {"fc.weight"}),  # optax's convention
])
def test_weight_decay_mask_forms(mask, decayed):
  # Zero gradients: Adam's direction is 0, so the update is -lr wd w on decayed leaves only.
  params = make_params()
  tx = ak.adamw(0.1, weight_decay=0.5, weight_decay_mask=mask)
  u, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  for name, value in flat(u).items():
    expected = -0.05 * flat(params)[name] if name in decayed else 0.0
    np.testing.assert_allclose(value, expected, rtol=1e-6, err_msg=name)


def test_paddle_style_group_and_name_rule():
  # Paddle AdamW(parameters=[{'params': fc, 'learning_rate': 2.0, 'weight_decay': 0.2}],
  # apply_decay_param_fun=...): the group's multiplier scales its decay; outside the group
  # the name rule chooses.
  params = make_params()
  grads = shrinking_grads(params, 3)
  tx = ak.adamw(0.01, weight_decay=0.05, weight_decay_mask=ak.masks.name_rule(lambda n: "gamma" in n),
                groups=[{"params": "fc.*", "learning_rate": 2.0, "weight_decay": 0.2}])
  got, _ = run(tx, params, grads)
  ref_fc = NumpyAdam(0.02, eps_mode="corrected", weight_decay=0.2, decoupled="paddle")
  ref_bn = NumpyAdam(0.01, eps_mode="corrected", weight_decay=0.05, decoupled="paddle")
  fc = {k: np.asarray(v) for k, v in flat(params).items() if k.startswith("fc")}
  bn = {"bn.gamma": np.asarray(params["bn"]["gamma"])}
  for g in grads:
    fg = flat(g)
    fc = ref_fc.step(fc, {k: fg[k] for k in fc})
    bn = ref_bn.step(bn, {k: fg[k] for k in bn})
  for k, v in {**fc, **bn}.items():
    np.testing.assert_allclose(flat(got)[k], v, rtol=0, atol=2e-6, err_msg=k)


def test_plain_callable_on_names_is_refused_with_the_way_out():
  params = make_params()
  tx = ak.adamw(0.1, weight_decay_mask=lambda name: "bias" not in name)
  with pytest.raises(TypeError, match="name_rule"):
    tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  # ak.adam keeps optax's params -> bool tree convention
  tx = ak.adam(0.1, weight_decay=0.5, weight_decay_mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
  u, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  assert float(jnp.max(jnp.abs(u["fc"]["weight"]))) > 0 and not np.any(u["fc"]["bias"])


def test_bad_arguments_are_named():
  with pytest.raises(TypeError, match="ak.adam"):
    ak.adamw(0.1, weight_decay=ak.L2Decay(0.1))
  with pytest.raises(TypeError, match="amsgrad"):
    ak.adamw(0.1, amsgrad=1)
  with pytest.raises(TypeError, match="amsgrad"):
    ak.adam(0.1, amsgrad="yes")
  with pytest.raises(TypeError, match="bias_correction"):
    ak.scale_by_adam(bias_correction=None)
  with pytest.raises(ValueError, match="eps_mode"):
    ak.adamw(0.1, eps_mode="paddle")
  with pytest.raises(ValueError, match="weight_decay"):
    ak.adamw(0.1, weight_decay=-0.1)
  with pytest.raises(ValueError, match="b2"):
    ak.adamw(0.1, b2=1.0)
  with pytest.raises(TypeError, match=r"groups\[0\].weight_decay"):
    ak.adamw(0.1, groups=[{"params": "fc.*", "weight_decay": ak.L1Decay(0.1)}])
  with pytest.raises(TypeError, match="name_rule"):
    ak.masks.name_rule("bias")


# ------------------------------------------------------------------------------ state


def test_adam_state_unchanged_and_amsgrad_state_round_trips():
  params = make_params()
  grads = shrinking_grads(params, 4)
  # amsgrad=False keeps ScaleByAdamState(count, mu, nu): old checkpoints still load.
  _, s_old = run(ak.adam(0.01), params, grads)
  assert ak.ScaleByAdamState._fields == ("count", "mu", "nu")
  restored = ak.load_state_dict(ak.state_dict(s_old), ak.adam(0.01).init(params))
  chex.assert_trees_all_equal(restored, s_old)
  # amsgrad=True: ScaleByAmsgradState, nu_max in nu's dtype, named "<param>.moment2_max".
  is_ams = lambda x: isinstance(x, ak.ScaleByAmsgradState)  # noqa: E731
  bf16 = ak.adamw(0.01, amsgrad=True, nu_dtype=jnp.bfloat16).init(params)
  (node,) = [n for n in jax.tree.leaves(bf16, is_leaf=is_ams) if is_ams(n)]
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(node.nu_max))
  tx = ak.adamw(0.01, amsgrad=True)
  _, s = run(tx, params, grads)
  sd = ak.state_dict(s, params)
  assert {"fc.weight.moment2_max", "bn.gamma.moment2_max"} <= set(sd)
  assert all(np.all(sd[f"{k}.moment2_max"] >= sd[f"{k}.moment2"]) for k in flat(params))
  assert any(np.any(sd[f"{k}.moment2_max"] > sd[f"{k}.moment2"]) for k in flat(params))
  chex.assert_trees_all_equal(ak.load_state_dict(sd, tx.init(params)), s)
  with pytest.raises(KeyError, match="moment2_max"):  # a plain Adam state is not AMSGrad's
    ak.load_state_dict(ak.state_dict(s_old), ak.adam(0.01, amsgrad=True).init(params))


# --------------------------------------------------------------------------- wrappers


def test_master_weights_wrap_adamw():
  params = make_params()
  low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  grads = shrinking_grads(params, 4)
  make = lambda: ak.adamw(0.01, weight_decay=0.1, amsgrad=True)  # noqa: E731
  tx = ak.master_weights(make())
  state = tx.init(low)
  p = low
  for g in grads:
    u, state = jax.jit(tx.update)(jax.tree.map(lambda x: x.astype(jnp.bfloat16), g), state, p)
    p = optax.apply_updates(p, u)
  # the float32 master follows float32 AdamW on the bf16-rounded start and gradients
  start = jax.tree.map(lambda x: x.astype(jnp.float32), low)
  ref, _ = run(make(), start, [jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), g)
                               for g in grads])
  assert worst(state.master, ref) < 1e-6
  chex.assert_trees_all_equal(p, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state.master))


HOST = "pinned_host"
HAS_HOST = HOST in {m.kind for m in jax.devices()[0].addressable_memories()}


@pytest.mark.skipif(not HAS_HOST, reason="no pinned_host memory on this backend")
@pytest.mark.parametrize("mode", ["compute", "state"])
def test_offload_wraps_adamw(mode):
  params = make_params()
  grads = shrinking_grads(params, 4)
  make = lambda: ak.adamw(0.01, weight_decay=0.1, amsgrad=True)  # noqa: E731
  try:
    got, state = run(ak.offload(make(), mode=mode), params, grads)
  except (NotImplementedError, RuntimeError) as e:  # this backend lacks the mode
    pytest.skip(str(e))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state) if x.ndim} == {HOST}  # moments
  ref, _ = run(make(), params, grads)
  assert worst(got, ref) < 1e-6
