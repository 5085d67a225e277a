"""Argument validation, masks, learning-rate forms, and state save/restore."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adamkit as ak

# ------------------------------------------------------------------ bad arguments

@pytest.mark.parametrize("factory", [ak.adam, ak.adamax, ak.scale_by_adam, ak.scale_by_adamax])
@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(b1=1.0), ValueError, ["b1", "[0.0, 1.0)"]),
    (dict(b1=-1e-9), ValueError, ["b1", "[0.0, 1.0)"]),
    (dict(b2=-0.5), ValueError, ["b2", "[0.0, 1.0)"]),
    (dict(b2=1.5), ValueError, ["b2", "[0.0, 1.0)"]),
    (dict(eps=0.0), ValueError, ["eps", "1.175e-38"]),
    (dict(eps=-1e-8), ValueError, ["eps", "1.175e-38"]),
    (dict(eps=1e-40), ValueError, ["eps", "flush to zero"]),
    (dict(eps=float("inf")), ValueError, ["eps"]),
    (dict(b1="0.9"), TypeError, ["b1"]),
    (dict(b1=True), TypeError, ["b1"]),
    (dict(b1=[0.9]), TypeError, ["b1"]),
    (dict(b1=jnp.ones(2)), ValueError, ["b1", "scalar"]),
    (dict(mu_dtype=jnp.int32), TypeError, ["mu_dtype", "int32"]),
    (dict(nu_dtype="float17"), TypeError, ["nu_dtype", "float17"]),
    (dict(mu_dtype=jnp.bool_), TypeError, ["mu_dtype"]),
])
def test_bad_hyperparameters(factory, kwargs, exc, words):
  with pytest.raises(exc) as info:
    factory(**kwargs)
  for w in words:
    assert w in str(info.value)


@pytest.mark.parametrize("factory", [ak.adam, ak.adamax])
@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(learning_rate=-0.1), ValueError, ["learning_rate", ">= 0"]),
    (dict(learning_rate=[0.1, -0.2]), ValueError, ["learning_rate", ">= 0"]),
    (dict(learning_rate=jnp.ones((2, 2))), ValueError, ["learning_rate", "0-d or 1-D"]),
    (dict(learning_rate=np.ones((2, 2))), ValueError, ["learning_rate", "0-d or 1-D"]),
    (dict(learning_rate=[]), ValueError, ["learning_rate", "empty"]),
    (dict(learning_rate="1e-3"), TypeError, ["learning_rate"]),
    (dict(learning_rate=None), TypeError, ["learning_rate"]),
    (dict(learning_rate=[0.1, "x"]), TypeError, ["learning_rate"]),
    (dict(learning_rate=float("nan")), ValueError, ["learning_rate"]),
    (dict(weight_decay=-0.01), ValueError, ["weight_decay", ">= 0"]),
    (dict(weight_decay="0.1"), TypeError, ["weight_decay"]),
    (dict(loss_scale=0.0), ValueError, ["loss_scale", "> 0"]),
    (dict(loss_scale=-2.0), ValueError, ["loss_scale", "> 0"]),
    (dict(grad_clip=ak.ClipGradByGlobalNorm(-1.0)), ValueError, ["clip_norm", "> 0"]),
    (dict(grad_clip="global"), TypeError, ["grad_clip"]),
    (dict(grad_centralization=1), TypeError, ["grad_centralization"]),
    (dict(nonfinite="ignore"), ValueError, ["nonfinite"]),
    (dict(groups=[{"params": "x", "lr": -1.0}]), ValueError, ["groups[0].lr", ">= 0"]),
    (dict(groups=[{"params": "x", "beta1": 1.0}]), ValueError, ["groups[0].b1"]),
    (dict(groups=[{"params": "x", "momentum": 0.9}]), ValueError, ["momentum"]),
    (dict(groups=[{"lr": 0.1}]), ValueError, ["params"]),
    (dict(groups={"params": "x"}), TypeError, ["groups"]),
])
def test_bad_optimizer_arguments(factory, kwargs, exc, words):
  with pytest.raises(exc) as info:
    factory(**kwargs)
  for w in words:
    assert w in str(info.value), str(info.value)


def test_adam_only_arguments():
  with pytest.raises(ValueError, match="eps_mode"):
    ak.adam(eps_mode="paddle")
  with pytest.raises(TypeError, match="nesterov"):
    ak.adam(nesterov="yes")


@pytest.mark.parametrize("factory", [ak.adam, ak.adamax])
def test_integer_params_rejected(factory):
  params = {"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)}
  with pytest.raises(TypeError, match="'step' has dtype int32"):
    factory().init(params)


@pytest.mark.parametrize("factory", [ak.adam, ak.adamax])
def test_mismatched_gradients_rejected(factory):
  params = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
  tx = factory()
  state = tx.init(params)
  with pytest.raises(ValueError, match="does not match"):
    tx.update({"a": jnp.ones(3)}, state, params)
  with pytest.raises(ValueError, match=r"'b' has shape \(2, 3\)"):
    tx.update({"a": jnp.ones(3), "b": jnp.ones((2, 3))}, state, params)
  with pytest.raises(ValueError, match="does not match"):
    jax.jit(tx.update)({"a": jnp.ones(3), "c": jnp.ones((2, 2))}, state, params)


def test_weight_decay_needs_params():
  tx = ak.adam(weight_decay=0.1)
  params = {"w": jnp.ones(2)}
  with pytest.raises(ValueError, match="params"):
    tx.update({"w": jnp.ones(2)}, tx.init(params))


# ------------------------------------------------------------------------ masks

PARAMS = {"conv1": {"weight": jnp.ones((2, 2, 3, 3))}, "bn1": {"gamma": jnp.ones(2),
          "beta": jnp.ones(2)}, "fc": {"weight": jnp.ones((3, 2)), "bias": jnp.ones(3)},
          "ln": {"scale": jnp.ones(2)}}


@pytest.mark.parametrize("rule,decayed", [
    (ak.masks.mindspore_rule(), {"conv1.weight", "fc.weight", "fc.bias", "ln.scale"}),
    (ak.masks.flax_rule(), {"conv1.weight", "fc.weight", "bn1.gamma", "bn1.beta"}),
    (ak.masks.ndim_rule(), {"conv1.weight", "fc.weight"}),
    (ak.masks.match_names("*.weight"), {"conv1.weight", "fc.weight"}),
    (ak.masks.exclude_names("bn1"), {"conv1.weight", "fc.weight", "fc.bias", "ln.scale"}),
    (None, {"conv1.weight", "fc.weight", "fc.bias", "ln.scale", "bn1.gamma", "bn1.beta"}),
    (lambda p: jax.tree.map(lambda x: x.ndim == 1, p),
     {"fc.bias", "ln.scale", "bn1.gamma", "bn1.beta"}),
])
def test_mask_rules_choose_decayed_leaves(rule, decayed):
  # lr=1, zero gradient: only decayed leaves get a non-zero update.
  tx = ak.adam(1.0, weight_decay=0.5, weight_decay_mask=rule)
  zeros = jax.tree.map(jnp.zeros_like, PARAMS)
  updates, _ = tx.update(zeros, tx.init(PARAMS), PARAMS)
  moved = {f"{a}.{b}" for a, sub in updates.items() for b, u in sub.items()
           if float(jnp.max(jnp.abs(u))) > 0}
  assert moved == decayed


def test_bool_tree_mask_and_default_is_mindspore():
  mask = jax.tree.map(lambda _: False, PARAMS)
  mask["fc"]["bias"] = True
  zeros = jax.tree.map(jnp.zeros_like, PARAMS)
  tx = ak.adam(1.0, weight_decay=0.5, weight_decay_mask=mask)
  updates, _ = tx.update(zeros, tx.init(PARAMS), PARAMS)
  assert float(jnp.abs(updates["fc"]["bias"]).max()) > 0
  assert float(jnp.abs(updates["fc"]["weight"]).max()) == 0
  default = ak.adam(1.0, weight_decay=0.5)
  explicit = ak.adam(1.0, weight_decay=0.5, weight_decay_mask=ak.masks.mindspore_rule())
  u1, _ = default.update(zeros, default.init(PARAMS), PARAMS)
  u2, _ = explicit.update(zeros, explicit.init(PARAMS), PARAMS)
  jax.tree.map(np.testing.assert_array_equal, u1, u2)


def test_l1_decay_is_coeff_times_sign():
  params = {"w": jnp.array([2.0, -3.0, 0.0])}
  tx = ak.add_decay(0.1, kind="l1")
  out, _ = tx.update({"w": jnp.zeros(3)}, tx.init(params), params)
  np.testing.assert_allclose(out["w"], [0.1, -0.1, 0.0])


# ------------------------------------------------------------ learning-rate forms

def test_schedule_forms():
  count = jnp.arange(5)
  np.testing.assert_allclose(jax.vmap(ak.as_schedule([0.3, 0.2, 0.1]))(count),
                             [0.3, 0.2, 0.1, 0.1, 0.1], rtol=1e-7)
  np.testing.assert_allclose(jax.vmap(ak.as_schedule(np.array([1.0, 2.0])))(count),
                             [1, 2, 2, 2, 2])
  assert float(ak.as_schedule(jnp.asarray(0.5))(3)) == 0.5
  assert float(ak.as_schedule(2)(7)) == 2.0
  sched = optax.linear_schedule(1.0, 0.0, 4)
  assert ak.as_schedule(sched) is sched


def test_get_lr_follows_schedule_and_iterable():
  params = {"w": jnp.zeros(2)}
  tx = ak.adam(optax.exponential_decay(0.1, 1, 0.5))
  state = tx.init(params)
  seen = []
  for _ in range(3):
    seen.append(float(ak.get_lr(state)))
    _, state = jax.jit(tx.update)({"w": jnp.ones(2)}, state, params)
  np.testing.assert_allclose(seen, [0.1, 0.05, 0.025], rtol=1e-6)


# ------------------------------------------------------------- save and restore

def test_state_dict_names_and_exact_resume():
  params = {"fc": {"weight": jnp.ones((3, 2)), "bias": jnp.zeros(3)},
            "bn": {"gamma": jnp.ones(3)}}
  tx = ak.adam([0.1, 0.05, 0.02, 0.01], weight_decay=0.01,
               groups=[ak.Group("bn.*", lr_scale=0.5)])
  grads = [jax.tree.map(lambda p, i=i: jnp.full_like(p, 0.1 * (i + 1)), params) for i in range(6)]
  step = jax.jit(lambda p, s, g: (optax.apply_updates(p, tx.update(g, s, p)[0]), tx.update(g, s, p)[1]))

  p, s = params, tx.init(params)
  for g in grads:
    p, s = step(p, s, g)
  uninterrupted = p

  p, s = params, tx.init(params)
  for g in grads[:3]:
    p, s = step(p, s, g)
  saved = ak.state_dict(s, p)
  assert {"fc.weight.moment1", "fc.weight.moment2", "bn.gamma.moment1", "step"} <= set(saved)
  assert int(saved["step"]) == 3  # the groups share one step counter
  assert not any(k.endswith(".step") for k in saved)
  assert all(isinstance(v, np.ndarray) for v in saved.values())
  saved_params = jax.tree.map(np.asarray, p)
  restored = ak.load_state_dict(saved, tx.init(params))
  p = jax.tree.map(jnp.asarray, saved_params)
  for g in grads[3:]:
    p, restored = step(p, restored, g)
  jax.tree.map(np.testing.assert_array_equal, p, uninterrupted)


def test_state_dict_and_get_lr_of_a_partition_of_optimizers():
  """Several adamkit optimizers in one ``optax.partition``: each keeps its own counter and
  rate, named after its label (``"<label>.step"``, ``get_lr -> {label: rate}``)."""
  params = {"fc": jnp.ones((2, 3)), "emb": jnp.ones((4, 2))}
  tx = optax.partition({"dense": ak.adam(0.1), "table": ak.adamax([0.2, 0.3])},
                       {"fc": "dense", "emb": "table"})
  _, state = tx.update(params, tx.init(params), params)
  saved = ak.state_dict(state, params)
  assert {"dense.step", "table.step", "fc.moment1", "emb.moment2"} <= set(saved)
  assert int(saved["dense.step"]) == int(saved["table.step"]) == 1
  lr = ak.get_lr(state)
  assert set(lr) == {"dense", "table"}
  assert float(lr["dense"]) == pytest.approx(0.1) and float(lr["table"]) == pytest.approx(0.3)
  restored = ak.load_state_dict(saved, tx.init(params))
  jax.tree.map(np.testing.assert_array_equal, restored, state)


def test_load_state_dict_errors():
  params = {"w": jnp.ones(2)}
  tx = ak.adam()
  sd = ak.state_dict(tx.init(params))
  missing = dict(sd)
  del missing["w.moment1"]
  with pytest.raises(KeyError, match="w.moment1"):
    ak.load_state_dict(missing, tx.init(params))
  with pytest.raises(ValueError, match="unexpected"):
    ak.load_state_dict({**sd, "x.moment1": np.zeros(2)}, tx.init(params))
  with pytest.raises(ValueError, match="shape"):
    ak.load_state_dict({**sd, "w.moment2": np.zeros(3)}, tx.init(params))


# ------------------------------------------------------------------------ groups

def test_group_selectors_and_no_duplicated_state():
  params = {"conv1": {"weight": jnp.ones((2, 2, 3, 3))}, "fc": {"weight": jnp.ones((3, 2)),
            "bias": jnp.ones(3)}, "bn1": {"gamma": jnp.ones(2)}}
  tx = ak.adam(0.1, groups=[
      ak.Group(lambda name, leaf: leaf.ndim == 4, lr=0.0),       # label function
      ak.Group(ak.masks.match_names("*.bias"), lr_scale=0.0),     # mask rule
      ak.Group(("bn1.*", "nothing.*"), name="norms", lr=0.0),     # tuple of globs
  ])
  state = tx.init(params)
  # each parameter's moments exist once, in exactly one group
  moments = [k for k in ak.state_dict(state) if k.endswith(".moment1")]
  assert sorted(moments) == sorted(["conv1.weight.moment1", "fc.weight.moment1",
                                    "fc.bias.moment1", "bn1.gamma.moment1"])
  grads = jax.tree.map(jnp.ones_like, params)
  updates, state = tx.update(grads, state, params)
  assert float(jnp.abs(updates["fc"]["weight"]).max()) > 0      # default group moves
  for frozen in (updates["conv1"]["weight"], updates["fc"]["bias"], updates["bn1"]["gamma"]):
    assert float(jnp.abs(frozen).max()) == 0
  assert set(ak.get_lr(state)) == {"default", "group0", "group1", "norms"}


def test_global_norm_clip_sees_every_group():
  # Paddle's ClipGradByGlobalNorm takes the norm over all parameters, groups or not.
  params = {"a": jnp.ones(4), "b": jnp.ones(4)}
  grads = {"a": jnp.full(4, 3.0), "b": jnp.full(4, 4.0)}   # global norm = 10
  clip = ak.ClipGradByGlobalNorm(1.0)
  kw = dict(grad_clip=clip, eps=1.0, eps_mode="corrected")
  grouped = ak.adam(1.0, groups=[ak.Group("a")], **kw)
  plain = ak.adam(1.0, **kw)
  u1, _ = grouped.update(grads, grouped.init(params), params)
  u2, _ = plain.update(grads, plain.init(params), params)
  jax.tree.map(np.testing.assert_array_equal, u1, u2)
  # eps=1 keeps the clipped gradient's size visible: first step u = g / (|g| + 1)
  np.testing.assert_allclose(-u1["a"], 0.3 / 1.3, rtol=1e-5)


def test_mu_dtype_bfloat16_state_is_kept():
  params = {"w": jnp.ones((4, 4))}
  tx = ak.adam(0.1, mu_dtype=jnp.bfloat16)
  state = tx.init(params)
  _, state = tx.update({"w": jnp.full((4, 4), 0.5)}, state, params)
  inner = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ak.ScaleByAdamState))
           if isinstance(s, ak.ScaleByAdamState)][0]
  assert inner.mu["w"].dtype == jnp.bfloat16 and inner.nu["w"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(inner.mu["w"], np.float32), 0.05, rtol=1e-2)


def test_adamax_moment_dtypes():
  params = {"w": jnp.ones((4, 4))}
  ref = ak.adamax(0.1)
  tx = ak.adamax(0.1, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
  g = {"w": jnp.full((4, 4), 0.5)}
  u, state = tx.update(g, tx.init(params), params)
  r, _ = ref.update(g, ref.init(params), params)
  inner = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ak.ScaleByAdamaxState))
           if isinstance(s, ak.ScaleByAdamaxState)][0]
  assert inner.mu["w"].dtype == jnp.bfloat16 and inner.nu["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(u["w"], r["w"], rtol=1e-6)  # same first step (f32 arithmetic)


@pytest.mark.parametrize("make,name", [
    (lambda: ak.adam(0.1), "ak.adam"), (lambda: ak.adamax(0.1), "ak.adamax"),
    (lambda: ak.adam(0.1, grad_clip=ak.ClipGradByGlobalNorm(1.0)), "ak.adam"),
    (lambda: ak.scale_by_adam(), "ak.scale_by_adam"),
    (lambda: ak.scale_by_adamax(), "ak.scale_by_adamax")])
def test_dense_optimizers_refuse_row_sparse_gradients(make, name):
  """A RowSparse leaf given to a dense optimizer: a TypeError naming the optimizer, the leaf
  and the sparse alternatives, not a pytree mismatch from deep inside the chain."""
  tx = make()
  params = {"emb": jnp.zeros((5, 2)), "w": jnp.zeros(2)}
  grads = {"emb": ak.RowSparse(jnp.array([1]), jnp.ones((1, 2)), 5), "w": jnp.ones(2)}
  with pytest.raises(TypeError, match=rf"{name} takes dense gradients, but 'emb' is a "
                                      r"RowSparse\. Use ak\.sparse_adam"):
    tx.update(grads, tx.init(params), params)


# ------------------------------------------------------- the anchors' ranges and types


@pytest.mark.parametrize("b1,b2", [(0.0, 0.75), (0.5, 0.0), (0.0, 0.0)])  # float32-exact betas
def test_zero_betas_match_optax(b1, b2):
  """optax, PyTorch and Paddle accept b1 = 0 and b2 = 0; so does adamkit, with optax's numbers."""
  params = {"w": jnp.array([1.0, -2.0, 0.5])}
  ours, ref = ak.adam(0.1, b1, b2, eps_mode="corrected"), optax.adam(0.1, b1, b2)
  p, q, s, r = params, params, ours.init(params), ref.init(params)
  for i in range(4):
    g = {"w": jnp.array([0.3, -1.0, 2.0]) * (i + 1)}
    u, s = ours.update(g, s, p)
    p = optax.apply_updates(p, u)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: float ** int32
      v, r = ref.update(g, r, q)
    q = optax.apply_updates(q, v)
  np.testing.assert_allclose(p["w"], q["w"], rtol=1e-5)
  assert not np.allclose(p["w"], params["w"])


def _complex_parabola(tx, ref_tx, steps=40):
  target = jnp.array([1 + 2j, -0.5 + 0.25j, 3j], jnp.complex64)
  loss = lambda p: jnp.sum(jnp.abs(p["z"] - target) ** 2)  # noqa: E731
  p = q = {"z": jnp.zeros(3, jnp.complex64)}
  s, r = tx.init(p), ref_tx.init(q)
  start = float(loss(p))
  for _ in range(steps):
    # optax's convention for complex parameters: step along the conjugate gradient
    g = jax.tree.map(jnp.conj, jax.grad(loss)(p))
    u, s = jax.jit(tx.update)(g, s, p)
    p = optax.apply_updates(p, u)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes float32 and complex64
      h = jax.tree.map(jnp.conj, jax.grad(loss)(q))
      v, r = ref_tx.update(h, r, q)
      q = optax.apply_updates(q, v)
  return p, q, s, loss(p), start


def test_complex_parameters_adam_matches_optax():
  p, q, s, final, start = _complex_parabola(ak.adam(0.1, eps_mode="corrected"), optax.adam(0.1))
  np.testing.assert_allclose(p["z"], q["z"], rtol=2e-5, atol=2e-6)
  assert final < 0.05 * start
  assert s[2][1].mu["z"].dtype == jnp.complex64 and s[2][1].nu["z"].dtype == jnp.complex64
  assert float(jnp.max(jnp.abs(s[2][1].nu["z"].imag))) == 0.0  # |g|^2 is real


def test_complex_parameters_adamax_matches_optax_up_to_eps():
  # MindSpore's eps placement (outside the max) against optax's (inside): eps = 1e-12 makes
  # the two the same formula to float32 rounding.
  p, q, s, final, start = _complex_parabola(ak.adamax(0.1, eps=1e-12), optax.adamax(0.1, eps=1e-12))
  np.testing.assert_allclose(p["z"], q["z"], rtol=2e-5, atol=2e-6)
  assert final < 0.05 * start
  assert all(x.dtype == jnp.complex64 for x in (s[2][1].mu["z"], s[2][1].nu["z"]))


def test_complex_parameters_refused_where_unsupported():
  with pytest.raises(TypeError, match="'z' has dtype complex64"):
    ak.sparse_adam(0.1).init({"z": jnp.zeros(2, jnp.complex64)})


def test_python_number_params_as_optax():
  """optax optimizes a tree of Python floats; so does adamkit (same numbers)."""
  params = {"w": 1.0, "v": [2.0, -1.0]}
  grads = {"w": 0.5, "v": [1.0, -3.0]}
  ours, ref = ak.adam(0.1, eps_mode="corrected"), optax.adam(0.1)
  u, _ = ours.update(grads, ours.init(params), params)
  with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: float ** int32
    v, _ = ref.update(grads, ref.init(params), params)
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(v)):
    np.testing.assert_allclose(a, b, rtol=1e-5)  # float32 b2 vs optax's double 1 - b2
  with pytest.raises(TypeError, match="leaf 'n' has dtype int"):
    ak.adam().init({"n": 3})
  with pytest.raises(TypeError, match="leaf 's' is a str"):
    ak.adam().init({"s": "x"})


def test_each_option_validated_once(monkeypatch):
  """The named optimizer checks its options at the outer door; the primitives it builds
  trust them. A primitive called directly still checks."""
  from adamkit import _validate
  calls = []
  real = _validate._concrete_scalar  # every value check that does run goes through it

  def spy(name, value):
    calls.append(name)
    return real(name, value)

  monkeypatch.setattr(_validate, "_concrete_scalar", spy)
  ak.adam(0.1, groups=[ak.Group("a*"), ak.Group("b*", b1=0.5)])
  assert sorted(calls) == ["b1", "b2", "eps", "groups[1].b1", "learning_rate", "loss_scale",
                           "weight_decay"]
  calls.clear()
  ak.scale_by_adam()
  assert sorted(calls) == ["b1", "b2", "eps"]


def test_injected_hyperparameters_are_validated():
  params = {"w": jnp.ones(3)}
  for inject in (optax.inject_hyperparams, ak.inject_hyperparams):
    with pytest.raises(ValueError, match=r"`b1` must be in the range \[0.0, 1.0\)"):
      inject(ak.adam)(learning_rate=0.1, b1=1.5).init(params)
    with pytest.raises(ValueError, match="`eps`"):
      inject(ak.adamax)(learning_rate=0.1, eps=1e-40).init(params)
