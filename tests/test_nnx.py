"""Flax NNX: ``nnx.Optimizer(model, ak.adam(...), wrt=nnx.Param)`` trains like plain optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adamkit as ak

nnx = pytest.importorskip("flax.nnx")


class Net(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(3, 8, rngs=rngs)
    self.ln = nnx.LayerNorm(8, rngs=rngs)
    self.l2 = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.ln(jax.nn.tanh(self.l1(x))))


def _data(n=32):
  kx, kn = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (n, 3))
  y = jnp.sin(x[:, :1] * 2.0) + 0.1 * jax.random.normal(kn, (n, 1))
  return x, y


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _train_nnx(tx, steps):
  model = Net(nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x, y = _data()

  @nnx.jit
  def step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(_loss)(model, x, y)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt, x, y)) for _ in range(steps)]
  return nnx.to_pure_dict(nnx.state(model, nnx.Param)), losses


def _train_pure(tx, steps):
  """The same model as a pure function of a plain dict of params, trained with optax."""
  graphdef, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)
  pure = nnx.to_pure_dict(params)
  x, y = _data()

  def loss_fn(p):
    state = jax.tree.map(lambda v: v, params)  # a copy to fill; `params` stays as is
    nnx.replace_by_pure_dict(state, p)
    return _loss(nnx.merge(graphdef, state, rest), x, y)

  @jax.jit
  def step(p, s):
    g = jax.grad(loss_fn)(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  s = tx.init(pure)
  for _ in range(steps):
    pure, s = step(pure, s)
  return pure


# The decay mask written out by hand: only kernels decay (Flax's usual convention).
HAND_MASK = {"l1": {"kernel": True, "bias": False}, "ln": {"scale": False, "bias": False},
             "l2": {"kernel": True, "bias": False}}


def test_nnx_optimizer_equals_pure_optax_run_with_flax_mask():
  nnx_params, losses = _train_nnx(
      ak.adam(0.05, weight_decay=0.1, weight_decay_mask=ak.masks.flax_rule()), steps=8)
  pure = _train_pure(ak.adam(0.05, weight_decay=0.1, weight_decay_mask=HAND_MASK), steps=8)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               nnx_params, pure)
  assert losses[-1] < 0.7 * losses[0]
  # The mask matters: decaying every leaf lands elsewhere (so the comparison can fail).
  all_decay = _train_pure(ak.adam(0.05, weight_decay=0.1, weight_decay_mask=None), steps=8)
  assert not np.allclose(all_decay["ln"]["scale"], pure["ln"]["scale"], rtol=0, atol=1e-6)


def test_nnx_corrected_adam_equals_optax_adam():
  """ak.adam(eps_mode="corrected") without decay is optax.adam, through nnx too (to float32
  rounding, which five steps through tanh and LayerNorm amplify to about 1e-6)."""
  ours, _ = _train_nnx(ak.adam(0.05, eps_mode="corrected"), steps=5)
  with jax.numpy_dtype_promotion("standard"):  # optax's own code mixes int and float
    theirs, _ = _train_nnx(optax.adam(0.05), steps=5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), ours, theirs)


def test_flax_rule_on_nnx_names():
  """NNX leaf paths end in ``.value`` (``ln.scale.value``): the name rules still apply."""

  class Norms(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(2, 4, rngs=rngs)
      self.bn = nnx.BatchNorm(4, rngs=rngs)
      self.ln = nnx.LayerNorm(4, rngs=rngs)

  params = nnx.state(Norms(nnx.Rngs(0)), nnx.Param)
  mask = nnx.to_pure_dict(ak.masks.flax_rule().mask(params))
  assert mask == {"fc": {"kernel": True, "bias": False},
                  "bn": {"scale": False, "bias": False},
                  "ln": {"scale": False, "bias": False}}
  # MindSpore's default rule looks for 'beta'/'gamma', which Flax names never contain.
  ms = nnx.to_pure_dict(ak.masks.mindspore_rule().mask(params))
  assert all(jax.tree.leaves(ms))


def test_glob_rules_match_nnx_variable_names():
  # path names drop NNX's trailing `.value`, so glob rules see `fc.kernel`
  state = {"fc": {"kernel": nnx.Param(jnp.ones((2, 2))), "bias": nnx.Param(jnp.ones(2))}}
  mask = ak.masks.match_names("*.kernel").mask(state)
  flat = jax.tree.leaves(mask)
  assert sorted(flat) == [False, True]


def test_nnx_embed_inside_value_and_sparse_grad_names_the_way():
  """nnx.Embed reads the whole table; value_and_sparse_grad says to use ak.lookup."""
  emb = nnx.Embed(10, 3, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(emb)

  def loss(p, ids):
    return jnp.sum(nnx.merge(graphdef, p, copy=True)(ids))

  with pytest.raises(TypeError, match=r"ak\.lookup\(self\.embedding, ids\)"):
    ak.value_and_sparse_grad(loss)(params, {"embedding": jnp.array([1, 2])}, jnp.array([1, 2]))


class _Tower(nnx.Module):
  def __init__(self, rngs):
    self.embedding = nnx.Param(jax.random.normal(rngs.params(), (20, 3)))
    self.w = nnx.Param(jnp.ones(3))

  def __call__(self, ids):
    return ak.lookup(self.embedding, ids) @ self.w[...]


def test_nnx_sparse_training_matches_plain_sparse_adam():
  """nnx.Optimizer + ak.sparse_adam on RowSparse gradients == the same run on a dict."""
  ids, y = jnp.array([4, 9, 4]), jnp.array([1.0, -2.0, 0.5])
  model = _Tower(nnx.Rngs(0))
  start = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  opt = nnx.Optimizer(model, ak.sparse_adam(0.1), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    pure = lambda p: jnp.mean((nnx.merge(graphdef, p, rest, copy=True)(ids) - y) ** 2)  # noqa: E731
    _, grads = ak.value_and_sparse_grad(pure)(params, {"embedding": ids})
    g = grads["embedding"]
    assert isinstance(g.get_value() if hasattr(g, "get_value") else g, ak.RowSparse)
    opt.update(model, grads)

  for _ in range(3):
    step(model, opt)
  got = nnx.to_pure_dict(nnx.state(model, nnx.Param))

  def loss(p, ids, y):
    return jnp.mean((ak.lookup(p["embedding"], ids) @ p["w"] - y) ** 2)

  tx, p = ak.sparse_adam(0.1), start
  state = tx.init(p)
  for _ in range(3):
    _, g = ak.value_and_sparse_grad(loss)(p, {"embedding": ids}, ids, y)
    u, state = tx.update(g, state, p)
    p = ak.apply_updates(p, u)
  np.testing.assert_allclose(got["embedding"], p["embedding"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(got["w"], p["w"], rtol=1e-6, atol=1e-7)
  untouched = np.setdiff1d(np.arange(20), np.asarray(ids))
  np.testing.assert_array_equal(got["embedding"][untouched], start["embedding"][untouched])
  assert float(ak.get_lr(opt)) == pytest.approx(0.1)
  assert float(ak.get_lr(nnx.to_pure_dict(nnx.state(opt))["opt_state"])) == pytest.approx(0.1)
