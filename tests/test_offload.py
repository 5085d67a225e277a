"""ak.offload / ak.adam_offload: placement, trajectories, sharding, restore, errors."""

import inspect
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
# ak.offload works where the backend has host memory and jit returns arrays in the memory
# the step placed them in (verified: jax 0.10). Elsewhere it must refuse at init with a
# clear error (tested below): CPU devices have only "unpinned_host" on jax 0.6, and jax
# 0.7 - 0.9 return such arrays in device memory.
HAS_HOST = HOST in {m.kind for m in jax.devices()[0].addressable_memories()}
SUPPORTED = HAS_HOST and all(_offload._probe(jax.devices()[0].platform, m) is None
                             for m in MODES)
needs_host = pytest.mark.skipif(not SUPPORTED, reason="ak.offload unsupported here")


def kinds(tree):
  """The memory kinds of ``tree``'s arrays; the 0-d leaves of an offloaded state (step
  counts, learning-rate records) stay in device memory and must be there."""
  leaves = jax.tree.leaves(tree)
  scalars = {x.sharding.memory_kind for x in leaves if x.ndim == 0}
  assert scalars <= {"device"}, scalars
  return {x.sharding.memory_kind for x in leaves if x.ndim > 0}


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


def transfers(fn, *args):
  """The host <-> device moves in ``fn``'s jaxpr: ``{"to_host": avals, "to_device": avals}``.

  Read from the types, so it is the same on every backend (the CPU backend lowers the
  placement annotations to nothing, since its two memories are one RAM).
  """
  out = {"to_host": [], "to_device": []}
  host, device = jax.memory.Space.Host, jax.memory.Space.Device

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "device_put":
        for a, b in zip(eqn.invars, eqn.outvars):
          if a.aval.memory_space != b.aval.memory_space:
            out["to_host" if b.aval.memory_space == host else "to_device"].append(b.aval)
      elif eqn.primitive.name == "compute_on":  # runs on the host: outputs may come up
        out["to_device"] += [b.aval for b in eqn.outvars if b.aval.memory_space == device]
        out["to_host"] += [a.aval for a in eqn.invars if a.aval.memory_space == device]
      else:
        for sub in sub_jaxprs(eqn.params):
          walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


def sub_jaxprs(params):
  core = jax.extend.core
  for v in params.values():
    for x in v if isinstance(v, (tuple, list)) else (v,):
      if isinstance(x, core.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, core.Jaxpr):
        yield x


def nbytes(avals):
  return sum(a.size * a.dtype.itemsize for a in avals)


def run_donated(step, params, state, steps):
  """Runs ``steps`` donated steps; checks placement after each and donation's effect."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for t in range(steps):
      old = jax.tree.leaves((params, state))
      params, state = step(params, state, jnp.float32(t))
      offloaded = getattr(state, "inner_opt_state", state)  # MultiSteps' accumulator: device
      assert kinds(offloaded) == {HOST}, f"step {t}: state in {kinds(offloaded)}"
      assert kinds(params) == {"device"}, f"step {t}: params in {kinds(params)}"
      # Donation really happened: every input buffer was consumed.
      assert all(x.is_deleted() for x in old)
  donation = [w for w in caught if "donated buffers were not usable" in str(w.message)]
  assert not donation, [str(w.message) for w in donation]
  return params, state


# ------------------------------------------------------------------ single device


@needs_host
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

  # What crosses the link per step. Both optimizers read the params (weight decay).
  moved = transfers(jit_step(tx).__wrapped__, params, state, jnp.float32(0))
  p_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  s_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim > 0)
  scalar_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim == 0)
  if mode == "compute":  # gradient and params down, the update up; the moments stay, the
    # device-resident scalars (step count, lr record) go down and up (a few bytes)
    assert (nbytes(moved["to_host"]), nbytes(moved["to_device"])) == (
        2 * p_bytes + scalar_bytes, p_bytes + scalar_bytes)
  else:  # the moments down to the device and back; the scalars are there already
    assert (nbytes(moved["to_host"]), nbytes(moved["to_device"])) == (s_bytes, s_bytes)

  p, s = run_donated(jit_step(tx), copy(params), state, steps=4)

  rp, rs = params, ref_tx.init(params)
  ref_step = jit_step(ref_tx, donate=False)
  for t in range(4):
    rp, rs = ref_step(rp, rs, jnp.float32(t))
  assert_close_tree(p, rp)
  assert_close_tree(s, rs)


@needs_host
@pytest.mark.parametrize("mode", MODES)
def test_eager_update_and_traced_init(mode):
  params = make_params()
  tx, ref = ak.offload(ak.adam(0.1), mode=mode), ak.adam(0.1)
  # init under jit (e.g. inside a larger initialiser) lands in host memory too, even when
  # it is the first call of the process (the backend probe must not join the trace).
  _offload._probe.cache_clear()
  s = jax.jit(tx.init)(params)
  assert kinds(s) == {HOST}
  g = grads_at(params, 0.0)
  u, s = tx.update(g, tx.init(params), params)  # no jit
  ru, rs = ref.update(g, ref.init(params), params)
  assert kinds(s) == {HOST} and kinds(u) == {"device"}
  assert_close_tree(u, ru)


@needs_host
def test_extra_args_pass_through():
  def needs_value(updates, state, params=None, *, value):
    return jax.tree.map(lambda u: u * value, updates), state
  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), needs_value)
  tx = ak.offload(optax.chain(ak.scale_by_adam(), inner), mode="compute")
  params = make_params()
  u, _ = jax.jit(lambda s, v: tx.update(params, s, params, value=v))(
      tx.init(params), jnp.float32(0.0))
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(u))


@needs_host
def test_inject_hyperparams_and_multisteps_interop():
  params = make_params()
  # adam_offload's explicit signature lets optax.inject_hyperparams see every keyword.
  tx = optax.inject_hyperparams(ak.adam_offload)(learning_rate=0.1, weight_decay=0.01)
  ref = optax.inject_hyperparams(ak.adam)(learning_rate=0.1, weight_decay=0.01)
  p, s, rp, rs = copy(params), tx.init(params), params, ref.init(params)
  for t in range(2):
    p, s = jit_step(tx)(p, s, jnp.float32(t))
    rp, rs = jit_step(ref, donate=False)(rp, rs, jnp.float32(t))
  assert kinds(s.inner_state) == {HOST}  # (inject's own hyperparameters are its business)
  assert_close_tree(p, rp)
  # Gradient accumulation, both orders: the offload around MultiSteps (mode="state"), and
  # MultiSteps around the offload (its lax.cond meets the state's device-resident scalars).
  for tx in (ak.offload(optax.MultiSteps(ak.adam(0.1), 2).gradient_transformation(), mode="state"),
             optax.MultiSteps(ak.offload(ak.adam(0.1)), 2)):
    with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes int and float itself
      p, s = run_donated(jit_step(tx), copy(params), tx.init(params), steps=2)
    assert kinds(getattr(s, "inner_opt_state", s)) == {HOST}
    assert not np.allclose(np.asarray(p["conv"]["kernel"]), np.asarray(params["conv"]["kernel"]))


# --------------------------------------------------------------------- golden


@needs_host
@pytest.mark.parametrize("mode", MODES)
def test_golden_ms_adam_weight_decay_through_adam_offload(mode):
  """MindSpore AdamOffload and Adam share a formula: replay nn.Adam's trajectory."""
  cfg, d = load_golden("ms_adam_weight_decay")
  names = cfg["params"]
  params = {n: jnp.asarray(d[f"init/{n}"]) for n in names}
  tx = ak.adam_offload(**cfg["kwargs"], mode=mode)  # learning_rate=0.01, weight_decay=0.05

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


@needs_host
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
    assert m.count.sharding.is_fully_replicated and m.count.sharding.memory_kind == "device"
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


@needs_host
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


@needs_host
def test_offload_shardings_matches_by_path_and_shape():
  # Two params with equal shapes but different layouts: each moment follows its own.
  mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
  a = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("x", None)))
  b = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P(None, "x")))
  params = {"a": a, "b": b}
  # Factored moments (shapes unlike any param) are replicated, still in host memory; the
  # 0-d leaves (step count) replicated in device memory.
  state = optax.adafactor(0.1).init(params)
  for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(ak.offload_shardings(state, params))):
    assert s.memory_kind == (HOST if x.ndim else "device")
    assert x.shape == (8, 8) or s.is_fully_replicated
  state = ak.scale_by_adam().init(params)
  sh = ak.offload_shardings(state, params)
  assert sh.mu["a"].spec == P("x", None) and sh.nu["b"].spec == P(None, "x")
  assert sh.count.spec == P()
  with pytest.raises(ValueError, match="no sharding"):
    ak.offload_shardings(state, {"a": jax.ShapeDtypeStruct((8, 8), jnp.float32),
                                 "b": jax.ShapeDtypeStruct((8, 8), jnp.float32)})


# -------------------------------------------------------------- save / restore


@needs_host
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


# ---------------------------------------------------------------------- sparse

N_ROWS, ROW = 64, 4


@needs_host
@pytest.mark.parametrize("backend", ["xla", "kernel"])
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "dense-rows"])
def test_sparse_adam_state_in_host_memory(lazy, backend, request):
  if backend == "kernel":  # the lazy row step of the reduced problem runs in the kernel
    request.getfixturevalue("kernel")
  params = {"emb": jnp.linspace(-1.0, 1.0, N_ROWS * ROW, dtype=jnp.float32).reshape(
      N_ROWS, ROW), "fc": {"kernel": jnp.ones((ROW, 2), jnp.float32)}}

  def make():
    return ak.sparse_adam(0.05, lazy=lazy, weight_decay=0.1, backend=backend)

  tx, ref = ak.offload(make(), mode="state"), make()

  def step_with(t):
    def step(params, state, ids):
      grads = {"emb": ak.RowSparse(ids, jnp.cos(ids.astype(jnp.float32))[:, None]
                                   * jnp.ones((1, ROW), jnp.float32), N_ROWS),
               "fc": {"kernel": params["fc"]["kernel"] * 0.5}}
      updates, state = t.update(grads, state, params)
      return ak.apply_updates(params, updates), state
    return step

  step = jax.jit(step_with(tx), donate_argnums=(0, 1))
  ref_step = jax.jit(step_with(ref))
  id_batches = [[3, 3, 10, 63], [10, 0, 5, 5], [99, 3, 7, 7]]  # duplicates; 99 is dropped
  ids0 = jnp.array(id_batches[0], jnp.int32)
  moved = transfers(step_with(tx), params, tx.init(params), ids0)
  text = jax.jit(step_with(tx)).lower(params, tx.init(params), ids0).as_text()
  assert ("adamkit_cpu_sparse_lazy" in text) == (backend == "kernel" and lazy)
  shapes = {d: [a.shape for a in avals] for d, avals in moved.items()}
  k_rows = (len(id_batches[0]), ROW)
  if lazy:  # mu and nu: only the k touched rows come to the device and go back
    for d in ("to_device", "to_host"):
      assert (N_ROWS, ROW) not in shapes[d] and shapes[d].count(k_rows) == 2, shapes[d]
  else:  # every row moves: the whole tables come to the device
    assert shapes["to_device"].count((N_ROWS, ROW)) == 2, shapes["to_device"]

  p, s = copy(params), tx.init(params)
  rp, rs = params, ref.init(params)
  mu0 = np.asarray(adam_sparse_moments(s).mu["emb"]).copy()
  for ids in id_batches:
    ids = jnp.array(ids, jnp.int32)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      p, s = step(p, s, ids)
    assert not [w for w in caught if "donated" in str(w.message)]
    rp, rs = ref_step(rp, rs, ids)
    assert kinds(s) == {HOST} and kinds(p) == {"device"}
  assert_close_tree(p, rp, rtol=0, atol=0)
  assert_close_tree(s, rs, rtol=0, atol=0)

  # Row-sparse gradients cannot be traced on the host here: the error names the mode.
  compute = ak.offload(make(), mode="compute")
  with pytest.raises(RuntimeError, match="Use mode='state'"):
    step_with(compute)(params, compute.init(params), ids0)
  if lazy:  # rows never looked up keep their moments bit for bit
    untouched = sorted(set(range(N_ROWS)) - {i for b in id_batches for i in b})
    np.testing.assert_array_equal(np.asarray(adam_sparse_moments(s).mu["emb"])[untouched],
                                  mu0[untouched])


@needs_host
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["auto", "explicit"])
def test_sparse_adam_sharded_table(axis_type):
  mesh = Mesh(np.array(jax.devices()[:8]), ("x",), axis_types=(axis_type,))
  row_sharded = NamedSharding(mesh, P("x", None))
  params = {"emb": jax.device_put(jnp.linspace(-1.0, 1.0, N_ROWS * ROW, dtype=jnp.float32)
                                  .reshape(N_ROWS, ROW), row_sharded)}
  tx, ref = ak.offload(ak.sparse_adam(0.05), mode="state"), ak.sparse_adam(0.05)

  def step_with(t):
    def step(params, state, ids):
      grads = {"emb": ak.RowSparse(ids, jnp.ones((ids.shape[0], ROW), jnp.float32), N_ROWS)}
      updates, state = t.update(grads, state, params)
      return ak.apply_updates(params, updates), state
    return step

  p, s = copy(params), tx.init(params)
  rp, rs = params, ref.init(params)
  for ids in ([1, 1, 40, 63], [2, 40, 9, 9]):
    ids = jnp.array(ids, jnp.int32)
    p, s = jax.jit(step_with(tx), donate_argnums=(0, 1))(p, s, ids)
    rp, rs = jax.jit(step_with(ref))(rp, rs, ids)
  mu = adam_sparse_moments(s).mu["emb"]
  assert mu.sharding.memory_kind == HOST
  assert mu.sharding.is_equivalent_to(row_sharded.with_memory_kind(HOST), 2)
  assert_close_tree(p, rp, rtol=0, atol=0)
  assert_close_tree(s, rs, rtol=0, atol=0)


def adam_sparse_moments(state):
  is_sparse = lambda x: isinstance(x, ak.ScaleBySparseAdamState)  # noqa: E731
  return next(n for n in jax.tree.leaves(state, is_leaf=is_sparse) if is_sparse(n))


@needs_host
def test_compute_mode_reads_params_only_when_needed():
  params = make_params()
  for tx, want in ((ak.adam(0.1), False), (ak.adam(0.1, weight_decay=0.1), True)):
    st = tx.init(params)
    fn = lambda u, s, p, e, tx=tx: tx.update(u, s, p)  # noqa: E731
    assert _offload._reads_params(fn, params, st, params, {}) is want


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
  monkeypatch.setattr(_offload, "_probe",
                      lambda platform, mode: "Unimplemented: x" if mode == "compute" else None)
  with pytest.raises(RuntimeError, match="Use mode='state'"):
    _offload.check_support("compute", HOST, devices)
  _offload.check_support("state", HOST, devices)  # state mode needs no host compute
  # A JAX whose jit outputs forget their memory kind: neither mode, and it says so.
  monkeypatch.setattr(_offload, "_probe", lambda platform, mode: "results in device")
  for mode in MODES:
    with pytest.raises(RuntimeError, match="does not work here|Neither mode works"):
      _offload.check_support(mode, HOST, devices)


@needs_host
@pytest.mark.parametrize("make_tx", [
    lambda: ak.adam(0.1, grad_clip=ak.ClipGradByGlobalNorm(1.0)),
    lambda: ak.adam(0.1, grad_clip=ak.ClipGradByNorm(1.0), loss_scale=4.0),
], ids=["global-norm-clip", "norm-clip"])
def test_clipping_runs_in_the_default_compute_mode(make_tx):
  """adamkit's clip links trace on the host (optax.clip_by_global_norm's lax.select did not)."""
  params = make_params()
  g = grads_at(params, 0.0)
  tx, ref = ak.offload(make_tx(), mode="compute"), make_tx()
  u, s = tx.update(g, tx.init(params), params)
  v, _ = ref.update(g, ref.init(params), params)
  assert kinds(s) == {HOST}
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@needs_host
@pytest.mark.parametrize("make_tx", [
    lambda: ak.adam(0.1, nonfinite="skip"),
], ids=["skip-nonfinite"])
def test_untraceable_on_host_points_to_state_mode(make_tx):
  params = make_params()
  g = grads_at(params, 0.0)
  tx = ak.offload(make_tx(), mode="compute")
  with pytest.raises(RuntimeError, match="Use mode='state'"):
    tx.update(g, tx.init(params), params)
  tx = ak.offload(make_tx(), mode="state")  # the suggested mode works
  _, s = tx.update(g, tx.init(params), params)
  assert kinds(s) == {HOST}


@needs_host
@pytest.mark.parametrize("make_tx", [
    lambda: optax.chain(optax.clip_by_global_norm(1.0), ak.adam(0.1)),
    lambda: optax.apply_if_finite(ak.adam(0.1), max_consecutive_errors=2),
    lambda: optax.adafactor(0.1),
], ids=["optax-clip-by-global-norm", "optax-apply-if-finite", "optax-adafactor"])
def test_the_default_mode_runs_what_host_compute_cannot(make_tx):
  """Issue 11 item 3: ``ak.offload(optax.chain(optax.clip_by_global_norm(1.0),
  ak.adam(...)))`` failed in the default mode. The default is now ``"state"``, which
  runs it (under jit, two steps, the numbers of the transform without offload);
  ``"compute"`` still refuses it, naming ``mode="state"``."""
  params = make_params()
  tx, ref = ak.offload(make_tx()), make_tx()
  s, r = tx.init(params), ref.init(params)
  p, q = params, params
  for t in range(2):
    u, s = jax.jit(tx.update)(grads_at(p, float(t)), s, p)
    v, r = ref.update(grads_at(q, float(t)), r, q)
    p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
  assert kinds(s) == {HOST}
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  tx = ak.offload(make_tx(), mode="compute")
  with pytest.raises(RuntimeError, match="Use mode='state'"):
    tx.update(grads_at(params, 0.0), tx.init(params), params)


def test_this_backend_supports_both_modes_or_says_why():
  for mode in MODES:
    if SUPPORTED:
      _offload.check_support(mode, HOST)
    else:
      with pytest.raises(RuntimeError, match="Neither mode|does not work here"):
        ak.adam_offload(mode=mode).init(make_params())


# ------------------------------------------------------------------------ shim


@needs_host
def test_compute_on_shim_both_forms():
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

  from jax.experimental import compute_on as mod
  has_function_form = hasattr(mod, "compute_on2") or "out_memory_spaces" in str(
      inspect.signature(mod.compute_on))
  assert (_compat._FUNCTION_FORM is not None) == has_function_form
  run()
