"""Issue 21: silent wrong answers and opaque errors found by trying 0.2 from outside.

Each test is one finding's reproduction: it failed (a wrong number, or an error that named
the wrong thing or no remedy) before the fix.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adamkit as ak


def _replace_in(state, cls, **fields):
  """``state`` with the ``cls`` node(s) inside a chain's tuples given new ``fields``."""
  if isinstance(state, cls):
    return state._replace(**fields)
  if isinstance(state, tuple) and not hasattr(state, "_fields"):
    return tuple(_replace_in(s, cls, **fields) for s in state)
  return state


def _find(state, cls):
  if isinstance(state, cls):
    return state
  if isinstance(state, tuple) and not hasattr(state, "_fields"):
    for s in state:
      found = _find(s, cls)
      if found is not None:
        return found
  return None


# ----------------------------------------------- integer gradients for float params

CHAINS = {
    "adam": lambda: ak.adam(1e-3),
    "adam_corrected": lambda: ak.adam(1e-3, eps_mode="corrected"),
    "adamw": lambda: ak.adamw(1e-3),
    "adamw_amsgrad": lambda: ak.adamw(1e-3, amsgrad=True),
    "adamax": lambda: ak.adamax(1e-3),
    "sparse_adam": lambda: ak.sparse_adam(1e-3),
    "sparse_adamw": lambda: ak.sparse_adamw(1e-3),
    "fused_adam": lambda: ak.fused_adam(1e-3),
    "fused_adamw": lambda: ak.fused_adamw(1e-3),
    "fused_adamax": lambda: ak.fused_adamax(1e-3),
    "scale_by_adam": lambda: ak.scale_by_adam(),
    "scale_by_adamax": lambda: ak.scale_by_adamax(),
    "scale_by_sparse_adam": lambda: ak.scale_by_sparse_adam(),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_integer_gradients_are_cast_as_optax_does(name):
  """``int32`` gradients for float32 params gave an int32 update ``[0 0 0]``; they are
  cast to the params' dtype, so the update equals that of the same float gradient."""
  tx = CHAINS[name]()
  params = {"w": jnp.ones(3), "b": jnp.full((2,), 2.0)}
  ints = {"w": jnp.ones(3, jnp.int32), "b": jnp.array([3, -1], jnp.int32)}
  floats = jax.tree.map(lambda g: g.astype(jnp.float32), ints)
  got, _ = tx.update(ints, tx.init(params), params)
  want, _ = tx.update(floats, tx.init(params), params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  assert float(jnp.abs(got["w"]).min()) > 0  # not the zero update of the defect


def test_integer_gradients_match_optax_adam():
  params = {"w": jnp.ones(3)}
  g = {"w": jnp.ones(3, jnp.int32)}
  with jax.numpy_dtype_promotion("standard"):  # optax mixes int32 and float32 itself
    o = optax.adam(1e-3)
    want, _ = o.update(g, o.init(params), params)
  tx = ak.adam(1e-3, eps_mode="corrected")
  got, _ = tx.update(g, tx.init(params), params)
  np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got["w"]), -1e-3, rtol=1e-5)


def test_integer_gradients_in_the_fused_step():
  """The fused step left the params untouched with int gradients."""
  opt = ak.fused_adam(0.1, eps_mode="corrected")
  params = {"w": jnp.array([1.0, -2.0])}
  new, _ = opt.step(params, opt.init(params), grads={"w": jnp.array([2, -4], jnp.int32)})
  np.testing.assert_allclose(np.asarray(new["w"]), [0.9, -1.9], rtol=1e-6)


# --------------------------------------------------------- AMSGrad states checked

AMSGRAD = {
    "adam": lambda: ak.adam(0.1, amsgrad=True),
    "adamw": lambda: ak.adamw(0.1, amsgrad=True, weight_decay=0.0),
    "sparse_adamw": lambda: ak.sparse_adamw(0.1, amsgrad=True, weight_decay=0.0),
}


@pytest.mark.parametrize("name", sorted(AMSGRAD))
@pytest.mark.parametrize("field", ["mu", "nu", "nu_max"])
@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_amsgrad_moments_are_checked_against_the_params(name, field, bad):
  """A ``nu_max`` of shape (1,) broadcast (update -0.000707 instead of -0.1), one of dtype
  int32 stayed [0 0] (AMSGrad silently ran as Adam); mu was not checked either."""
  tx = AMSGRAD[name]()
  params = {"w": jnp.ones(2)}
  grads = {"w": jnp.full(2, 0.1)}
  state = tx.init(params)
  wrong = jnp.zeros(1) if bad == "shape" else jnp.zeros(2, jnp.int32)
  state = _replace_in(state, ak.ScaleByAmsgradState, **{field: {"w": wrong}})
  with pytest.raises(ValueError, match=rf"state\.{field} of 'w' has shape"):
    tx.update(grads, state, params)
  with pytest.raises(ValueError, match=rf"state\.{field} of 'w'"):
    jax.jit(tx.update)(grads, state, params)


def test_amsgrad_with_a_good_state_takes_the_full_step():
  """The reference value of the finding: the first AMSGrad step is -lr * sign(g)."""
  for make in AMSGRAD.values():
    tx = make()
    params = {"w": jnp.ones(2)}
    u, _ = tx.update({"w": jnp.full(2, 0.1)}, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(u["w"]), -0.1, rtol=1e-5)


# ---------------------------------------------------------------- complex params


def _complex_problem(seed=0):
  rng = np.random.default_rng(seed)
  c = lambda *s: jnp.asarray(rng.normal(size=s) + 1j * rng.normal(size=s), jnp.complex64)  # noqa: E731
  params = {"w": c(3, 2), "b": c(2)}
  grads = [{"w": c(3, 2), "b": c(2)} for _ in range(4)]
  return params, grads


def _run(tx, params, grads):
  state = tx.init(params)
  for g in grads:
    u, state = tx.update(g, state, params)
    params = optax.apply_updates(params, u)
  return params


def test_adamw_trains_complex_params_as_optax_adamw():
  """ak.adamw refused complex params; optax.adamw trains them (the porting guide promises
  optax's numbers with eps_mode="corrected" and weight_decay_mask=None)."""
  params, grads = _complex_problem()
  got = _run(ak.adamw(0.05, weight_decay=0.1, weight_decay_mask=None), params, grads)
  with jax.numpy_dtype_promotion("standard"):  # optax mixes complex64 and float32
    want = _run(optax.adamw(0.05, weight_decay=0.1), params, grads)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == jnp.complex64
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)
  assert float(jnp.abs(got["w"] - params["w"]).min()) > 1e-3


def test_coupled_l2_decay_keeps_the_imaginary_part():
  """``g + wd * w`` went through a float32 cast of the complex ``w``: a zero gradient and
  ``w = [1j, 2j]`` gave a zero update."""
  params = {"w": jnp.array([1j, 2j], jnp.complex64)}
  zero = {"w": jnp.zeros(2, jnp.complex64)}
  decay = ak.adam(1.0, weight_decay=0.1, weight_decay_mask=None, eps_mode="corrected")
  u, _ = decay.update(zero, decay.init(params), params)
  # g = wd w = [0.1j, 0.2j]; the first step is -lr g / (|g| + eps), float64 by hand
  g = 0.1 * np.array([1j, 2j])
  np.testing.assert_allclose(np.asarray(u["w"]), -g / (np.abs(g) + 1e-8), rtol=1e-6)
  # and over several steps with gradients, optax's add_decayed_weights + adam
  params, grads = _complex_problem(1)
  got = _run(ak.adam(0.05, weight_decay=0.1, weight_decay_mask=None, eps_mode="corrected"),
             params, grads)
  with jax.numpy_dtype_promotion("standard"):  # optax mixes complex64 and float32
    want = _run(optax.chain(optax.add_decayed_weights(0.1), optax.adam(0.05)), params, grads)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def test_decoupled_decay_keeps_the_imaginary_part():
  params = {"w": jnp.array([1j, 2j], jnp.complex64)}
  zero = {"w": jnp.zeros(2, jnp.complex64)}
  o = optax.add_decayed_weights(0.1)
  want, _ = o.update(zero, o.init(params), params)  # [0.1j, 0.2j]
  tx = ak.add_decoupled_decay(0.1, mask=None)
  got, _ = tx.update(zero, tx.init(params), params)
  np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
  adamw = ak.adamw(1.0, weight_decay=0.1, weight_decay_mask=None)
  u, _ = adamw.update(zero, adamw.init(params), params)
  np.testing.assert_allclose(np.asarray(u["w"]), [-0.1j, -0.2j], rtol=1e-6)


# ------------------------------------------------------ the fused step's argument order


def _fused_forms():
  params = jax.device_put({"w": jnp.array([1.0, -2.0])}, jax.devices()[0])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ak.UncommittedParamsWarning)
    return params, {
        "fused_adam": ak.fused_adam(0.1),
        "fused_adamw": ak.fused_adamw(0.1),
        "fused_adamax": ak.fused_adamax(0.1),
        "master_weights": ak.master_weights(ak.fused_adam(0.1)),
        "offload": ak.offload(ak.fused_adam(0.1)),
    }


def test_a_positional_fused_step_is_refused():
  """``opt.step(grads, state, params)`` (update's order) ran without a word and trained
  the gradients: the gradients are keyword-only now."""
  params, forms = _fused_forms()
  grads = {"w": jnp.array([2.0, -4.0])}
  for name, opt in forms.items():
    state = opt.init(params)
    with pytest.raises(TypeError, match=r"step\(params, state, grads=grads\)"):
      opt.step(grads, state, params)
    with pytest.raises(TypeError, match="by keyword"):
      jax.jit(opt.step)(params, state, grads)
    with pytest.raises(TypeError, match="by keyword"):
      opt.step(params, state)
    new, _ = jax.jit(opt.step)(params, state, grads=grads)
    u, _ = opt.update(grads, opt.init(params), params)
    np.testing.assert_allclose(np.asarray(new["w"]),
                               np.asarray(optax.apply_updates(params, u)["w"]),
                               rtol=1e-6, err_msg=name)


# ------------------------------------------------------------- another optimizer's state


def test_another_optimizers_state_is_named():
  params = {"w": jnp.ones(3)}
  g = {"w": jnp.ones(3)}
  # was AttributeError: 'EmptyState' object has no attribute 'nu'
  with pytest.raises(TypeError, match=r"ak\.adamw's `update` got a state.*tx\.init\(params\)"):
    ak.adamw().update(g, ak.adam().init(params), params)
  # was "amsgrad_direction() missing 1 required positional argument"
  with pytest.raises(TypeError, match="ScaleByAmsgradState.*ScaleBySparseAdamState"):
    ak.sparse_adamw(amsgrad=True).update(g, ak.sparse_adamw().init(params), params)
  with pytest.raises(TypeError, match=r"ak\.adam's `update`.*FusedAdamState"):
    jax.jit(ak.adam().update)(g, ak.fused_adam().init(params), params)
  # the primitives name their own state type
  with pytest.raises(TypeError, match=r"ak\.scale_by_adam takes the ScaleByAmsgradState"):
    ak.scale_by_adam(amsgrad=True).update(g, ak.scale_by_adam().init(params))
  with pytest.raises(TypeError, match=r"ak\.scale_by_adamax takes the ScaleByAdamaxState"):
    ak.scale_by_adamax().update(g, ak.scale_by_adam().init(params))


def test_the_named_remedy_works():
  """The error's remedy for carrying moments over: state_dict / load_state_dict."""
  params = {"w": jnp.ones(3)}
  g = {"w": jnp.full(3, 0.5)}
  adam = ak.adam(0.1)
  _, old = adam.update(g, adam.init(params), params)
  tx = ak.adamw(0.1)
  state = ak.load_state_dict(ak.state_dict(old), tx.init(params))
  _, state = tx.update(g, state, params)
  assert int(ak.state_dict(state)["step"]) == 2


def test_a_state_with_other_options_is_named():
  params = {"w": jnp.ones(3)}
  g = {"w": jnp.ones(3)}
  tx = ak.adam(nonfinite="skip")
  with pytest.raises(TypeError, match="ApplyIfFiniteState"):
    tx.update(g, ak.adam().init(params), params)
  tx = ak.adam(grad_clip=ak.ClipGradByGlobalNorm(1.0))
  with pytest.raises(TypeError, match="grad_clip"):
    tx.update(g, ak.adam().init(params), params)


# ---------------------------------------------------------- sparse: the moment is named


def test_a_short_first_moment_is_named_not_the_gradient():
  """A (10, 4) first moment for a (1000, 4) table said the *gradient* "does not fit a
  table of shape (10, 4)"."""
  params = {"emb": jnp.zeros((1000, 4))}
  grads = {"emb": ak.RowSparse(jnp.array([1, 500]), jnp.ones((2, 4)), 1000)}
  for tx in (ak.sparse_adam(0.1), ak.sparse_adamw(0.1), ak.sparse_adam(0.1, lazy=False)):
    state = _replace_in(tx.init(params), ak.ScaleBySparseAdamState,
                        mu={"emb": jnp.zeros((10, 4))})
    with pytest.raises(ValueError, match=r"state\.mu of 'emb' has shape \(10, 4\)") as err:
      jax.jit(tx.update)(grads, state, params)
    assert "gradient of" not in str(err.value)


# ------------------------------------------------------------ get_lr and foreign keywords


def test_get_lr_on_a_fused_state_says_how_to_read_the_rate():
  params = {"w": jnp.ones(3)}
  schedule = optax.linear_schedule(0.1, 0.01, 10)
  opt = ak.fused_adam(schedule)
  state = opt.init(params)
  for _ in range(3):
    params, state = opt.step(params, state, grads={"w": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"as_schedule\(learning_rate\)\(state\.count\)"):
    ak.get_lr(state)
  with pytest.raises(ValueError, match="inject_hyperparams"):
    ak.get_lr(state)
  # what the message says works: the rate of the next step, and the injected form
  np.testing.assert_allclose(float(ak.as_schedule(schedule)(state.count)), float(schedule(3)))
  tx = ak.inject_hyperparams(ak.fused_adam)(learning_rate=0.1)
  injected = ak.set_lr(tx.init(params), 0.05)
  assert float(ak.get_lr(injected)) == pytest.approx(0.05)


@pytest.mark.parametrize("make, key, names", [
    (ak.adamw, "mask", "weight_decay_mask"),
    (ak.adam, "mask", "weight_decay_mask"),
    (ak.sparse_adamw, "mask", "weight_decay_mask"),
    (ak.fused_adamw, "mask", "weight_decay_mask"),
    (ak.adamw, "lr", "learning_rate"),
    (ak.adam, "betas", "b1"),
    (ak.adamax, "epsilon", "eps"),
    (ak.sparse_adam, "lazy_mode", "lazy"),
    (ak.adam, "apply_decay_param_fun", r"name_rule"),
])
def test_foreign_keywords_point_to_adamkits(make, key, names):
  with pytest.raises(TypeError, match=rf"'{key}'; adamkit's is .*{names}"):
    make(1e-3, **{key: None})


def test_unknown_keywords_keep_pythons_error():
  with pytest.raises(TypeError, match="unexpected keyword argument 'lazy_mode'$"):
    ak.adam(1e-3, lazy_mode=True)  # ak.adam has no `lazy`: nothing to point to


# ------------------------------------------------ orbax restore of an offloaded sparse state


def test_orbax_restored_offloaded_sparse_state_just_works(tmp_path):
  """After a plain orbax restore, ``ak.offload(ak.sparse_adam(...), mode="state")`` failed
  at the next step ("memory_space of all inputs passed to `gather` must be the same"): the
  restored arrays say pinned_host but are typed as device memory. Without
  ``ak.offload_state`` the resumed run is now bit-identical to an uninterrupted one, and a
  warning names ``ak.offload_state`` (a step compiled for such a state moves whole tables)."""
  ocp = pytest.importorskip("orbax.checkpoint")
  n = 200
  tx = ak.offload(ak.sparse_adam(0.05, weight_decay=0.01), mode="state")

  def make_step():  # a fresh jit each: the restored state is the first one it traces
    def step(params, state, ids):
      grads = {"emb": ak.RowSparse(ids, jnp.ones((ids.shape[0], 4)), n), "w": jnp.ones(4)}
      u, state = tx.update(grads, state, params)
      return ak.apply_updates(params, u), state
    return jax.jit(step, donate_argnums=(0, 1))

  fresh = lambda: {"emb": jnp.zeros((n, 4)), "w": jnp.ones(4)}  # noqa: E731 - uncommitted
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ak.UncommittedParamsWarning)
    params, state = fresh(), tx.init(fresh())
    like = {"params": fresh(), "opt_state": tx.init(fresh())}
  params, state = make_step()(params, state, jnp.array([1, 2, 2]))
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  ckptr.wait_until_finished()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  restored = ckptr.restore(tmp_path / "ckpt", abstract)
  b = (restored["params"], restored["opt_state"])
  a = jax.tree.map(jnp.copy, (params, state))
  step_a, step_b = make_step(), make_step()
  for i, ids in enumerate(([3, 4], [1, 3, 3], [5, 199])):
    if i == 0:
      with pytest.warns(ak.OffloadedStateWarning, match=r"ak\.offload_state\(state, params\)"):
        b = step_b(*b, jnp.array(ids))
    else:
      b = step_b(*b, jnp.array(ids))
    a = step_a(*a, jnp.array(ids))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  moments = [x for x in jax.tree.leaves(b[1]) if x.ndim]
  assert {x.sharding.memory_kind for x in moments} == {"pinned_host"}
  assert float(jnp.abs(b[0]["emb"][3]).sum()) > 0
  # The remedy the warning names: the state back in host-typed arrays, no warning.
  again = ckptr.restore(tmp_path / "ckpt", abstract)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ak.OffloadedStateWarning)
    c = make_step()(again["params"], ak.offload_state(again["opt_state"], again["params"]),
                    jnp.array([3, 4]))
  np.testing.assert_array_equal(np.asarray(c[0]["emb"]),
                                np.asarray(make_step()(*jax.tree.map(jnp.copy, (params, state)),
                                                       jnp.array([3, 4]))[0]["emb"]))
