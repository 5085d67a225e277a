"""Every registry optimizer through the optax and Flax idioms of issue 11 (composition).

What ``tests/test_suite.py`` does not already cover: both ``inject_hyperparams``, optax's
tree utilities, ``optax.masked``, ``eval_shape`` init, one compilation from uncommitted
params, ``nnx.Optimizer``; and sparse gradients inside optax pipelines (what works, what is
refused and with which error).
"""

import dataclasses
import warnings
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from registry import FLAT_STATE, NAMES, NO_LR_RECORD, QUANTIZED, REGISTRY, SPARSE, SPARSE_MULTISTEPS
from test_suite import assert_trees_close, make_grads, make_params

import adamkit as ak
from adamkit._tree import leaf_names, path_name

LR = 0.01


def _steps(tx, params, grads_seq, state=None, update=None):
  state = tx.init(params) if state is None else state
  update = update or jax.jit(tx.update)
  for g in grads_seq:
    u, state = update(g, state, params)
    params = ak.apply_updates(params, u)
  return params, state


# ------------------------------------------------------------------ dense idioms


@pytest.mark.parametrize("name", NAMES)
def test_inject_hyperparams_keeps_structure_and_numbers(name):
  """Both wrappers (optax's and adamkit's) against one run of the plain optimizer."""
  params = make_params()
  grads = [make_grads(params, s) for s in range(2)]
  plain = REGISTRY[name](LR)
  p_ref, s_ref = _steps(plain, params, grads)
  for inject in (optax.inject_hyperparams, ak.inject_hyperparams):
    injected = inject(REGISTRY[name])(lr=LR)
    state = injected.init(params)
    # the wrapped optimizer's state is the plain one: a running state can be wrapped
    assert jax.tree.structure(state.inner_state) == jax.tree.structure(plain.init(params))
    p_inj, s_inj = _steps(injected, params, grads, state=state)
    assert jax.tree.structure(s_inj.inner_state) == jax.tree.structure(s_ref)
    assert_trees_close(p_inj, p_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
def test_masked_leaves_are_untouched(name):
  params = make_params()
  mask = jax.tree.map(lambda _: True, params)
  mask["bias"] = False
  tx = optax.masked(REGISTRY[name](LR), mask)
  p, _ = _steps(tx, params, [make_grads(params, s) for s in range(2)])
  np.testing.assert_array_equal(p["bias"], params["bias"] + make_grads(params, 0)["bias"]
                                + make_grads(params, 1)["bias"])  # masked: raw updates
  assert not np.allclose(p["conv"]["weight"], params["conv"]["weight"])


@pytest.mark.parametrize("name", NAMES)
def test_eval_shape_init_matches_init(name):
  params = make_params()
  tx = REGISTRY[name](LR)
  abstract = jax.eval_shape(tx.init, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
  chex.assert_trees_all_equal_shapes_and_dtypes(abstract, tx.init(params))


def _has_groups(name):
  return name not in NO_LR_RECORD and isinstance(ak.get_lr(REGISTRY[name](LR).init(make_params())), dict)


@pytest.mark.parametrize("name", NAMES)
def test_tree_get_count_is_the_one_step_counter(name):
  """One step counter per optimizer, parameter groups included (MindSpore and Paddle
  keep one step for all groups); the lr record is not a second ``learning_rate``."""
  params = make_params()
  tx = REGISTRY[name](LR)
  _, state = _steps(tx, params, [make_grads(params, s) for s in range(2)])
  assert optax.tree_utils.tree_get(state, "learning_rate") is None  # as on optax.adam's state
  assert len(optax.tree_utils.tree_get_all_with_path(state, "count")) == 1
  assert int(optax.tree_utils.tree_get(state, "count")) == 2
  if name in NO_LR_RECORD:
    with pytest.raises(ValueError, match="learning-rate link"):
      ak.get_lr(state)
    return
  lr = ak.get_lr(state)
  if _has_groups(name):
    assert len(lr) > 1 and lr["default"] == pytest.approx(LR)
  else:
    assert float(lr) == pytest.approx(LR)


@dataclasses.dataclass(frozen=True)
class _Spec:
  """A sharding-spec-like object (optax's own test of ``tree_map_params`` uses one)."""
  axes: Any


# The states optax.tree.map_params cannot map, and why (strict xfails: they must fail).
_FLAT = "multi-tensor moments are flat buffers, not shaped like the params (FLAT_STATE)"
_NONE_COPY = ("a params-shaped field holds None for the float32 params that need no copy "
              "(MasterWeightsState.master / KahanState.compensation): optax meets None "
              "where a spec is")
MAP_PARAMS_LIMITS = {
    **{n: _FLAT for n in FLAT_STATE},
    **{n: _NONE_COPY for n in NAMES if n.startswith("master_weights") or n.endswith("kahan")},
}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(reason=MAP_PARAMS_LIMITS[n], strict=True,
                                            raises=(ValueError, TypeError)))
    if n in MAP_PARAMS_LIMITS else n for n in NAMES])
def test_optax_tree_map_params_maps_every_moment(name):
  """``optax.tree.map_params(tx, f, state, specs)`` (what users call to build a state's
  shardings from the params' specs) puts each param's spec at its moments and nothing
  params-shaped elsewhere, as optax's own test_tree_map_params expects of optax.adam; a
  quantized moment is one leaf (``is_leaf``). Issue 32: sparse Adam's ``row_splits`` was
  a params-shaped dict of None, where optax met None instead of a spec."""
  params = make_params()
  tx = REGISTRY[name](LR)
  _, state = _steps(tx, params, [make_grads(params, 0)])
  leaves, treedef = jax.tree.flatten(params)
  specs = treedef.unflatten([_Spec(i) for i in range(len(leaves))])
  want = dict(zip(leaf_names(params), jax.tree.leaves(specs)))
  out = optax.tree.map_params(tx, lambda _, spec: spec, state, specs,
                              transform_non_params=lambda _: _Spec(None),
                              is_leaf=lambda x: isinstance(x, ak.QuantizedArray))
  found = {}  # moment field -> the params whose spec it holds
  for path, spec in jax.tree_util.tree_flatten_with_path(out)[0]:
    assert isinstance(spec, _Spec), (path, spec)  # every leaf mapped
    if spec.axes is None:
      continue
    at = max(i for i, k in enumerate(path) if isinstance(k, jax.tree_util.GetAttrKey))
    param = path_name(path[at + 1:])
    assert want[param] == spec, (path, spec)
    found.setdefault(path[at].name, set()).add(param)
  assert found.get("mu") == found.get("nu") == set(want), found


@pytest.mark.parametrize("factory", [ak.adam, ak.adamax, ak.adamw, ak.sparse_adam])
def test_groups_keep_the_ungrouped_state(factory):
  """With groups the state is shaped as without: one counter, one moment tree over every
  parameter (``tree_get(state, "mu")`` finds it whole), a ``{group: rate}`` record; each
  leaf's moments and update are those of its own group's settings."""
  params = make_params()
  grads = [make_grads(params, s) for s in range(3)]
  conv = ak.Group("conv.*", lr_scale=2.0, b1=0.5, b2=0.99, name="conv")
  tx = factory(LR, groups=[conv])
  p, state = _steps(tx, params, grads)
  p_default, s_default = _steps(factory(LR), params, grads)
  p_conv, s_conv = _steps(factory(2 * LR, b1=0.5, b2=0.99), params, grads)
  mu = optax.tree_utils.tree_get(state, "mu")
  assert jax.tree.structure(mu) == jax.tree.structure(params)
  ref_mu = dict(optax.tree_utils.tree_get(s_default, "mu"),
                conv=optax.tree_utils.tree_get(s_conv, "mu")["conv"])
  assert_trees_close(mu, ref_mu, rtol=1e-6, atol=0)
  assert_trees_close(p, dict(p_default, conv=p_conv["conv"]), rtol=1e-6, atol=1e-7)
  assert int(optax.tree_utils.tree_get(state, "count")) == 3
  assert ak.get_lr(state) == {"default": pytest.approx(LR), "conv": pytest.approx(2 * LR)}
  # the same structure as the ungrouped state but for the per-group rate record
  strip = lambda s: jax.tree.map(lambda x: 0, s, is_leaf=lambda x: isinstance(x, dict)  # noqa: E731
                                 and set(x) == {"default", "conv"})
  assert jax.tree.structure(strip(state)) == jax.tree.structure(strip(s_default))


@pytest.mark.parametrize("inject", [optax.inject_hyperparams, ak.inject_hyperparams])
@pytest.mark.parametrize("name", [n for n in NAMES if "offload" not in n])
def test_tree_get_on_an_injected_state(name, inject):
  """``learning_rate`` is the injected rate; ``count`` is found twice (the wrapper's own,
  which drives scheduled hyperparameters, and the optimizer's): ``state.inner_state``
  holds the optimizer's alone."""
  params = make_params()
  tx = inject(lambda learning_rate: REGISTRY[name](learning_rate))(learning_rate=0.02)
  _, state = _steps(tx, params, [make_grads(params, s) for s in range(3)])
  assert float(optax.tree_utils.tree_get(state, "learning_rate")) == pytest.approx(0.02)
  with pytest.raises(KeyError, match="multiple values"):
    optax.tree_utils.tree_get(state, "count")
  assert int(state.count) == 3
  assert int(optax.tree_utils.tree_get(state.inner_state, "count")) == 3


@pytest.mark.parametrize("inject", [optax.inject_hyperparams, ak.inject_hyperparams])
def test_get_lr_follows_injected_rate_and_set_lr(inject):
  params = make_params()
  tx = inject(ak.adam)(learning_rate=0.1)
  state = tx.init(params)
  assert float(ak.get_lr(state)) == pytest.approx(0.1)
  state = ak.set_lr(state, 0.02)  # Paddle: set_lr, then get_lr
  assert float(ak.get_lr(state)) == pytest.approx(0.02)
  g = make_grads(params, 0)
  u, state = jax.jit(tx.update)(g, state, params)
  ref, _ = ak.adam(0.02).update(g, ak.adam(0.02).init(params), params)
  assert_trees_close(u, ref)
  assert float(ak.get_lr(state)) == pytest.approx(0.02)
  with pytest.raises(ValueError, match="inject_hyperparams"):
    ak.set_lr(ak.adam(0.1).init(params), 0.5)
  with pytest.raises(ValueError, match="learning_rate"):
    ak.set_lr(state, -1.0)


# One compilation over several steps, from uncommitted params (as jnp creates them), from
# params committed to one device and from params replicated over a mesh: the state's
# scalars are placed as the jitted step returns them. The exception is JAX's cache rule:
# an offloaded state lives in host memory, which only a committed array can, so the step
# returns committed params and uncommitted params would compile a second time. No
# transform can commit the caller's arrays: the offloaded init warns and names the remedy
# (commit the params first), which the test then follows.
@pytest.mark.parametrize("placement", ["uncommitted", "committed", "mesh"])
@pytest.mark.parametrize("name", NAMES)
def test_one_compilation_over_several_steps(name, placement):
  tx = REGISTRY[name](LR)
  params = make_params()
  if placement == "uncommitted" and "offload" in name:
    with pytest.warns(ak.UncommittedParamsWarning, match=r"jax\.device_put\(params"):
      tx.init(params)
    params = jax.device_put(params, jax.devices()[0])
  if placement == "committed":
    params = jax.device_put(params, jax.devices()[0])
  elif placement == "mesh":
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    # a spec per axis: jit returns a replicated array as P(None, ...), not P()
    spec = lambda x: jax.sharding.PartitionSpec(*[None] * x.ndim)  # noqa: E731
    params = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec(x))),
                          params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates), state

  with warnings.catch_warnings():
    warnings.simplefilter("error", ak.UncommittedParamsWarning)
    state = tx.init(params)
  for s in range(3):
    params, state = step(params, state, make_grads(make_params(), s))
  assert step._cache_size() == 1


nnx = pytest.importorskip("flax.nnx")


@pytest.mark.parametrize("name", NAMES)
def test_nnx_optimizer_matches_pure_optax(name):
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  opt = nnx.Optimizer(model, REGISTRY[name](LR), wrt=nnx.Param)
  x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)

  def loss(m):
    return jnp.mean((m(x) - 1.0) ** 2)

  @nnx.jit
  def step(model, opt):
    grads = nnx.grad(loss)(model)
    opt.update(model, grads)

  for _ in range(2):
    step(model, opt)
  tx = REGISTRY[name](LR)
  graphdef, _ = nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))

  def pure_loss(p):
    m = nnx.merge(graphdef, nnx.State(p))
    return loss(m)

  p, state = params, tx.init(params)
  for _ in range(2):
    u, state = tx.update(jax.grad(pure_loss)(p), state, p)
    p = ak.apply_updates(p, u)
  assert_trees_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)), p)
  if name not in NO_LR_RECORD:
    assert float(np.asarray(jax.tree.leaves(ak.get_lr(opt))[0])) == pytest.approx(LR)


class _Leaves(nnx.Module):
  def __init__(self, **leaves):
    for k, v in leaves.items():
      setattr(self, k, v if isinstance(v, nnx.Module) else nnx.Param(v))


def _nnx_net(p):
  """An NNX module holding the suite's leaves (the names the registry's groups and masks
  match)."""
  return _Leaves(conv=_Leaves(**p["conv"]), bn=_Leaves(**p["bn"]), head=p["head"], bias=p["bias"])


def _target_loss(tree, step):
  """A loss of any form of the params (the leaves in one order for a dict and an
  ``nnx.State``), so that ``jax.grad`` hands back gradients in the params' own form (targets by leaf name:
  an ``nnx.State`` keeps its attributes' order, a dict sorts its keys)."""
  g = make_grads(make_params(), step)
  targets = {"conv.weight": g["conv"]["weight"], "bn.gamma": g["bn"]["gamma"],
             "bn.beta": g["bn"]["beta"], "head": g["head"][0], "bias": g["bias"]}
  return sum(jnp.sum((x - targets[n]) ** 2)
             for n, x in zip(leaf_names(tree), jax.tree.leaves(tree)))


def _functional_run(tx, params, steps=2):
  state, update = tx.init(params), jax.jit(tx.update)
  for s in range(steps):
    g = jax.grad(_target_loss)(params, s)
    u, state = update(g, state, params)
    assert jax.tree.structure(u) == jax.tree.structure(params)  # updates in the params' form
    params = ak.apply_updates(params, u)
  return params, state


def _check_nnx_forms(name, forms=("split", "pure")):
  plain = make_params()  # without the head's None (no nnx.Param of None)
  plain = {"conv": plain["conv"], "bn": plain["bn"], "head": plain["head"][0],
           "bias": plain["bias"]}
  want, want_state = _functional_run(REGISTRY[name](LR), plain)
  _, state = nnx.split(_nnx_net(plain))  # an nnx.State of nnx.Param variables
  for form in forms:
    params = nnx.to_pure_dict(state) if form == "pure" else state
    got, got_state = _functional_run(REGISTRY[name](LR), params)
    chex.assert_trees_all_equal(nnx.to_pure_dict(got) if form == "split" else got, want)
    # the state holds the same arrays (moments: plain arrays or codes and scales)
    chex.assert_trees_all_equal(jax.tree.leaves(got_state), jax.tree.leaves(want_state))


@pytest.mark.parametrize("name", NAMES)
def test_nnx_functional_params_match_plain_arrays(name):
  """Issue 32: the params ``nnx.split`` hands out (an ``nnx.State`` of ``nnx.Param``) and
  ``nnx.to_pure_dict``'s train as the plain arrays do, quantized moments included (they
  failed at the first update: "state.mu does not match the gradient tree"); both forms
  against one run on the plain arrays."""
  _check_nnx_forms(name)


@pytest.mark.parametrize("quantized", ["adamw_8bit", "sparse_adam_4bit_full"])
def test_nnx_split_params_with_quantized_moments(quantized):
  """The fast tier's case of the test above (its registry products run in the full suite)."""
  _check_nnx_forms(quantized, ("split",))


# ------------------------------------------------------------------ sparse idioms

N, D = 6, 2


def _sparse_params():
  return {"emb": jnp.linspace(-1.0, 1.0, N * D).reshape(N, D), "w": jnp.ones(2)}


def _sparse_grads(seed, nan=False):
  values = jax.random.normal(jax.random.key(seed), (3, D))
  if nan:
    values = values.at[0, 0].set(jnp.nan)
  return {"emb": ak.RowSparse(jnp.array([2, 5, 2]), values, N),
          "w": jnp.array([0.5, -1.0]) * (seed + 1)}


def _dense(g):
  return jax.tree.map(lambda x: x.todense() if isinstance(x, ak.RowSparse) else x, g,
                      is_leaf=lambda x: isinstance(x, ak.RowSparse))


@pytest.mark.parametrize("name", SPARSE)
def test_zero_nans_before_sparse_optimizer_is_dense_zero_nans(name):
  params = _sparse_params()
  grads = [_sparse_grads(0, nan=True), _sparse_grads(1)]
  tx = optax.chain(optax.zero_nans(), REGISTRY[name](LR))
  p, _ = _steps(tx, params, grads)
  zero = lambda x: jnp.where(jnp.isnan(x), 0.0, x)  # noqa: E731
  clean = [{"emb": g["emb"].with_values(zero(g["emb"].values)), "w": zero(g["w"])}
           for g in grads]
  ref, _ = _steps(REGISTRY[name](LR), params, clean)
  assert_trees_close(p, ref)
  assert np.isfinite(np.asarray(p["emb"])).all()


@pytest.mark.parametrize("name", [n for n in SPARSE if n != "sparse_adam_dense_rows"])
def test_apply_if_finite_skips_a_sparse_nan_step(name):
  params = _sparse_params()
  tx = optax.apply_if_finite(REGISTRY[name](LR), max_consecutive_errors=3)
  state = tx.init(params)
  u, state2 = jax.jit(tx.update)(_sparse_grads(0, nan=True), state, params)
  assert int(state2.notfinite_count) == 1
  chex.assert_trees_all_equal(state2.inner_state, state.inner_state)
  p, _ = _steps(tx, params, [_sparse_grads(1)], state=state2)
  ref, _ = _steps(REGISTRY[name](LR), params, [_sparse_grads(1)])
  assert_trees_close(p, ref)


@pytest.mark.parametrize("clip", [ak.ClipGradByGlobalNorm(0.5), ak.ClipGradByNorm(0.5),
                                  ak.ClipGradByValue(0.7)])
@pytest.mark.parametrize("lazy", [False, True])
def test_sparse_grad_clip_is_the_dense_clip(clip, lazy):
  """The clipping norm of a RowSparse is that of its dense equivalent (duplicates summed)."""
  params = _sparse_params()
  grads = [_sparse_grads(s) for s in range(3)]
  p, _ = _steps(ak.sparse_adam(LR, lazy=lazy, grad_clip=clip, loss_scale=2.0), params, grads)
  # dense reference on the densified gradient; lazily only touched rows move (2 and 5 here,
  # every step), so both modes agree with dense Adam on those rows
  ref, _ = _steps(ak.adam(LR, grad_clip=clip, loss_scale=2.0), params, [_dense(g) for g in grads])
  rows = np.array([2, 5]) if lazy else np.arange(N)
  np.testing.assert_allclose(p["emb"][rows], ref["emb"][rows], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(p["w"], ref["w"], rtol=1e-6, atol=1e-7)


def test_sparse_groups_and_skip():
  params = _sparse_params()
  tx = ak.sparse_adam(LR, groups=[ak.Group("w", lr=0.5)], nonfinite="skip")
  state = tx.init(params)
  u, state = jax.jit(tx.update)(_sparse_grads(0, nan=True), state, params)
  moved = ak.apply_updates(params, u)  # a skipped step moves no row
  chex.assert_trees_all_equal(moved, params)
  p, state = _steps(tx, params, [_sparse_grads(1)], state=state)
  assert float(jnp.max(jnp.abs(p["w"] - params["w"]))) == pytest.approx(0.5, rel=1e-4)
  assert ak.get_lr(state) == {"default": pytest.approx(LR), "group0": pytest.approx(0.5)}


def test_row_sparse_addition_is_the_dense_sum():
  g = ak.RowSparse(jnp.array([1, 3, 1]), jnp.array([[1.0], [2.0], [4.0]]), 5)
  h = ak.RowSparse(jnp.array([3, 0]), jnp.array([[8.0], [16.0]]), 5)
  table = jnp.arange(5.0).reshape(5, 1)
  np.testing.assert_array_equal(table + g, table + g.todense())
  np.testing.assert_array_equal(g + table, table + g.todense())
  np.testing.assert_array_equal((g + h).todense(), g.todense() + h.todense())
  # optax.apply_updates applies a lazy RowSparse update (so does nnx.Optimizer)
  out = optax.apply_updates({"t": table}, {"t": g})
  np.testing.assert_array_equal(out["t"], ak.apply_updates({"t": table}, {"t": g})["t"])
  with pytest.raises(ValueError, match="dense shapes"):
    g + ak.RowSparse(jnp.array([0]), jnp.ones((1, 1)), 6)
  with pytest.raises(TypeError, match="one 1-D integer array"):
    ak.RowSparse([jnp.array([0, 1]), jnp.array([2])], jnp.ones((3, 1)), 5)


HINT = r"adamkit\.RowSparse\.indices .*with_values"
MOVE_IDS = [
    ("times 3", lambda g, h: jax.tree.map(lambda x: x * 3, g), TypeError, HINT),
    ("plus 1", lambda g, h: jax.tree.map(lambda x: x + 1, g), TypeError, HINT),
    ("negate", lambda g, h: jax.tree.map(jnp.negative, g), TypeError, HINT),
    ("add two", lambda g, h: jax.tree.map(jnp.add, g, h), TypeError, HINT),
    ("maximum", lambda g, h: jax.tree.map(jnp.maximum, g, h), TypeError, HINT),
    ("clip", lambda g, h: jax.tree.map(lambda x: jnp.clip(x, 0, 4), g), TypeError, HINT),
    # (eagerly, JAX's key array has no ``.real``: NotImplementedError, without the name)
    ("global norm", lambda g, h: optax.tree.norm(g), (TypeError, NotImplementedError), None),
    # JAX refuses casts of an extended dtype with its own exception types (the eager
    # ``.astype`` without the dtype's name); loud either way
    ("cast", lambda g, h: jax.tree.map(lambda x: jnp.astype(x, jnp.float32), g), ValueError,
     HINT),
    ("astype", lambda g, h: jax.tree.map(lambda x: x.astype(jnp.int32), g),
     (ValueError, NotImplementedError), None),
]


@pytest.mark.parametrize("jitted", [False, True])
@pytest.mark.parametrize("op,exc,words", [m[1:] for m in MOVE_IDS], ids=[m[0] for m in MOVE_IDS])
def test_no_tree_map_moves_row_ids(op, exc, words, jitted):
  """Issue 11: ``jax.tree.map(lambda x: x * 3, g)`` moved ids [2, 5] to rows [6, 15] and
  ``jax.tree.map(jnp.add, g1, g2)`` added ids, silently. Every arithmetic map over the id
  leaf now raises at trace time, and the text says what to use instead."""
  g = ak.RowSparse(jnp.array([2, 5]), jnp.ones((2, 3)), 10)
  h = ak.RowSparse(jnp.array([1, 7]), jnp.ones((2, 3)), 10)
  fn = jax.jit(op) if jitted else op
  with pytest.raises(exc, match=words):
    fn(g, h)


def test_maps_that_keep_row_ids_work():
  g = ak.RowSparse(jnp.array([2, 5, 2]), jnp.arange(6.0).reshape(3, 2), 10)
  dense = g.todense()
  same = [
      jax.jit(lambda g: g)(g),
      jax.device_put(g, jax.devices()[0]),
      jax.tree.map(lambda x: jnp.where(jnp.isnan(x), jnp.zeros_like(x), x), g),
      jax.tree.map(lambda x: x[::-1], g),  # reorders ids and rows together
      jax.tree.map(lambda x: x[1], jax.vmap(lambda g: g)(jax.tree.map(
          lambda x: jnp.stack([x, x]), g))),  # stacked, vmapped, unstacked
      jax.tree.map(lambda x: jnp.concatenate([x, x[:0]]), g),
  ]
  for out in same:
    np.testing.assert_array_equal(out.todense(), dense)
    assert out.indices.dtype == jnp.int32
  zeros = jax.tree.map(jnp.zeros_like, g)  # optax's zero trees: a gradient of zeros
  np.testing.assert_array_equal(zeros.todense(), jnp.zeros_like(dense))
  np.testing.assert_array_equal(g.with_values(2 * g.values).todense(), 2 * dense)
  np.testing.assert_array_equal(jax.eval_shape(lambda g: g, g).indices.shape, (3,))


@pytest.mark.parametrize("name", SPARSE)
def test_hand_rebuilt_float_row_ids_are_refused(name):
  """The protected id dtype guards ``ak.RowSparse`` and ``RowSparse.of``; a RowSparse
  rebuilt by hand (``tree_unflatten``) from float ids is refused while tracing, by name."""
  params = _sparse_params()
  tx = REGISTRY[name](LR)
  g = _sparse_grads(0)
  g["emb"] = ak.RowSparse.tree_unflatten(N, (g["emb"].indices.astype(jnp.float32),
                                             g["emb"].values))
  with pytest.raises(TypeError, match="'emb' reached the optimizer with float32 row ids"):
    jax.jit(tx.update)(g, tx.init(params), params)


# (optimizer-independent) the optax transforms that map over row ids, and the errors.
REFUSED = [
    ("clip", lambda tx: optax.chain(optax.clip(1.0), tx), TypeError, "grad_clip="),
    ("scale", lambda tx: optax.chain(optax.scale(0.5), tx), TypeError, "loss_scale="),
    # JAX refuses the tree norm over the ids' dtype, whose name says what to use
    ("clip_by_global_norm", lambda tx: optax.chain(optax.clip_by_global_norm(1.0), tx),
     TypeError, "grad_clip="),
    # optax.MultiSteps maps over (updates, zeros_like(params)): JAX refuses the RowSparse
    # against the dense table before adamkit sees it. ak.multi_steps is the way (below).
    ("MultiSteps", lambda tx: optax.MultiSteps(tx, every_k_schedule=2), ValueError,
     "RowSparse"),
]


@pytest.mark.parametrize("idiom,wrap,exc,words", REFUSED, ids=[r[0] for r in REFUSED])
@pytest.mark.parametrize("name", SPARSE)
def test_id_mapping_transforms_are_refused_at_trace_time(name, idiom, wrap, exc, words):
  params = _sparse_params()
  tx = wrap(REGISTRY[name](LR))
  # JAX's default ("standard") promotion, as users run; under "strict" JAX itself refuses
  # float * int ids with a TypePromotionError, before adamkit sees them
  with jax.numpy_dtype_promotion("standard"):
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(".", r"\.")):
      jax.jit(tx.update)(_sparse_grads(0), tx.init(params), params)


@pytest.mark.parametrize("name", SPARSE)
def test_sparse_multi_steps_is_one_step_on_the_mean(name):
  """ak.multi_steps over 2 micro-steps == one step on the averaged gradient: the two
  RowSparse gradients' ids and values concatenated, values halved (row 2 repeats)."""
  params = _sparse_params()
  grads = [_sparse_grads(s) for s in range(4)]
  p, state = _steps(SPARSE_MULTISTEPS[name](LR, 2, {"emb": 3}), params, grads)

  def mean(a, b):
    emb = ak.RowSparse(jnp.concatenate([a["emb"].indices, b["emb"].indices]),
                       jnp.concatenate([a["emb"].values, b["emb"].values]) / 2, N)
    return {"emb": emb, "w": (a["w"] + b["w"]) / 2}

  ref, _ = _steps(REGISTRY[name](LR), params, [mean(*grads[:2]), mean(*grads[2:])])
  assert_trees_close(p, ref)
  assert int(state.gradient_step) == 2


def test_sparse_adam_offloaded_in_compute_mode_points_to_state_mode():
  params = _sparse_params()
  tx = ak.offload(ak.sparse_adam(LR), mode="compute")
  with pytest.raises(RuntimeError, match="Use mode='state'"):
    tx.update(_sparse_grads(0), tx.init(params), params)


def test_apply_if_finite_outside_a_non_lazy_sparse_optimizer_is_refused():
  """A non-lazy sparse step turns a RowSparse gradient into a dense update, and
  optax.apply_if_finite's skip branch returns zeros shaped like the gradient: lax.cond
  refuses the two. ``ak.sparse_adam(lazy=False, nonfinite="skip")`` is the adamkit way."""
  params = _sparse_params()
  tx = optax.apply_if_finite(ak.sparse_adam(LR, lazy=False), max_consecutive_errors=3)
  with pytest.raises(TypeError, match="cond branch outputs must have the same pytree"):
    jax.jit(tx.update)(_sparse_grads(0), tx.init(params), params)
  tx = ak.sparse_adam(LR, lazy=False, nonfinite="skip")
  state = tx.init(params)
  u, state2 = jax.jit(tx.update)(_sparse_grads(0, nan=True), state, params)
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(u))
  chex.assert_trees_all_equal(state2.inner_state, state.inner_state)
  assert int(state2.notfinite_count) == 1


def test_dense_only_optimizers_refuse_row_sparse():
  params = _sparse_params()
  for name in sorted(set(NAMES) - set(SPARSE)):
    tx = REGISTRY[name](LR)
    # a fused step with quantized moments whose blocks span the table's rows (blocks of
    # 256, rows of 2): its lazy row step cannot keep to the touched rows' own blocks
    refusal = ValueError if name in QUANTIZED and "fused" in name else TypeError
    with pytest.raises(refusal, match="RowSparse"):
      tx.update(_sparse_grads(0), tx.init(params), params)


# ------------------------------------------------------------------ documentation


def _python_blocks(path):
  import pathlib
  import re
  text = pathlib.Path(__file__).resolve().parents[1].joinpath(path).read_text()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("page", ["docs/composition.md", "docs/nnx.md"])
def test_docs_examples_run(page):
  """The pages' examples run as written, in order, sharing one namespace per page."""
  if page == "docs/nnx.md":
    pytest.importorskip("orbax.checkpoint")
  blocks = _python_blocks(page)
  assert blocks
  namespace = {}
  for code in blocks:
    with jax.numpy_dtype_promotion("standard"):  # as users run (MultiSteps divides int by float)
      exec(compile(code, page, "exec"), namespace)
