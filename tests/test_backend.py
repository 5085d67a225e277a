"""The native backend layer: the kernel-or-XLA rule, the operations on either backend, the
kernels' own buffer checks, shardings kept, and the library without its native backend."""

import functools
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import adamkit as ak
from adamkit import _backend, _compat, _ops, _platform
from adamkit._backend import NOT_CPU, ONE_CPU, SPREAD, TRACED_CPU, TRACED_NOT_CPU, TRACED_ONE_CPU

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ------------------------------------------------------------- the rule, no compiler needed

WHERE = [ONE_CPU, SPREAD, NOT_CPU, TRACED_ONE_CPU, TRACED_CPU, TRACED_NOT_CPU]
# (backend, where) -> kernel?, for a built kernel, arrays it takes, enough work.
EXPECTED = {
    ("auto", ONE_CPU): True, ("auto", TRACED_ONE_CPU): True,
    ("kernel", ONE_CPU): True, ("kernel", TRACED_ONE_CPU): True, ("kernel", TRACED_CPU): True,
    ("kernel", TRACED_NOT_CPU): True,
}


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("backend", _backend.BACKENDS)
def test_rule_table(backend, where):
  assert _backend.decide(backend, built=True, fits=True, where=where) == EXPECTED.get(
      (backend, where), False)
  # Arrays the kernel cannot take, or no kernel under "auto": XLA, wherever they are.
  assert not _backend.decide(backend, built=True, fits=False, where=where)
  if backend != "kernel":
    assert not _backend.decide(backend, built=False, fits=True, where=where)
  # "auto" leaves small work to XLA; forcing ignores the size.
  small = _backend.decide(backend, built=True, fits=True, where=where, big_enough=False)
  assert small == (EXPECTED.get((backend, where), False) and backend == "kernel")


def test_rule_forced_without_kernel_raises():
  with pytest.raises(RuntimeError, match="not built"):
    _backend.decide("kernel", built=False, fits=True, where=ONE_CPU)


def test_placement_of_arrays():
  devices = jax.devices()
  one = jax.device_put(jnp.ones(8), devices[0])
  spread = jax.device_put(jnp.ones(8), NamedSharding(jax.make_mesh((8,), ("x",)), P("x")))
  assert _backend.placement(one) == ONE_CPU
  assert _backend.placement(one, spread) == SPREAD
  assert _backend.placement(np.ones(3)) == ONE_CPU
  seen = []
  jax.jit(lambda x: seen.append(_backend.placement(x)) or x)(one)
  assert seen == [TRACED_CPU if len(devices) > 1 else TRACED_ONE_CPU]
  if len(devices) >= 8:  # an Explicit mesh: the traced array's type carries its sharding
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    jax.jit(lambda x: seen.append(_backend.placement(x)) or x)(
        jax.device_put(jnp.ones(8), NamedSharding(mesh, P("x"))))
    assert seen[-1] == SPREAD


def test_use_kernel_refuses_what_the_kernel_cannot_take(monkeypatch):
  monkeypatch.setattr(_backend, "kernel_built", lambda: True)
  f32, bf16 = jnp.ones(4), jnp.ones(4, jnp.bfloat16)
  ids = jnp.array([1, 2], jnp.int32)
  assert _backend.use_kernel("kernel", f32, ids=ids, num_rows=10)
  assert _backend.use_kernel("kernel", f32, ids=ids.astype(jnp.int8), num_rows=10)
  assert not _backend.use_kernel("kernel", bf16, ids=ids, num_rows=10)
  assert not _backend.use_kernel("kernel", f32, ids=ids.astype(jnp.uint32), num_rows=10)
  assert not _backend.use_kernel("kernel", f32, ids=ids, num_rows=2**31)
  assert not _backend.use_kernel("kernel", f32, fits=False)


def _branch(traced: list, name: str, value: float):
  """A branch that records its tracing in ``traced`` and returns ``value``."""
  def fn():
    traced.append(name)
    return jnp.float32(value)
  return fn


@pytest.mark.parametrize("compilable", [False, True])
def test_gpu_branch_is_traced_only_where_a_gpu_can_be_compiled_for(monkeypatch, compilable):
  """``on_gpu`` traces its GPU branch only in a process that has a GPU plugin (without one
  no program can be lowered for a GPU), and the program runs the other branch here."""
  monkeypatch.setattr(_platform, "gpu_compilable", lambda: compilable)
  traced = []
  branch = functools.partial(_branch, traced)

  got = jax.jit(lambda: _platform.on_gpu(branch("gpu", 1.0), branch("other", 2.0)))()
  assert float(got) == 2.0
  assert sorted(traced) == (["gpu", "other"] if compilable else ["other"])


@pytest.mark.parametrize("plugins,modules,want", [
    ([], [], False), (["xla_cuda13"], [], True), ([], ["xla_rocm7"], True),
    (["xla_tpu_like"], ["other"], False)])
def test_gpu_compilable_reads_the_installed_plugins(monkeypatch, plugins, modules, want):
  """A CUDA or ROCm plugin by its entry point or its ``jax_plugins`` module."""
  import importlib.metadata
  import importlib.util
  import pkgutil
  import types

  monkeypatch.setattr(importlib.metadata, "entry_points",
                      lambda group: [types.SimpleNamespace(name=n) for n in plugins])
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: types.SimpleNamespace(
      submodule_search_locations=["x"]) if m == "jax_plugins" else real(m, *a))
  monkeypatch.setattr(pkgutil, "iter_modules",
                      lambda path: [types.SimpleNamespace(name=n) for n in modules])
  _platform.gpu_compilable.cache_clear()
  _platform._plugins.cache_clear()
  try:
    assert _platform.gpu_compilable() is want
  finally:
    _platform.gpu_compilable.cache_clear()
    _platform._plugins.cache_clear()


@pytest.mark.parametrize("tpu,plugins", [(False, ()), (True, ()), (False, ("xla_metal",))])
def test_cpu_branch_alone_is_traced_where_nothing_else_can_be_compiled_for(
    monkeypatch, tpu, plugins):
  """``on_cpu`` traces its other branch only in a process that could lower for another
  platform (``libtpu`` or any PJRT plugin installed); the program runs the CPU branch."""
  monkeypatch.setattr(_platform, "tpu_compilable", lambda: tpu)
  monkeypatch.setattr(_platform, "_plugins", lambda: plugins)
  traced = []
  branch = functools.partial(_branch, traced)

  got = jax.jit(lambda: _platform.on_cpu(branch("cpu", 1.0), branch("other", 2.0)))()
  assert float(got) == 1.0
  assert sorted(traced) == (["cpu", "other"] if tpu or plugins else ["cpu"])


def test_library_works_without_its_native_backend(tmp_path):
  """Deleting adamkit/_cpu leaves a working pure-JAX library with the same numbers."""
  shutil.copytree(ROOT / "adamkit", tmp_path / "adamkit",
                  ignore=shutil.ignore_patterns("_cpu", "__pycache__"))
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np, adamkit as ak
      assert not (ak.cpu_kernel_available() or ak._backend.native_ffi)
      p = {"emb": jnp.linspace(0, 1, 400).reshape(100, 4), "w": jnp.linspace(-1, 1, 40000)}
      g = {"emb": ak.RowSparse(jnp.array([3, 3, 9]), jnp.ones((3, 4)), 100),
           "w": jnp.cos(p["w"])}
      opt = ak.fused_adam(0.1, weight_decay=0.01)
      new, _ = jax.jit(opt.step)(p, opt.init(p), grads=g)
      tx = ak.sparse_adam(0.1)
      u, _ = tx.update(g, tx.init(p), p)
      via = ak.apply_updates(p, u)
      try:
        ak.build_cpu_kernel()
      except RuntimeError as e:
        assert "no native backend" in str(e)
      np.savez(__import__("sys").argv[1], *jax.tree.leaves((new, via)))
      """)
  out = tmp_path / "out.npz"
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  done = subprocess.run([sys.executable, "-c", script, str(out)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  p = {"emb": jnp.linspace(0, 1, 400).reshape(100, 4), "w": jnp.linspace(-1, 1, 40000)}
  g = {"emb": ak.RowSparse(jnp.array([3, 3, 9]), jnp.ones((3, 4)), 100), "w": jnp.cos(p["w"])}
  opt = ak.fused_adam(0.1, weight_decay=0.01, backend="xla")
  new, _ = jax.jit(opt.step)(p, opt.init(p), grads=g)
  tx = ak.sparse_adam(0.1, backend="xla")
  u, _ = tx.update(g, tx.init(p), p)
  want = jax.tree.leaves((new, ak.apply_updates(p, u, backend="xla")))
  got = np.load(out)
  for i, w in enumerate(want):
    np.testing.assert_array_equal(got[f"arr_{i}"], np.asarray(w))
  assert not np.array_equal(got["arr_0"], np.asarray(p["emb"]))


# ------------------------------------------------------- the operations, on either backend


def hyper(kind="hat", nesterov=False, lr=0.1, wd=0.0, amsgrad=False, decoupled=False):
  f = jnp.float32
  return _ops.Hyper(kind, nesterov, f(0.9), f(0.999), f(1e-8), f(0.1), f(0.001), lr=f(lr),
                    wd=f(wd), amsgrad=amsgrad, decoupled=decoupled)


VARIANTS = [("hat", {}), ("corrected", {}), ("adamax", {}),
            ("hat", dict(amsgrad=True)), ("corrected", dict(amsgrad=True, nesterov=True)),
            ("corrected", dict(decoupled=True)), ("hat", dict(decoupled=True, amsgrad=True))]


@pytest.mark.parametrize("kind,kw", VARIANTS)
def test_dense_step_same_numbers_on_either_backend(kernel, kind, kw):
  rng = np.random.default_rng(0)
  ps = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(7, 3), (5,), (2, 2, 2)]]
  gs = [jnp.asarray(rng.normal(size=p.shape), jnp.float32) for p in ps]
  h = hyper(kind, wd=0.01, **kw)
  # m, v (and vmax): 44 elements each, the leaves back to back from offset 3
  state = tuple(jnp.asarray(rng.normal(size=44) ** 2, jnp.float32) for _ in range(_ops.state_size(h)))
  at = [[3, 24, 29]] * len(state)
  out = {}
  for backend in ("kernel", "xla"):
    fn = lambda ps, gs, state, b=backend: _ops.dense_step(h, ps, gs, state, at=at, decay=True,
                                                          backend=b)
    out[backend] = jax.jit(fn)(ps, gs, state)
    text = jax.jit(fn).lower(ps, gs, state).as_text()
    assert ("adamkit_cpu_step" in text) == (backend == "kernel")
  for a, b in zip(jax.tree.leaves(out["kernel"]), jax.tree.leaves(out["xla"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
  if kw.get("amsgrad"):  # the running maximum moved where v rose above it, and only there
    new_v, new_vmax = (np.asarray(x) for x in out["kernel"][1][1:])
    np.testing.assert_array_equal(new_vmax[3:37], np.maximum(np.asarray(state[2])[3:37], new_v[3:37]))
    assert np.any(new_vmax[3:37] != np.asarray(state[2])[3:37])
  new_m = np.asarray(out["kernel"][1][0])
  m = state[0]
  np.testing.assert_array_equal(new_m[:3], np.asarray(m)[:3])  # outside the leaves: untouched
  np.testing.assert_array_equal(new_m[37:], np.asarray(m)[37:])
  assert not np.array_equal(new_m[3:37], np.asarray(m)[3:37])


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("kw", [{}, dict(amsgrad=True), dict(decoupled=True, wd=0.1),
                                dict(decoupled=True, wd=0.1, amsgrad=True)])
def test_row_ops_same_numbers_on_either_backend(kernel, merge, kw):
  rng = np.random.default_rng(1)
  table = jnp.asarray(rng.normal(size=(50, 3)), jnp.float32)
  h = hyper(**kw)
  state = (jnp.zeros_like(table), jnp.ones_like(table), 2.0 * jnp.ones_like(table))[:_ops.state_size(h)]
  ids = jnp.array([4, 9, 4, -1, 50, 17] if merge else [4, 9, 17], jnp.int32)
  g = ak.RowSparse.tree_unflatten(50, (ids, jnp.asarray(rng.normal(size=(len(ids), 3)), jnp.float32)))
  out = {}
  for backend in ("kernel", "xla"):
    step = _ops.lazy_row_step(h, table, g, state, merge=merge, decay=h.decoupled, backend=backend)
    ids_u, u, state2 = _ops.lazy_rows(h, g, state, table_shape=table.shape, merge=merge,
                                      backend=backend)
    added = _ops.row_add(table, g, backend=backend)
    out[backend] = (step, state2, added)
  for a, b in zip(jax.tree.leaves(out["kernel"]), jax.tree.leaves(out["xla"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
  moved = np.flatnonzero(np.any(np.asarray(out["kernel"][0][0]) != np.asarray(table), axis=1))
  assert moved.tolist() == [4, 9, 17]


def test_ops_refuse_mismatched_buffers():
  h = hyper()
  table = jnp.zeros((1000, 4))
  g = ak.RowSparse(jnp.array([1, 2]), jnp.ones((2, 4)), 1000)
  with pytest.raises(ValueError, match="first moment"):
    _ops.lazy_row_step(h, table, g, (jnp.zeros((10, 4)), jnp.zeros((1000, 4))), backend="xla")
  with pytest.raises(ValueError, match="one row of values per id"):
    _ops.lazy_row_step(h, table, g.with_values(jnp.ones((1, 4))), (table, table), backend="xla")
  with pytest.raises(ValueError, match="cannot hold"):
    _ops.dense_step(h, [jnp.ones(8)], [jnp.ones(8)], (jnp.zeros(10), jnp.zeros(10)),
                    at=([4], [0]), backend="xla")
  ams = hyper(amsgrad=True)
  with pytest.raises(ValueError, match="3 moment buffers"):
    _ops.dense_step(ams, [jnp.ones(8)], [jnp.ones(8)], (jnp.zeros(8), jnp.zeros(8)), backend="xla")
  with pytest.raises(ValueError, match="running maximum"):
    _ops.lazy_row_step(ams, table, g, (table, table, jnp.zeros((999, 4))), backend="xla")
  with pytest.raises(ValueError, match="does not fit"):
    _ops.row_add(table, ak.RowSparse(jnp.array([1]), jnp.ones((1, 3)), 1000), backend="xla")


# ---------------------------------------------------- the kernels check their own buffers


def raw_call(target, outs, *args, **attrs):
  return jax.ffi.ffi_call(target, outs)(*args, **attrs)


def test_kernels_refuse_mismatched_sizes_themselves(kernel):
  """Past the Python checks, each handler checks every buffer from its own shape."""
  f32 = lambda *s: jnp.zeros(s, jnp.float32)
  sd = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  s9 = f32(9)
  adam = dict(kind=np.int64(0), nesterov=False, decay=np.int64(0), amsgrad=False, state=np.int64(2))
  ams = dict(adam, amsgrad=True, state=np.int64(3))
  p, small, big = f32(100), f32(10), f32(100)
  for attrs, state in [(adam, (small, big)), (adam, (big, small)), (ams, (big, big, small))]:
    with pytest.raises(Exception, match="smaller than its params"):  # one buffer too small
      raw_call("adamkit_cpu_step", [sd(p), *map(sd, state)], s9, p, p, *state,
               offset=np.int64(0), **attrs)
  for attrs, state in [(dict(adam, state=np.int64(3)), (big, big, big)), (ams, (big, big)),
                       (dict(ams, kind=np.int64(2)), (big, big, big)),
                       (dict(adam, decay=np.int64(3)), (big, big))]:
    with pytest.raises(Exception, match=r"attributes? [a-z ]+(= -?\d+ )?must be|2L\+S arguments"):
      raw_call("adamkit_cpu_step", [sd(p), *map(sd, state)], s9, p, p, *state,
               offset=np.int64(0), **attrs)
  ids = jnp.array([1, 2, 3, 4], jnp.int32)
  table = f32(100, 8)
  lazy = dict(apply=True, merge=True, offset=np.int64(0), num_rows=np.int64(100))
  with pytest.raises(Exception, match="gradient rows do not match ids"):  # 2 rows for 4 ids
    raw_call("adamkit_cpu_sparse_lazy", [sd(table)] * 3, s9, ids, f32(2, 16), table, table,
             table, **adam, **lazy)
  with pytest.raises(Exception, match=r"first moment( is smaller| \(\d+ elements\) does not hold)"):
    raw_call("adamkit_cpu_sparse_lazy", [sd(f32(10, 8)), sd(table), sd(table)], s9, ids,
             f32(4, 8), f32(10, 8), table, table, **adam, **lazy)
  with pytest.raises(Exception, match=r"running maximum( is smaller| \(\d+ elements\) does not hold)"):
    raw_call("adamkit_cpu_sparse_lazy", [sd(table), sd(table), sd(f32(10, 8)), sd(table)], s9,
             ids, f32(4, 8), table, table, f32(10, 8), table, **ams, **lazy)
  # decoupled decay needs the table
  with pytest.raises(Exception, match=r"attribute decay = 2 must be .* with apply = true"):
    raw_call("adamkit_cpu_sparse_lazy", [sd(table), sd(table), sd(f32(4)), sd(f32(4, 8))], s9,
             ids, f32(4, 8), table, table, **dict(adam, decay=np.int64(2)),
             **dict(lazy, apply=False))
  with pytest.raises(Exception, match="rows do not match"):
    raw_call("adamkit_cpu_row_add", sd(table), ids, f32(4, 3), table)


def test_ffi_layer_checks_before_calling(kernel):
  from adamkit._cpu import ffi
  s = ffi.scalars("hat", b1=0.9, b2=0.999, eps=1e-8, lr=0.1, wd=0.0, bc1=0.1, bc2=0.001)
  with pytest.raises(ValueError, match="first moment"):
    ffi.dense_step(ffi.Variant("hat"), s, [jnp.ones(100)], [jnp.ones(100)],
                   (jnp.zeros(10), jnp.zeros(100)))
  with pytest.raises(ValueError, match="4 ids but gradient rows"):
    ffi.sparse_lazy(ffi.Variant("hat"), s, jnp.arange(4), jnp.ones((2, 8)),
                    (jnp.zeros((100, 8)),) * 2, row_shape=(8,), num_rows=100)
  with pytest.raises(ValueError, match="int32"):
    ffi.kernel_ids(jnp.arange(3, dtype=jnp.uint32))


# ------------------------------------------------------------------ shardings are kept


@pytest.mark.parametrize("multi_tensor,axis_type", [(False, "Explicit"), (False, "Auto"),
                                                    (True, "Auto")])
def test_fused_step_keeps_shardings_on_8_devices(multi_tensor, axis_type):
  """Params sharded P("data", "model") stay so step after step (the kernel has no sharding
  rule, so such arrays take XLA's step); the numbers equal a one-device run. Multi-tensor
  moments are flat buffers: XLA shards them (not replicated) and they keep that sharding."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
  sharding = NamedSharding(mesh, P("data", "model"))
  host = {"w": np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32),
          "b": np.full((8, 4), 0.5, np.float32)}
  opt = ak.fused_adam(0.1, weight_decay=0.01, multi_tensor=multi_tensor)
  out = None
  if multi_tensor and axis_type == "Auto" and not _compat.TIES_SHARDINGS:
    # jax >= 0.12 has no shard_alike: in Auto mode the params' out_shardings say it
    out = ({"b": sharding, "w": sharding}, None)
  step = jax.jit(opt.step, donate_argnums=(0, 1), out_shardings=out)
  grads_of = lambda p: jax.tree.map(lambda x: jnp.sin(3.0 * x), p)

  params = jax.device_put(host, sharding)
  state = opt.init(params)
  moment_shardings = None
  for _ in range(3):
    params, state = step(params, state, grads=grads_of(params))
    for leaf in jax.tree.leaves(params):
      assert leaf.sharding.is_equivalent_to(sharding, 2)
    moments = jax.tree.leaves((state.mu, state.nu))
    if not multi_tensor:
      assert all(m.sharding.is_equivalent_to(sharding, 2) for m in moments)
    assert all(not m.sharding.is_fully_replicated for m in moments)
    now = [m.sharding for m in moments]
    assert moment_shardings in (None, now)
    moment_shardings = now

  one = jax.device_put(host, jax.devices()[0])
  one_state = opt.init(one)
  for _ in range(3):
    one, one_state = jax.jit(opt.step)(one, one_state, grads=grads_of(one))
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((one, one_state))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)


def test_concrete_sharded_arrays_never_take_the_kernel(kernel):
  """Even forced, a dense step on arrays spread over devices stays on XLA (no replication)."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  p = jax.device_put(jnp.ones(64), sharding)
  new, (m, v) = _ops.dense_step(hyper(), [p], [p], (jnp.zeros_like(p), jnp.zeros_like(p)),
                                backend="kernel")
  assert new[0].sharding.is_equivalent_to(sharding, 1) and m.sharding.is_equivalent_to(sharding, 1)


def test_multi_tensor_refuses_explicit_sharded_params():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
  params = {"w": jax.device_put(jnp.ones((16, 2)), NamedSharding(mesh, P("x")))}
  with pytest.raises(ValueError, match="'w'.*multi_tensor=False"):
    ak.fused_adam(multi_tensor=True).init(params)


@pytest.mark.parametrize("make,multi_tensor", [
    (lambda: ak.fused_adam(0.05, weight_decay=0.01, backend="xla"), True),
    (lambda: ak.fused_adam(0.05, weight_decay=0.01), True),
    (lambda: ak.fused_adamax(0.05, backend="xla"), True),
    (lambda: ak.fused_adam(0.05, weight_decay=0.01, multi_tensor=False), False)],
    ids=["fused_adam_xla", "fused_adam_auto", "fused_adamax", "fused_adam_per_leaf"])
def test_fused_step_keeps_mixed_shardings_on_8_devices(make, multi_tensor):
  """tests/test_multiprocess.py's model in one process: a row-sharded table, model-parallel
  kernels and a replicated bias on an Auto ("data", "model") mesh. The multi-tensor flat
  buffers are sharded by XLA; no leaf takes their sharding (the bias once came back
  P('data',)), step after step, and the numbers equal a one-device run."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  specs = {"emb": P(("data", "model"), None), "w1": P(None, "model"), "w2": P("model", None),
           "b": P()}
  rng = np.random.default_rng(0)
  host = {"emb": rng.standard_normal((64, 8)), "w1": rng.standard_normal((8, 16)),
          "w2": rng.standard_normal((16, 4)), "b": np.zeros(4)}
  host = {k: v.astype(np.float32) for k, v in host.items()}
  opt = make()
  out = None
  if multi_tensor and not _compat.TIES_SHARDINGS:  # jax >= 0.12: no shard_alike (above)
    out = ({k: NamedSharding(mesh, spec) for k, spec in specs.items()}, None)
  fn = lambda p, s: opt.step(p, s, grads=jax.tree.map(lambda x: jnp.sin(3.0 * x) + 0.1, p))
  step = jax.jit(fn, out_shardings=out)

  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
  state = opt.init(params)
  state_shardings = None
  for _ in range(3):
    params, state = step(params, state)
    for k, spec in specs.items():
      assert params[k].sharding.is_equivalent_to(NamedSharding(mesh, spec), params[k].ndim), (
          k, params[k].sharding)
    now = [x.sharding for x in jax.tree.leaves(state)]
    assert state_shardings in (None, now)
    state_shardings = now

  one = jax.device_put(host, jax.devices()[0])
  one_state = opt.init(one)
  for _ in range(3):
    one, one_state = jax.jit(fn)(one, one_state)
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((one, one_state))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)


def test_one_device_is_chosen_by_the_program_lowered():
  """``_compat.one_device``: the branch of the device count the program is lowered for
  (inside jit an Auto mesh's arrays carry no sharding), one device, a 2- and an 8-device
  mesh, under grad and vmap; outside a program, the many-device branch."""
  f = jax.jit(lambda x: _compat.one_device(lambda: x * 2.0, lambda: x * 3.0))
  x = jnp.ones((8, 4))
  assert float(f(x)[0, 0]) == 2.0
  for n in (2, 8):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
    assert float(f(jax.device_put(x, NamedSharding(mesh, P("x"))))[0, 0]) == 3.0, n
    replicated = jax.device_put(x, NamedSharding(mesh, P()))
    assert float(f(replicated)[0, 0]) == 3.0, n  # n devices, though none is split
  assert float(jax.jit(jax.grad(lambda x: jnp.sum(f(x))))(x)[0, 0]) == 2.0
  assert float(jax.vmap(f)(jnp.ones((2, 8, 4)))[0, 0, 0]) == 2.0
  assert float(_compat.one_device(lambda: 2.0, lambda: 3.0)) == 3.0
