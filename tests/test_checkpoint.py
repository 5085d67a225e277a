"""``ak.state_dict`` / ``ak.load_state_dict`` round trips of quantized states (issue 32).

A quantized moment appears in a state dict as the float32 values it stands for, one entry
per parameter; ``load_state_dict`` quantizes them into the template's format. The
multi-tensor fused step keeps its moments in one flat quantized buffer (each param from a
block's start): its per-parameter entries are written into that buffer and the buffer
quantized whole (they were refused: "shape (8, 20) does not match the moment's (256,)").
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adamkit as ak


def _q(kind):
  # min_size=0 and blocks of 64: every leaf quantized, the (8, 20) one padded (160 -> 192)
  return ak.Quantized(kind, block_size=64, min_size=0)


FORMS = {
    "chain": lambda fmt: ak.adamw(0.01, weight_decay=0.01, mu_dtype=fmt, nu_dtype=fmt),
    "fused_per_leaf": lambda fmt: ak.fused_adamw(0.01, mu_dtype=fmt, nu_dtype=fmt,
                                                 multi_tensor=False),
    "fused_multi_tensor": lambda fmt: ak.fused_adamw(0.01, mu_dtype=fmt, nu_dtype=fmt),
}


def _params():
  k = jax.random.split(jax.random.key(3), 3)
  return {"w": jax.random.normal(k[0], (8, 20)), "b": jax.random.normal(k[1], (30,)),
          "s": jax.random.normal(k[2], (3,))}


def _trained(tx, steps=3):
  params = _params()
  state = tx.init(params)
  for t in range(steps):
    g = jax.tree.map(lambda p, t=t: jnp.cos(p * (t + 1)) * 0.1, params)
    u, state = tx.update(g, state, params)
    params = ak.apply_updates(params, u)
  return params, state


def _qarrays(state):
  return [x for x in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "codes"))
          if hasattr(x, "codes")]


@pytest.mark.parametrize("kind", ["fp8", "4bit", "8bit"])
@pytest.mark.parametrize("form", list(FORMS))
def test_quantized_state_round_trip(form, kind):
  """state -> state_dict -> load_state_dict gives the same codes and scales, but where a
  block's largest entry has no code of its own (the 8-bit signed map of the first moment
  has 1 but not -1: that block's scale and a few codes move, tests/test_quantized.py; an
  exact resume of such a state goes through orbax)."""
  tx = FORMS[form](_q(kind))
  params, state = _trained(tx)
  assert _qarrays(state), "the state is quantized"
  flat = ak.state_dict(state)
  assert flat["w.moment1"].shape == (8, 20) and flat["b.moment2"].shape == (30,)
  back = ak.load_state_dict(flat, tx.init(params))
  if kind != "8bit":
    chex.assert_trees_all_equal(back, state)  # the same codes and scales
    g = jax.tree.map(jnp.sin, params)  # and the same next step
    chex.assert_trees_all_equal(tx.update(g, back, params), tx.update(g, state, params))
    return
  chex.assert_trees_all_equal_structs(back, state)
  for q_back, q in zip(_qarrays(back), _qarrays(state)):
    if q.fmt.role == "nu":  # the unsigned map has its 1: exact
      chex.assert_trees_all_equal(q_back, q)
  again = ak.state_dict(back)
  for name in flat:
    if name.endswith("moment1"):
      same = np.isclose(again[name], flat[name], rtol=1e-2, atol=0)
      assert same.mean() > 0.9, name
    else:
      np.testing.assert_array_equal(again[name], flat[name], err_msg=name)


@pytest.mark.parametrize("form", list(FORMS))
def test_float32_state_dict_loads_into_a_quantized_template(form):
  """A float32 run's state dict quantized into each form: the values each moment stands
  for are the chain form's (one quantization per block; the fused buffer's blocks never
  span two params), within 8-bit's rounding of the float32 moments."""
  _, f32_state = _trained(ak.adamw(0.01, weight_decay=0.01))
  flat = ak.state_dict(f32_state)  # the fused states keep no learning-rate record: strict=False
  params = _params()
  loaded = ak.load_state_dict(flat, FORMS[form](_q("8bit")).init(params), strict=False)
  assert all(q.codes.dtype == jnp.uint8 for q in _qarrays(loaded)) and _qarrays(loaded)
  got = ak.state_dict(loaded)
  want = ak.state_dict(ak.load_state_dict(flat, FORMS["chain"](_q("8bit")).init(params)))
  names = [n for n in want if not n.startswith("state.")]
  assert sorted(n for n in got if not n.startswith("state.")) == sorted(names)
  for name in names:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  for name in ("w.moment1", "w.moment2", "b.moment1", "s.moment2"):
    # 8-bit dynamic codes: within 2% of the block's largest magnitude (blocks of 64)
    blocks = np.abs(np.pad(flat[name].ravel(), (0, -flat[name].size % 64)).reshape(-1, 64))
    bound = 0.02 * np.repeat(blocks.max(axis=1), 64)[:flat[name].size].reshape(flat[name].shape)
    assert np.all(np.abs(got[name] - flat[name]) <= bound), name
  assert int(got["step"]) == 3


def test_quantized_multi_tensor_state_dict_loads_into_float32_fused():
  """And back: a quantized multi-tensor state dict into a float32 fused template holds the
  values the codes stand for."""
  tx = FORMS["fused_multi_tensor"](_q("8bit"))
  params, state = _trained(tx)
  flat = ak.state_dict(state)
  loaded = ak.load_state_dict(flat, ak.fused_adamw(0.01).init(params))
  got = ak.state_dict(loaded)
  for name in flat:
    np.testing.assert_array_equal(got[name], flat[name], err_msg=name)


def test_wrong_shape_still_names_the_entry():
  tx = FORMS["fused_multi_tensor"](_q("8bit"))
  params, state = _trained(tx, steps=1)
  flat = {**ak.state_dict(state), "w.moment1": np.zeros((20, 8), np.float32)}
  with pytest.raises(ValueError, match=r"'w\.moment1' has shape \(20, 8\), expected \(8, 20\)"):
    ak.load_state_dict(flat, tx.init(params))
