"""Importing Paddle / MindSpore optimizer state: the trajectory continues unchanged."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import load_golden

import adamkit as ak

B1, B2 = 0.9, 0.999


def _params(key=0):
  k1, k2 = jax.random.split(jax.random.key(key))
  return {"linear_0.w_0": jax.random.normal(k1, (3, 4)),
          "linear_0.b_0": jax.random.normal(k2, (4,))}


def _grads(n, params, key=1):
  """``n`` gradient pytrees, fixed by ``key``."""
  keys = jax.random.split(jax.random.key(key), n)
  return [jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), params) for k in keys]


def _run(tx, params, state, grads):
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  for g in grads:
    u, state = step(g, state, params)
    params = optax.apply_updates(params, u)
  return params, state


def _f32_powers(beta, n):
  """``beta`` multiplied into a float32 accumulator ``n`` times, as the frameworks do."""
  acc = np.float32(1.0)
  for _ in range(n):
    acc = np.float32(acc * np.float32(beta))
  return acc


def _is_moments(x):
  # sparse Adam's state adds ``row_splits`` (no arrays)
  return isinstance(x, tuple) and getattr(x, "_fields", ())[:3] == ("count", "mu", "nu")


def _moments(state):
  """``{param name: (m, v)}`` over every Adam-like node of ``state`` (test-side walk)."""
  out = {}
  for node in jax.tree.leaves(state, is_leaf=_is_moments):
    if _is_moments(node):
      for (path, m), v in zip(jax.tree_util.tree_flatten_with_path(node.mu)[0],
                              jax.tree.leaves(node.nu)):
        out[".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)] = (m, v)
  return out


def _paddle_layout(state, t):
  """A Paddle ``.pdopt``-style dict for an adamkit state after ``t`` steps."""
  out = {"LR_Scheduler": {"last_epoch": t}}  # present in real .pdopt files; ignored
  for name, (m, v) in _moments(state).items():
    out[name + "_moment1_0"], out[name + "_moment2_0"] = np.asarray(m), np.asarray(v)
    out[name + "_beta1_pow_acc_0"] = np.array([_f32_powers(B1, t + 1)])
    out[name + "_beta2_pow_acc_0"] = np.array([_f32_powers(B2, t + 1)])
  return out


def _mindspore_layout(state, t, names=lambda n: n):
  out = {"beta1_power": np.array([_f32_powers(B1, t)]), "global_step": np.array([0], np.int32)}
  for name, (m, v) in _moments(state).items():
    out[f"moment1.{names(name)}"], out[f"moment2.{names(name)}"] = np.asarray(m), np.asarray(v)
  return out


PADDLE_TX = dict(
    plain=lambda: ak.adam(0.01, weight_decay=0.01, eps_mode="corrected", weight_decay_mask=None),
    schedule=lambda: ak.adam(optax.linear_schedule(0.02, 0.001, 12), weight_decay=0.01,
                             eps_mode="corrected", weight_decay_mask=None),
    groups=lambda: ak.adam(0.01, eps_mode="corrected",
                           groups=[{"params": "*.b_0", "learning_rate": 0.5}]),
)


@pytest.mark.parametrize("case", sorted(PADDLE_TX))
def test_paddle_import_continues_bit_identical(case):
  n, m = 7, 5
  params = _params()
  grads = _grads(n + m, params)
  tx = PADDLE_TX[case]()
  p_mid, s_mid = _run(tx, params, tx.init(params), grads[:n])
  p_full, s_full = _run(tx, p_mid, s_mid, grads[n:])

  imported = ak.from_paddle_state(_paddle_layout(s_mid, n), p_mid, tx)
  chex.assert_trees_all_equal(imported, s_mid)  # counts, moments, next learning rate
  p_resumed, s_resumed = _run(tx, p_mid, imported, grads[n:])
  chex.assert_trees_all_equal(p_resumed, p_full)
  chex.assert_trees_all_equal(s_resumed, s_full)


def _numpy_paddle_adam(params, grads, lr, wd, eps=1e-8):
  """Paddle's dense Adam kernel in float64, with its accumulators (beta pows start at beta)."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  b1p, b2p = B1, B2
  for g in grads:
    for k in p:
      gk = np.asarray(g[k], np.float64) + wd * p[k]
      m[k] = B1 * m[k] + (1 - B1) * gk
      v[k] = B2 * v[k] + (1 - B2) * gk * gk
      lr_t = lr * np.sqrt(1 - b2p) / (1 - b1p)
      p[k] = p[k] - lr_t * m[k] / (np.sqrt(v[k]) + eps * np.sqrt(1 - b2p))
    b1p, b2p = b1p * B1, b2p * B2
  return p, m, v, b1p, b2p


def test_paddle_import_matches_float64_paddle_reference():
  """A state in Paddle's layout, computed by independent float64 code, continues in ak
  exactly as Paddle's formula continues it."""
  n, m = 6, 6
  params = {k: np.asarray(v) for k, v in _params(3).items()}
  grads = [{k: np.asarray(v) for k, v in g.items()} for g in _grads(n + m, params, key=4)]
  p_mid, mom1, mom2, b1p, b2p = _numpy_paddle_adam(params, grads[:n], 0.01, 0.01)
  pdopt = {}
  for k in params:
    pdopt[f"{k}_moment1_0"] = mom1[k].astype(np.float32)
    pdopt[f"{k}_moment2_0"] = mom2[k].astype(np.float32)
    pdopt[f"{k}_beta1_pow_acc_0"] = np.array([b1p], np.float32)
    pdopt[f"{k}_beta2_pow_acc_0"] = np.array([b2p], np.float32)

  tx = ak.adam(0.01, weight_decay=0.01, eps_mode="corrected", weight_decay_mask=None)
  p0 = {k: jnp.asarray(v, jnp.float32) for k, v in p_mid.items()}
  state = ak.from_paddle_state(pdopt, p0, tx)
  assert int(ak.state_dict(state)["step"]) == n
  p_ak, _ = _run(tx, p0, state, [{k: jnp.asarray(v) for k, v in g.items()} for g in grads[n:]])

  # Continuing the float64 reference from the float32-rounded state it exported.
  p_ref = {k: v.astype(np.float32).astype(np.float64) for k, v in p_mid.items()}
  m_ref = {k: v.astype(np.float32).astype(np.float64) for k, v in mom1.items()}
  v_ref = {k: v.astype(np.float32).astype(np.float64) for k, v in mom2.items()}
  for i, g in enumerate(grads[n:]):
    t = n + 1 + i
    for k in p_ref:
      gk = g[k].astype(np.float64) + 0.01 * p_ref[k]
      m_ref[k] = B1 * m_ref[k] + (1 - B1) * gk
      v_ref[k] = B2 * v_ref[k] + (1 - B2) * gk * gk
      m_hat, v_hat = m_ref[k] / (1 - B1 ** t), v_ref[k] / (1 - B2 ** t)
      p_ref[k] = p_ref[k] - 0.01 * m_hat / (np.sqrt(v_hat) + 1e-8)
  for k in p_ref:
    np.testing.assert_allclose(p_ak[k], p_ref[k], rtol=0, atol=2e-6)
    # ... and it did move: the check could fail.
    assert np.max(np.abs(p_ref[k] - p_mid[k])) > 1e-2


@pytest.mark.parametrize("name,make", [
    ("ms_adam_weight_decay", lambda: ak.adam(0.01, weight_decay=0.05)),
    ("ms_adamax_weight_decay", lambda: ak.adamax(0.01, weight_decay=0.05)),
])
def test_mindspore_golden_moments_import(name, make):
  """MindSpore's real final moments, imported, equal adamkit's own after the same steps."""
  cfg, d = load_golden(name)
  names, steps = cfg["params"], cfg["steps"]

  def nest(flat):
    out = {}
    for k, v in flat.items():
      a, b = k.split(".")
      out.setdefault(a, {})[b] = jnp.asarray(v)
    return out

  params = nest({k: d[f"init/{k}"] for k in names})
  grads = [nest({k: d[f"grad/{t}/{k}"] for k in names}) for t in range(steps)]
  tx = make()
  p_final, s_final = _run(tx, params, tx.init(params), grads)

  ckpt = {f"moment1.{k}": d[f"mu/{k}"] for k in names}
  ckpt.update({f"moment2.{k}": d[f"nu/{k}"] for k in names})
  ckpt.update({"conv1.weight": d[f"traj/{steps - 1}/conv1.weight"],  # weights sit alongside
               "beta1_power": np.array([_f32_powers(B1, steps)]),
               "beta2_power": np.array([_f32_powers(B2, steps)]),
               "learning_rate": np.array(0.01, np.float32)})
  imported = ak.from_mindspore_state(ckpt, p_final, tx)
  ours, theirs = ak.state_dict(s_final), ak.state_dict(imported)
  assert sorted(ours) == sorted(theirs)
  assert int(theirs["step"]) == steps
  for k in ours:
    np.testing.assert_allclose(theirs[k], ours[k], rtol=2e-6, atol=1e-9, err_msg=k)


def test_mindspore_import_with_name_mapping_continues_bit_identical():
  params = {"fc": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}}
  ms_names = {"fc.kernel": "net.fc.weight", "fc.bias": "net.fc.bias"}
  grads = _grads(9, params)
  tx = ak.adamax(0.05)
  p_mid, s_mid = _run(tx, params, tx.init(params), grads[:4])
  p_full, _ = _run(tx, p_mid, s_mid, grads[4:])
  ckpt = _mindspore_layout(s_mid, 4, names=ms_names.get)
  for names in (ms_names, lambda n: "net." + n.replace("kernel", "weight")):
    imported = ak.from_mindspore_state(ckpt, p_mid, tx, names=names)
    chex.assert_trees_all_equal(imported, s_mid)
    chex.assert_trees_all_equal(_run(tx, p_mid, imported, grads[4:])[0], p_full)


def test_import_errors():
  params = {"w": jnp.ones(3)}
  tx = ak.adam(0.01)
  good = {"moment1.w": np.ones(3, np.float32), "moment2.w": np.ones(3, np.float32),
          "beta1_power": np.array([B1 ** 3], np.float32)}
  assert int(ak.state_dict(ak.from_mindspore_state(good, params, tx))["step"]) == 3
  with pytest.raises(KeyError, match="w"):
    ak.from_mindspore_state({"beta1_power": good["beta1_power"]}, params, tx)
  state = ak.from_mindspore_state({"beta1_power": good["beta1_power"]}, params, tx,
                                  strict=False)
  assert not np.any(ak.state_dict(state)["w.moment1"])
  with pytest.raises(ValueError, match="shape"):
    ak.from_mindspore_state({**good, "moment1.w": np.ones(4, np.float32)}, params, tx)
  with pytest.raises(ValueError, match="step"):
    ak.from_mindspore_state({"moment1.w": good["moment1.w"], "moment2.w": good["moment2.w"]},
                            params, tx)
  # beta1_power of b1 = 0.8 read with b1 = 0.9, checked against beta2_power: refused.
  wrong = {**good, "beta1_power": np.array([0.8 ** 10], np.float32),
           "beta2_power": np.array([B2 ** 10], np.float32)}
  with pytest.raises(ValueError, match="betas"):
    ak.from_mindspore_state(wrong, params, tx)
  assert int(ak.state_dict(ak.from_mindspore_state(wrong, params, tx, b1=0.8))["step"]) == 10
  assert int(ak.state_dict(ak.from_mindspore_state(good, params, tx, step=11))["step"]) == 11
  # Paddle's Adamax moments do not continue ak.adamax's trajectory; nor its fused step's
  # (both layouts, and under master weights), which has a state type of its own
  for adamax in (ak.adamax(0.01), ak.fused_adamax(0.01), ak.fused_adamax(0.01, multi_tensor=False),
                 ak.master_weights(ak.fused_adamax(0.01))):
    with pytest.raises(ValueError, match="Adamax"):
      ak.from_paddle_state({"w_moment1_0": np.ones(3), "w_moment2_0": np.ones(3)}, params,
                           adamax, step=1)
  fused = ak.from_paddle_state({"w_moment1_0": np.ones(3), "w_moment2_0": np.ones(3)}, params,
                               ak.fused_adam(0.01), step=1)
  assert type(fused) is ak.FusedAdamState
  with pytest.raises(ValueError, match="no Adam"):
    ak.from_mindspore_state(good, params, optax.sgd(0.1))


def test_paddle_step_after_beta1_power_underflow():
  """After ~900 steps beta1**t is 0 in float32; the step then comes from beta2_pow_acc."""
  params = {"w": jnp.ones(2)}
  pdopt = {"w_moment1_0": np.zeros(2, np.float32), "w_moment2_0": np.zeros(2, np.float32),
           "w_beta1_pow_acc_0": np.array([0.0], np.float32),
           "w_beta2_pow_acc_0": np.array([_f32_powers(B2, 1501)])}
  state = ak.from_paddle_state(pdopt, params, ak.adam(0.01, eps_mode="corrected"))
  assert int(ak.state_dict(state)["step"]) == 1500


@pytest.mark.parametrize("make", [
    lambda: ak.sparse_adam(0.05, weight_decay=0.01),
    lambda: ak.offload(ak.adam(0.05, weight_decay=0.01), mode="state"),
], ids=["sparse_adam", "offload"])
def test_mindspore_import_into_sparse_and_offloaded_states(make):
  """nn.Adam with sparse gradients (and nn.AdamOffload) keep the same moment names."""
  params = {"emb": jnp.ones((6, 2)), "w": jnp.ones(2)}
  tx = make()
  state = tx.init(params)
  grads = {"emb": jnp.full((6, 2), 0.5), "w": jnp.ones(2)}
  for _ in range(3):
    updates, state = tx.update(grads, state, params)
  imported = ak.from_mindspore_state(_mindspore_layout(state, 3), params, tx)
  chex.assert_trees_all_equal(imported, state)
  kinds = lambda t: [x.sharding.memory_kind for x in jax.tree.leaves(t)]  # noqa: E731
  assert kinds(imported) == kinds(state)


@pytest.mark.parametrize("make", [lambda: ak.adam(0.01), lambda: ak.sparse_adam(0.01)],
                         ids=["adam", "sparse_adam"])
def test_import_keeps_the_state_sharding(make):
  """Moments land with the shardings ``tx.init`` gives them (params sharded on 8 devices)."""
  mesh = jax.make_mesh((len(jax.devices()),), ("d",))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  params = {"w": jax.device_put(jnp.ones((len(jax.devices()) * 2, 3)), spec)}
  tx = make()
  state = tx.init(params)
  ckpt = _mindspore_layout(state, 0)
  ckpt["beta1_power"] = np.array([B1 ** 2], np.float32)
  ckpt["moment1.w"] = np.full(params["w"].shape, 0.5, np.float32)
  imported = ak.from_mindspore_state(ckpt, params, tx)
  for new, old in zip(jax.tree.leaves(imported), jax.tree.leaves(state)):
    assert new.sharding.is_equivalent_to(old.sharding, new.ndim)
  assert np.asarray(_moments(imported)["w"][0])[3, 1] == 0.5
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), imported, params)
  assert jax.tree.leaves(updates)[0].shape == params["w"].shape


@pytest.mark.parametrize("multi_tensor", [True, False])
@pytest.mark.parametrize("framework", ["paddle", "mindspore"])
def test_fused_states_are_filled(framework, multi_tensor):
  """Per-leaf and multi-tensor fused states take a framework's moments by parameter name
  and continue exactly as ak.adam filled from the same dict (the optax form, bit for bit)."""
  rng = np.random.default_rng(3)
  params = {"w": jnp.asarray(rng.standard_normal((2, 3)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(3), jnp.float32)}
  m = {k: rng.standard_normal(np.shape(v)).astype(np.float32) for k, v in params.items()}
  v = {k: rng.random(np.shape(x)).astype(np.float32) for k, x in params.items()}
  if framework == "paddle":
    d = {**{f"{k}_moment1_0": x for k, x in m.items()}, **{f"{k}_moment2_0": x for k, x in v.items()},
         "w_beta1_pow_acc_0": np.array([0.9 ** 5], np.float32)}
    load, t = ak.from_paddle_state, 4
  else:
    d = {**{f"moment1.{k}": x for k, x in m.items()}, **{f"moment2.{k}": x for k, x in v.items()},
         "beta1_power": np.array([0.9 ** 5], np.float32)}
    load, t = ak.from_mindspore_state, 5
  opt = ak.fused_adam(1e-2, multi_tensor=multi_tensor)
  state = load(d, params, opt)
  sd = ak.state_dict(state)
  assert int(sd["step"]) == t
  for k in params:
    np.testing.assert_array_equal(sd[f"{k}.moment1"], m[k])
    np.testing.assert_array_equal(sd[f"{k}.moment2"], v[k])
  ref_tx = ak.adam(1e-2)
  ref_state = load(d, params, ref_tx)
  g = jax.tree.map(jnp.cos, params)
  u, _ = opt.update(g, state, params)
  ref_u, _ = ref_tx.update(g, ref_state, params)
  chex.assert_trees_all_equal(u, ref_u)


def test_fused_state_missing_moments_is_an_error():
  with pytest.raises(KeyError, match="'b' \\(moment1\\)|b \\(moment1\\)"):
    ak.from_mindspore_state({"moment1.w": np.zeros(2, np.float32),
                             "moment2.w": np.zeros(2, np.float32),
                             "beta1_power": np.array([0.9], np.float32)},
                            {"w": jnp.ones(2), "b": jnp.ones(2)}, ak.fused_adam(1e-3))


def _amsgrad_nodes(state):
  return [n for n in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ak.ScaleByAmsgradState))
          if isinstance(n, ak.ScaleByAmsgradState)]


def _named(tree):
  return {".".join(str(k.key) for k in path): np.asarray(x)
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("make", [
    lambda: ak.adam(0.01, eps_mode="corrected", weight_decay_mask=None, amsgrad=True),
    lambda: ak.adamw(0.01, weight_decay=0.05, eps_mode="corrected", weight_decay_mask=None,
                     amsgrad=True),
], ids=["Adam", "AdamW"])
def test_paddle_amsgrad_import_continues_bit_identical(make):
  # Paddle Adam/AdamW(amsgrad=True): moment1, moment2, moment2_max and the beta pows.
  n, m = 5, 4
  params = _params()
  grads = [jax.tree.map(lambda g, i=i: g * 0.5 ** i, g) for i, g in enumerate(_grads(n + m, params))]
  tx = make()
  p_mid, s_mid = _run(tx, params, tx.init(params), grads[:n])
  p_full, s_full = _run(tx, p_mid, s_mid, grads[n:])
  (node,) = _amsgrad_nodes(s_mid)
  pdopt = {}
  for field, what in (("mu", "moment1"), ("nu", "moment2"), ("nu_max", "moment2_max")):
    for name, x in _named(getattr(node, field)).items():
      pdopt[f"{name}_{what}_0"] = x
  for name in params:
    pdopt[name + "_beta1_pow_acc_0"] = np.array([_f32_powers(B1, n + 1)])
    pdopt[name + "_beta2_pow_acc_0"] = np.array([_f32_powers(B2, n + 1)])
  # the max is not the second moment here (shrinking gradients), so the import must read it
  assert not np.array_equal(pdopt["linear_0.w_0_moment2_max_0"], pdopt["linear_0.w_0_moment2_0"])
  imported = ak.from_paddle_state(pdopt, p_mid, tx)
  chex.assert_trees_all_equal(imported, s_mid)
  p_resumed, s_resumed = _run(tx, p_mid, imported, grads[n:])
  chex.assert_trees_all_equal(p_resumed, p_full)
  chex.assert_trees_all_equal(s_resumed, s_full)
  # without moment2_max the amsgrad state cannot be filled
  del pdopt["linear_0.b_0_moment2_max_0"]
  with pytest.raises(KeyError, match=r"linear_0.b_0 \(moment2_max\)"):
    ak.from_paddle_state(pdopt, p_mid, tx)


def test_mindspore_amsgrad_and_adamweightdecay_import():
  params = {"fc": {"weight": jnp.ones((2, 3))}, "bn": {"gamma": jnp.ones(3)}}
  grads = [jax.tree.map(lambda g, i=i: g * 0.5 ** i, g) for i, g in enumerate(_grads(8, params))]
  # nn.Adam(use_amsgrad=True): moment1., moment2., vhat., beta1_power.
  tx = ak.adam(0.01, amsgrad=True)
  p_mid, s_mid = _run(tx, params, tx.init(params), grads[:4])
  (node,) = _amsgrad_nodes(s_mid)
  ckpt = {"beta1_power": np.array([_f32_powers(B1, 4)])}
  for field, prefix in (("mu", "moment1"), ("nu", "moment2"), ("nu_max", "vhat")):
    ckpt.update({f"{prefix}.{k}": v for k, v in _named(getattr(node, field)).items()})
  imported = ak.from_mindspore_state(ckpt, p_mid, tx)
  chex.assert_trees_all_equal(imported, s_mid)
  assert sorted(ak.state_dict(imported)) == sorted(ak.state_dict(s_mid))
  # nn.AdamWeightDecay: adam_m., adam_v., no beta powers (the step is passed).
  tx = ak.adamw(0.01, eps=1e-6, weight_decay=0.05, bias_correction=False, eps_mode="hat")
  p_mid, s_mid = _run(tx, params, tx.init(params), grads[:4])
  p_full, _ = _run(tx, p_mid, s_mid, grads[4:])
  ckpt = {"global_step": np.array([0], np.int32)}
  for k, (m, v) in _moments(s_mid).items():
    ckpt[f"adam_m.{k}"], ckpt[f"adam_v.{k}"] = np.asarray(m), np.asarray(v)
  with pytest.raises(ValueError, match="step="):
    ak.from_mindspore_state(ckpt, p_mid, tx)
  imported = ak.from_mindspore_state(ckpt, p_mid, tx, step=4)
  chex.assert_trees_all_equal(imported, s_mid)
  chex.assert_trees_all_equal(_run(tx, p_mid, imported, grads[4:])[0], p_full)
  # both namings for one parameter: ambiguous, refused
  with pytest.raises(ValueError, match="Several MindSpore moments"):
    ak.from_mindspore_state({**ckpt, "moment1.fc.weight": ckpt["adam_m.fc.weight"]}, p_mid, tx,
                            step=4)
