"""ak.offload / ak.adam_offload: placement, trajectories, sharding, restore, errors."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import load_golden
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import adamkit as ak
from adamkit import _compat, _offload

MODES = ("compute", "state")
HOST = "pinned_host"


def kinds(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def make_params():
  return {"conv": {"kernel": jnp.linspace(-1.0, 1.0, 24, dtype=jnp.float32).reshape(4, 6)},
          "bn": {"gamma": jnp.ones(4, jnp.float32), "beta": jnp.zeros(4, jnp.float32)}}


def grads_at(params, t):
  # Deterministic, parameter-dependent gradients (a quadratic bowl with a twist).
  return jax.tree.map(lambda p: jnp.sin(3.0 * p + 0.5 * t) + 0.1 * p, params)


def jit_step(tx, donate=True):
  def step(params, state, t):
    updates, state = tx.update(grads_at(params, t), state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def copy(tree):
  return jax.tree.map(jnp.copy, tree)


def assert_close_tree(a, b, rtol=2e-6, atol=1e-7):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def run_donated(step, params, state, steps):
  """Runs ``steps`` donated steps; checks placement after each and donation's effect."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for t in range(steps):
      old = jax.tree.leaves((params, state))
      params, state = step(params, state, jnp.float32(t))
      assert kinds(state) == {HOST}, f"step {t}: state in {kinds(state)}"
      assert kinds(params) == {"device"}, f"step {t}: params in {kinds(params)}"
      # Donation really happened: every input buffer was consumed.
      assert all(x.is_deleted() for x in old)
  donation = [w for w in caught if "donated buffers were not usable" in str(w.message)]
  assert not donation, [str(w.message) for w in donation]
  return params, state


# ------------------------------------------------------------------ single device


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make_tx", [
    lambda: ak.adam(0.05, weight_decay=0.05),
    # An optax chain (optax.adam itself trips strict dtype promotion, offloaded or not).
    lambda: optax.chain(optax.clip(0.5), optax.add_decayed_weights(0.01), optax.lion(0.05)),
], ids=["ak.adam", "optax.lion"])
def test_jit_step_placement_and_trajectory(mode, make_tx):
  params = make_params()
  ref_tx, tx = make_tx(), ak.offload(make_tx(), mode=mode)
  state = tx.init(params)
  assert kinds(state) == {HOST} and kinds(params) == {"device"}
  assert jax.tree.structure(state) == jax.tree.structure(ref_tx.init(params))

  p, s = run_donated(jit_step(tx), copy(params), state, steps=4)

  rp, rs = params, ref_tx.init(params)
  ref_step = jit_step(ref_tx, donate=False)
  for t in range(4):
    rp, rs = ref_step(rp, rs, jnp.float32(t))
  assert_close_tree(p, rp)
  assert_close_tree(s, rs)


@pytest.mark.parametrize("mode", MODES)
def test_eager_update_and_traced_init(mode):
  params = make_params()
  tx, ref = ak.offload(ak.adam(0.1), mode=mode), ak.adam(0.1)
  g = grads_at(params, 0.0)
  u, s = tx.update(g, tx.init(params), params)  # no jit
  ru, rs = ref.update(g, ref.init(params), params)
  assert kinds(s) == {HOST} and kinds(u) == {"device"}
  assert_close_tree(u, ru)
  # init under jit (e.g. inside a larger initialiser) also lands in host memory.
  s = jax.jit(tx.init)(params)
  assert kinds(s) == {HOST}


def test_extra_args_pass_through():
  def needs_value(updates, state, params=None, *, value):
    return jax.tree.map(lambda u: u * value, updates), state
  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), needs_value)
  tx = ak.offload(optax.chain(ak.scale_by_adam(), inner), mode="compute")
  params = make_params()
  u, _ = jax.jit(lambda s, v: tx.update(params, s, params, value=v))(
      tx.init(params), jnp.float32(0.0))
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(u))


# --------------------------------------------------------------------- golden


def test_golden_ms_adam_weight_decay_through_adam_offload():
  """MindSpore AdamOffload and Adam share a formula: replay nn.Adam's trajectory."""
  cfg, d = load_golden("ms_adam_weight_decay")
  names = cfg["params"]
  params = {n: jnp.asarray(d[f"init/{n}"]) for n in names}
  tx = ak.adam_offload(**cfg["kwargs"])  # learning_rate=0.01, weight_decay=0.05

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for t in range(cfg["steps"]):
    grads = {n: jnp.asarray(d[f"grad/{t}/{n}"]) for n in names}
    params, state = step(params, state, grads)
    assert kinds(state) == {HOST}
    for n in names:
      scale = float(np.max(np.abs(d[f"init/{n}"])))
      err = float(np.max(np.abs(np.asarray(params[n]) - d[f"traj/{t}/{n}"]))) / scale
      assert err < 1e-6, (t, n, err)
  moments = ak.state_dict(state, params)
  for n in names:
    np.testing.assert_allclose(moments[f"{n}.moment1"], d[f"mu/{n}"], rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(moments[f"{n}.moment2"], d[f"nu/{n}"], rtol=1e-5, atol=1e-10)


# -------------------------------------------------------------------- sharded


def sharded_params(axis_type):
  mesh = Mesh(np.array(jax.devices()[:8]), ("x",), axis_types=(axis_type,))
  specs = {"conv": {"kernel": P(None, "x")}, "bn": {"gamma": P(), "beta": P()}}
  base = make_params()
  base["conv"]["kernel"] = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(4, 8)
  return jax.tree.map(lambda p, s: jax.device_put(p, NamedSharding(mesh, s)), base, specs,
                      is_leaf=lambda x: isinstance(x, P)), mesh


def adam_moments(state):
  is_adam = lambda x: isinstance(x, ak.ScaleByAdamState)  # noqa: E731
  return next(n for n in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(n))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["auto", "explicit"])
def test_sharded_state_follows_params_in_host_memory(mode, axis_type):
  params, mesh = sharded_params(axis_type)
  tx, ref = ak.offload(ak.adam(0.05), mode=mode), ak.adam(0.05)

  def check_layout(state):
    m = adam_moments(state)
    for tree in (m.mu, m.nu):
      for x, p in zip(jax.tree.leaves(tree), jax.tree.leaves(params)):
        assert x.sharding.memory_kind == HOST
        assert x.sharding.is_equivalent_to(p.sharding.with_memory_kind(HOST), x.ndim)
    assert m.count.sharding.is_fully_replicated and m.count.sharding.memory_kind == HOST
    assert set(m.count.sharding.device_set) == set(mesh.devices.flat)

  state = tx.init(params)
  check_layout(state)
  p, s = run_donated(jit_step(tx), copy(params), state, steps=2)
  check_layout(s)
  for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(params)):
    assert x.sharding.is_equivalent_to(y.sharding, x.ndim)

  rp, rs = params, ref.init(params)
  for t in range(2):
    rp, rs = jit_step(ref, donate=False)(rp, rs, jnp.float32(t))
  assert_close_tree(p, rp)


def test_offload_shardings_for_explicit_jit_shardings():
  params, _ = sharded_params(AxisType.Auto)
  tx = ak.offload(ak.adam(0.05), mode="compute")
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding),
                          params)
  s_sh = ak.offload_shardings(jax.eval_shape(tx.init, abstract), abstract)
  p_sh = jax.tree.map(lambda p: p.sharding, params)
  step = jax.jit(lambda p, s, t: jit_step(tx, donate=False).__wrapped__(p, s, t),
                 in_shardings=(p_sh, s_sh, None), out_shardings=(p_sh, s_sh),
                 donate_argnums=(0, 1))
  p, s = run_donated(step, copy(params), jax.device_put(tx.init(params), s_sh), steps=1)
  for x, want in zip(jax.tree.leaves(s), jax.tree.leaves(s_sh)):
    assert x.sharding.is_equivalent_to(want, x.ndim)


def test_offload_shardings_matches_by_path_and_shape():
  # Two params with equal shapes but different layouts: each moment follows its own.
  mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
  a = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("x", None)))
  b = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P(None, "x")))
  params = {"a": a, "b": b}
  sh = ak.offload_shardings(optax.adafactor(0.1).init(params), params)
  leaves = jax.tree_util.tree_flatten_with_path(sh)[0]
  for path, s in leaves:
    assert s.memory_kind == HOST
  state = ak.scale_by_adam().init(params)
  sh = ak.offload_shardings(state, params)
  assert sh.mu["a"].spec == P("x", None) and sh.nu["b"].spec == P(None, "x")
  assert sh.count.spec == P()
  with pytest.raises(ValueError, match="no sharding"):
    ak.offload_shardings(state, {"a": jax.ShapeDtypeStruct((8, 8), jnp.float32),
                                 "b": jax.ShapeDtypeStruct((8, 8), jnp.float32)})


# -------------------------------------------------------------- save / restore


@pytest.mark.parametrize("mode", MODES)
def test_restored_state_lands_in_host_memory(mode):
  params, _ = sharded_params(AxisType.Auto)
  tx = ak.offload(ak.adam(0.05), mode=mode)
  step = jit_step(tx)
  p, s = run_donated(step, copy(params), tx.init(params), steps=2)

  # A NumPy round trip, as any checkpointer does (copies: a zero-copy view would pin the
  # buffers and keep the next step from reusing them).
  saved_p = jax.tree.map(np.array, p)
  saved_s = jax.tree.map(np.array, s)
  flat = {k: np.array(v) for k, v in ak.state_dict(s, p).items()}

  # Continue uninterrupted for reference.
  want_p, want_s = run_donated(step, p, s, steps=1)

  # 1) ak.offload_state puts a NumPy state back, laid out like the params.
  p1 = jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), saved_p, params)
  s1 = ak.offload_state(saved_s, p1)
  assert kinds(s1) == {HOST}
  got_p, got_s = run_donated(step, p1, s1, steps=1)
  assert_close_tree(got_p, want_p, rtol=0, atol=0)

  # 2) ak.load_state_dict into an offloaded template lands in host memory too.
  p2 = jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), saved_p, params)
  s2 = ak.load_state_dict(flat, tx.init(p2))
  assert kinds(s2) == {HOST}
  got_p, _ = run_donated(step, p2, s2, steps=1)
  assert_close_tree(got_p, want_p, rtol=0, atol=0)

  # 3) A state left in device memory is moved back to the host by the update itself.
  p3 = jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), saved_p, params)
  s3 = jax.tree.map(jnp.asarray, saved_s)
  assert kinds(s3) == {"device"}
  got_p, got_s = jit_step(tx, donate=False)(p3, s3, jnp.float32(0))
  assert kinds(got_s) == {HOST}
  assert_close_tree(got_p, want_p, rtol=0, atol=0)


# ---------------------------------------------------------------------- errors


class _FakeMemory:
  def __init__(self, kind):
    self.kind = kind


class _FakeDevice:
  platform = "fake"

  def __init__(self, kinds):
    self._kinds = kinds

  def addressable_memories(self):
    return [_FakeMemory(k) for k in self._kinds]


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="`mode` must be one of"):
    ak.offload(ak.adam(), mode="host")
  with pytest.raises(ValueError, match="`memory_kind` must be one of"):
    ak.adam_offload(memory_kind="device")
  with pytest.raises(TypeError, match="`tx` must be an optax GradientTransformation"):
    ak.offload(lambda p: p)


def test_backend_without_host_memory_fails_clearly():
  with pytest.raises(RuntimeError, match="offer only \\['device'\\].*Neither mode"):
    _offload.check_support("state", HOST, [_FakeDevice(["device"])])


def test_backend_without_host_compute_points_to_state_mode(monkeypatch):
  devices = [_FakeDevice(["device", HOST])]
  monkeypatch.setattr(_offload, "_host_compute_error", lambda platform: "Unimplemented: x")
  with pytest.raises(RuntimeError, match="Use mode='state'"):
    _offload.check_support("compute", HOST, devices)
  _offload.check_support("state", HOST, devices)  # state mode needs no host compute


@pytest.mark.parametrize("make_tx", [
    lambda: ak.adam(0.1, grad_clip=ak.ClipGradByGlobalNorm(1.0)),
    lambda: ak.adam(0.1, nonfinite="skip"),
], ids=["global-norm-clip", "skip-nonfinite"])
def test_untraceable_on_host_points_to_state_mode(make_tx):
  params = make_params()
  g = grads_at(params, 0.0)
  tx = ak.offload(make_tx(), mode="compute")
  with pytest.raises(RuntimeError, match="Use mode='state'"):
    tx.update(g, tx.init(params), params)
  tx = ak.offload(make_tx(), mode="state")  # the suggested mode works
  _, s = tx.update(g, tx.init(params), params)
  assert kinds(s) == {HOST}


def test_this_backend_supports_both_modes():
  for mode in MODES:
    _offload.check_support(mode, HOST)


# ------------------------------------------------------------------------ shim


def test_compute_on_shim_both_forms(monkeypatch):
  x = jax.device_put(jnp.arange(4.0), jax.sharding.SingleDeviceSharding(
      jax.devices()[0], memory_kind=HOST))

  def f(a):
    return a * 2.0, a + 1.0

  def run():
    fn = _compat.on_host(f, (_compat.DEVICE, _compat.HOST))
    lowered = jax.jit(fn).lower(x)
    assert "_xla_compute_type" in lowered.as_text()  # the work is annotated for the host
    y, z = lowered.compile()(x)
    assert (y.sharding.memory_kind, z.sharding.memory_kind) == ("device", HOST)
    np.testing.assert_array_equal(np.asarray(y), [0.0, 2.0, 4.0, 6.0])
    np.testing.assert_array_equal(np.asarray(z), [1.0, 2.0, 3.0, 4.0])

  assert _compat._FUNCTION_FORM is not None  # jax 0.10: compute_on2
  run()
  monkeypatch.setattr(_compat, "_FUNCTION_FORM", None)  # jax with the context manager only
  run()
