"""ak.offload(..., chunk_bytes=...): the state streamed through the device in calls.

Values against the unstreamed, non-offloaded step on this process's CPU devices, for every
moment format and chunkings smaller than a leaf; bad arguments; and, where libtpu is
installed, XLA's deviceless figures for a TPU v5e chip (adamkit._targets).
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adamkit as ak
from adamkit import _offload, _stream

HOST = "pinned_host"
SUPPORTED = HOST in {m.kind for m in jax.devices()[0].addressable_memories()} and \
    _offload._probe(jax.devices()[0].platform, "state") is None
needs_host = pytest.mark.skipif(not SUPPORTED, reason="ak.offload unsupported here")

FORMATS = {
    "float32": {},
    "8bit": {"mu_dtype": "8bit", "nu_dtype": "8bit"},
    "4bit": {"mu_dtype": "4bit", "nu_dtype": "4bit"},
}


def make_params():
  # A matrix whose rows are whole 8/4-bit blocks, one whose are not (200 columns), a
  # small matrix and a vector: pieces of one leaf, leaves sharing a call, phantom rows.
  return jax.device_put({
      "a": jnp.linspace(-1.0, 1.0, 64 * 32, dtype=jnp.float32).reshape(64, 32),
      "b": jnp.ones(32, jnp.float32),
      "c": jnp.linspace(0.0, 1.0, 64 * 1024, dtype=jnp.float32).reshape(64, 1024),
      "d": jnp.linspace(-2.0, 2.0, 64 * 200, dtype=jnp.float32).reshape(64, 200)},
      jax.devices()[0])


def grads_at(params, t):
  return jax.tree.map(lambda p: jnp.sin(3.0 * p + 0.5 * t) + 0.1 * p, params)


def trajectory(tx, steps=3, grads=grads_at):
  params = make_params()
  state = tx.init(params)

  @jax.jit
  def step(p, s, t):
    u, s = tx.update(grads(p, t), s, p)
    return optax.apply_updates(p, u), s

  for t in range(steps):
    params, state = step(params, state, jnp.float32(t))
  return params, state


def step_trajectory(tx, steps=3, grads=grads_at):
  """``trajectory`` through the offloaded transform's one-pass ``step``, jitted as users
  jit it: params and state donated."""
  params = make_params()
  state = tx.init(params)
  step = jax.jit(lambda p, s, t: tx.step(p, s, grads=grads(p, t)), donate_argnums=(0, 1))
  for t in range(steps):
    params, state = step(params, state, jnp.float32(t))
  return params, state


def calls(tx, chunk_bytes):
  inner = optax.with_extra_args_support(tx)
  params = make_params()
  problem = _stream.structure(params, inner.init(params), params, chunk_bytes, inner.init)
  return None if problem is None else problem.calls


def assert_close(a, b, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


# Per-element float32 arithmetic in pieces rounds like the whole (XLA may fuse the pieces
# differently: a few ulps); an 8-bit code may flip on such an ulp; the 4-bit first
# moment's stochastic rounding is keyed by the element's position *in the piece*, so a
# piece that starts past row 0 rounds other elements up: within the moment's code step.
ATOL = {"float32": 1e-6, "8bit": 1e-3, "4bit": 5e-2}


@needs_host
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("chunk_bytes", [16384, 65536])
def test_streamed_equals_unstreamed_and_non_offloaded(fmt, chunk_bytes):
  make = lambda: ak.adamw(0.05, weight_decay=0.01, **FORMATS[fmt])  # noqa: E731
  plan = calls(make(), chunk_bytes)
  assert plan is not None and len(plan) > 1, "the test must stream"
  assert any(pc.start > 0 for c in plan for pc in c), "a leaf must be cut into pieces"
  want_p, _ = trajectory(make())
  got_p, got_s = trajectory(ak.offload(make(), mode="state", chunk_bytes=chunk_bytes))
  assert_close(got_p, want_p, ATOL[fmt])
  assert {x.sharding.memory_kind for x in jax.tree.leaves(got_s) if x.ndim} == {HOST}


@needs_host
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("chunk_bytes", [16384, None])
def test_step_adds_each_call_as_update_and_apply_do(fmt, chunk_bytes):
  """``ak.offload(tx).step`` (each streamed call's update added to its param rows at once)
  trains as ``update`` + ``optax.apply_updates`` of the same offloaded transform."""
  make = lambda: ak.offload(ak.adamw(0.05, weight_decay=0.01, **FORMATS[fmt]),  # noqa: E731
                            mode="state", chunk_bytes=chunk_bytes)
  assert isinstance(make(), ak.FusedStep)
  want_p, want_s = trajectory(make())
  got_p, got_s = step_trajectory(make())
  assert_close(got_p, want_p, ATOL[fmt] if fmt != "float32" else 1e-6)
  assert_close(got_s, want_s, ATOL[fmt] if fmt != "float32" else 1e-6)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(got_s) if x.ndim} == {HOST}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(got_p)} == {"device"}


def test_plan_scans_every_float_leaf_above_the_floor_on_whole_tiles():
  """A float leaf of more than ``chunk_bytes / SCAN_FLOOR`` bytes of state is cut into two
  or more equal pieces, which one ``lax.scan`` streams (XLA's TPU compiler merges the
  copies of unrolled calls and issues them at once); a matrix's pieces are whole (8, 128)
  tiles where its rows allow. A leaf under a call whose rows make more than SCAN_FLOOR
  equal pieces (31 rows: 31 one-row pieces) stays whole in a shared call."""
  inner = optax.with_extra_args_support(ak.adamw(0.05))
  params = {"a": jnp.zeros((64, 32)), "b": jnp.zeros(32), "c": jnp.zeros((64, 1024)),
            "e": jnp.zeros((3000, 16)), "p": jnp.zeros((31, 64))}
  chunk = 65536
  problem = _stream.structure(params, inner.init(params), params, chunk, inner.init)
  groups = [ks for ks in _stream.scan_groups(problem)
            if len(ks) > 1 and _stream._covers(problem, ks)]
  scanned = {problem.calls[ks[0]][0].leaf: problem.calls[ks[0]][0] for ks in groups}
  for i, name in enumerate(sorted(params)):  # dict order of the flattened tree
    state = 2 * params[name].nbytes
    if params[name].ndim < 2 or state <= chunk // _stream.SCAN_FLOOR or name == "p":
      assert i not in scanned, name
      continue
    assert i in scanned, (name, problem.calls)
    rows = scanned[i].stop - scanned[i].start
    assert 2 * rows * params[name].shape[1] * 4 <= chunk, (name, rows)
    assert rows < params[name].shape[0] and rows % 8 == 0, (name, rows)


@needs_host
@pytest.mark.parametrize("make", [
    lambda: ak.adam(0.05, grad_clip=ak.ClipGradByGlobalNorm(0.5)),
    lambda: ak.adam(0.05, loss_scale=128.0, grad_clip=ak.ClipGradByGlobalNorm(0.5)),
    lambda: optax.chain(optax.clip_by_global_norm(0.5), ak.adam(0.05)),
    lambda: optax.inject_hyperparams(ak.adam)(learning_rate=optax.linear_schedule(0.1, 0.0, 10)),
], ids=["clip", "loss-scale", "optax-clip", "inject-schedule"])
def test_global_statistics_and_wrappers_stream_exactly(make):
  # The global norm seen by each call is rebuilt by its phantom row: clipping must bind
  # (norms here are far above 0.5) exactly as in the whole step.
  want_p, _ = trajectory(make(), steps=4)
  got_p, _ = trajectory(ak.offload(make(), mode="state", chunk_bytes=4096), steps=4)
  assert_close(got_p, want_p, 1e-6)
  got_p, _ = step_trajectory(ak.offload(make(), mode="state", chunk_bytes=4096), steps=4)
  assert_close(got_p, want_p, 1e-6)  # the one-pass step: each call's rows applied at once


@needs_host
@pytest.mark.parametrize("fmt", ["float32", "8bit"])
def test_a_state_resumes_under_another_chunking(fmt):
  """The streamed state is the transform's own state whatever the chunking (nothing in it
  records the calls), so a run may change ``chunk_bytes`` between steps, or resume a
  state of the unstreamed step: the same numbers as one chunking throughout."""
  make = lambda: ak.adamw(0.05, weight_decay=0.01, **FORMATS[fmt])  # noqa: E731

  def run(chunkings):
    params, state, updates = make_params(), None, {}
    for t, chunk_bytes in enumerate(chunkings):
      if chunk_bytes not in updates:
        tx = ak.offload(make(), mode="state", chunk_bytes=chunk_bytes)
        state = tx.init(params) if state is None else state
        updates[chunk_bytes] = jax.jit(tx.update)
      u, state = updates[chunk_bytes](grads_at(params, jnp.float32(t)), state, params)
      params = optax.apply_updates(params, u)
    return params, state

  want_p, want_s = run([16384] * 4)
  got_p, got_s = run([16384, 65536, None, 16384])
  assert jax.tree.structure(got_s) == jax.tree.structure(want_s)
  assert_close(got_p, want_p, ATOL[fmt])


@needs_host
def test_nonfinite_skip_skips_every_call():
  def grads(p, t):  # step 1's gradient has one NaN, in a piece the other calls do not hold
    g = grads_at(p, t)
    return {**g, "c": g["c"].at[63, 5].set(jnp.where(t == 1, jnp.nan, g["c"][63, 5]))}

  make = lambda: ak.adam(0.05, nonfinite="skip")  # noqa: E731
  want_p, _ = trajectory(make(), grads=grads)
  got_p, _ = trajectory(ak.offload(make(), mode="state", chunk_bytes=4096), grads=grads)
  assert_close(got_p, want_p, 1e-6)
  got_p, _ = step_trajectory(ak.offload(make(), mode="state", chunk_bytes=4096), grads=grads)
  assert_close(got_p, want_p, 1e-6)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got_p))


@needs_host
@pytest.mark.parametrize("mode", ["state", "compute"])
def test_a_single_leaf_carries_its_own_phantom_row(mode):
  """With one leaf there is no other leaf for the phantom row: it is appended to the
  call's own rows (in compute mode, joined inside the host computation), and the global
  norm of clipping binds as in the whole step."""
  params = jax.device_put({"c": make_params()["c"]}, jax.devices()[0])
  make = lambda: ak.adamw(0.05, weight_decay=0.01, grad_clip=ak.ClipGradByGlobalNorm(0.5))  # noqa: E731

  def run(tx, one_pass):
    p, s = params, tx.init(params)
    for t in range(3):
      g = grads_at(p, jnp.float32(t))
      if one_pass:
        p, s = jax.jit(tx.step)(p, s, grads=g)
      else:
        u, s = jax.jit(tx.update)(g, s, p)
        p = optax.apply_updates(p, u)
    return p

  inner = optax.with_extra_args_support(make())
  problem = _stream.structure(params, inner.init(params), params, 65536, inner.init)
  assert len(problem.calls) > 1 and problem.phantom_slot(problem.calls[0]) == 0
  want = run(make(), False)
  tx = ak.offload(make(), mode=mode, chunk_bytes=65536)
  for one_pass in (False, True):
    assert_close(run(tx, one_pass), want, 1e-6)


@needs_host
@pytest.mark.parametrize("make", [lambda: ak.adam(0.05, nonfinite="skip"),
                                  lambda: optax.chain(optax.clip_by_global_norm(0.5), ak.adam(0.05))],
                         ids=["nonfinite-skip", "optax-clip"])
def test_compute_mode_streamed_refuses_what_the_host_cannot_trace(make):
  """Streamed or not, ``mode="compute"`` refuses a transform JAX cannot trace on
  host-resident arrays with the advice to use ``mode="state"``, never a raw type error."""
  for chunk_bytes in (4096, None):
    with pytest.raises(RuntimeError, match="mode='state'"):
      trajectory(ak.offload(make(), mode="compute", chunk_bytes=chunk_bytes), steps=1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "big", True])
def test_bad_chunk_bytes_named(bad):
  with pytest.raises(ValueError, match="chunk_bytes"):
    ak.offload(ak.adam(0.1), chunk_bytes=bad)


@pytest.mark.parametrize("mode", ["state", "compute"])
def test_an_int_where_nothing_streams_yet_is_refused(mode):
  """The fused steps take "auto" (the default: whole) or None; an int is refused, never
  silently ignored."""
  with pytest.raises(ValueError, match="`chunk_bytes`=4096.*FusedStep"):
    ak.offload(ak.fused_adam(0.1), mode=mode, chunk_bytes=4096)
  for chunk_bytes in ("auto", None):
    ak.offload(ak.fused_adam(0.1), mode=mode, chunk_bytes=chunk_bytes)


@needs_host
@pytest.mark.parametrize("make", [
    lambda: ak.adamw(0.05, weight_decay=0.01), lambda: ak.adam(0.05, nesterov=True),
    lambda: ak.adam(0.05, loss_scale=128.0, grad_clip=ak.ClipGradByGlobalNorm(0.5)),
    lambda: optax.inject_hyperparams(ak.adam)(learning_rate=optax.linear_schedule(0.1, 0.0, 10)),
], ids=["adamw", "adam", "clip-loss-scale", "inject-schedule"])
@pytest.mark.parametrize("chunk_bytes", [16384, 65536])
def test_compute_mode_streams_on_the_host(make, chunk_bytes):
  """``mode="compute"`` streamed: each call's gradient (and param) rows go down, its
  update is computed on the host beside its state rows, which never leave host memory,
  and comes back; ``update`` and the one-pass ``step`` train as the step without offload."""
  want_p, want_s = trajectory(make())
  for run in (trajectory, step_trajectory):
    got_p, got_s = run(ak.offload(make(), mode="compute", chunk_bytes=chunk_bytes))
    assert_close(got_p, want_p, 1e-6)
    assert_close(got_s, want_s, 1e-6)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got_s) if x.ndim} == {HOST}
  tx = ak.offload(make(), mode="compute", chunk_bytes=chunk_bytes)
  params = make_params()
  text = jax.jit(tx.update).lower(grads_at(params, 0.0), tx.init(params), params).as_text()
  # a host computation that takes a call's gradient, moment and param rows (not just a
  # slice of a host leaf), inside the loop over a leaf's pieces
  heads = [line for line in text.splitlines() if "func.func private @compute_on" in line]
  assert any(line.count("tensor<") >= 5 for line in heads), heads
  assert "stablehlo.while" in text


@needs_host
def test_state_in_another_memory_kind_is_refused():
  kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  if "unpinned_host" not in kinds:
    pytest.skip(f"this backend has no 'unpinned_host' memory ({sorted(kinds)})")
  tx = ak.offload(ak.adam(0.1), chunk_bytes=4096)
  params = make_params()
  state = jax.device_put(tx.init(params), jax.sharding.SingleDeviceSharding(
      jax.devices()[0], memory_kind="unpinned_host"))
  with pytest.raises(ValueError, match="`state` leaf .* 'unpinned_host'"):
    tx.update(grads_at(params, 0), state, params)


def test_backend_without_host_memory_is_refused(monkeypatch):
  monkeypatch.setattr(_offload, "_memory_kinds", lambda devices: {"device"})
  with pytest.raises(RuntimeError, match="memory kind 'pinned_host'"):
    ak.offload(ak.adam(0.1), chunk_bytes=4096).init(make_params())


# ------------------------------------------------------------ TPU v5e, deviceless

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed: no "
                                  "deviceless TPU compile (pip install 'jax[tpu]')")


def tpu_figures(tx, params):
  """XLA's figures of ``tx``'s step compiled for a TPU v5e chip (the one-pass ``step``
  where ``tx`` has one), and the bytes of its state's moments."""
  from adamkit import _targets  # noqa: PLC0415 - needs libtpu

  compiled, _, state = _targets.compile_step(tx, params, "v5e:1x1")
  moments = [x for x in jax.tree.leaves(state) if x.ndim]
  assert "copy-start" in compiled.as_text()  # asynchronous host <-> device copies
  return _targets.figures(compiled), _targets.per_device_bytes(moments)


@needs_libtpu
def test_tpu_v5e_state_stays_in_host_memory():
  params = {"w": jax.ShapeDtypeStruct((2048, 2048), jnp.float32)}  # state: 32 MiB
  figs = {}
  for chunk_bytes in (None, 2**20, "auto"):
    figs[chunk_bytes], state = tpu_figures(
        ak.offload(ak.adamw(1e-3), mode="state", chunk_bytes=chunk_bytes), params)
    assert figs[chunk_bytes].host_arguments == state
  # At the peak at least 3/4 of the 32 MiB state must be in host memory: the device's
  # temporaries stay under a quarter of it. Measured (jax 0.12.0.1, libtpu of jax[tpu]):
  # see docs/offload.md.
  assert figs[None].temporaries > state, figs  # the unstreamed step stages it all
  assert figs[2**20].temporaries <= state // 4, figs
  assert figs["auto"].temporaries <= state // 4, figs  # 4 MiB calls and their copies


@needs_libtpu
@pytest.mark.parametrize("tree", ["leaf", "transformer"])
def test_tpu_v5e_step_keeps_three_quarters_of_the_state_on_the_host(tree):
  """The offload issue's bar: at the device peak of the default offloaded step (a TPU v5e
  chip, ``chunk_bytes="auto"``) at most a quarter of the state's bytes are on the device,
  for Adam and AdamW, in both modes, on a 16.8M leaf and a transformer-shaped tree of 23M
  parameters. ``update`` + ``optax.apply_updates`` holds the whole update (4 bytes per
  parameter, half the state) and misses it on the tree; the one-pass ``step`` adds each
  call's update to its param rows."""
  from adamkit import _targets  # noqa: PLC0415 - needs libtpu

  params = ({"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)} if tree == "leaf"
            else _targets.transformer_shapes())
  for make in (ak.adam, ak.adamw):
    for mode in ("state", "compute"):
      figs, state = tpu_figures(ak.offload(make(1e-3), mode=mode), params)
      assert figs.host_arguments == state
      assert figs.temporaries <= state // 4, (make.__name__, mode, figs.temporaries / state)
  if tree == "transformer":
    tx = ak.offload(ak.adamw(1e-3), mode="state")
    figs, state = tpu_figures(optax.GradientTransformationExtraArgs(tx.init, tx.update),
                              params)
    assert figs.temporaries > state // 4, figs.temporaries / state


@needs_host
def test_auto_is_unstreamed_on_cpu():
  make = lambda: ak.adamw(0.05)  # noqa: E731
  want_p, _ = trajectory(make())
  got_p, _ = trajectory(ak.offload(make(), mode="state", chunk_bytes="auto"))
  assert_close(got_p, want_p, 0.0)  # bit for bit: the CPU branch stages the state whole


@needs_host
def test_multi_steps_streams_exactly_both_orders():
  # MultiSteps mixes int and float itself (optax), offloaded or not: standard promotion.
  inner = lambda: optax.MultiSteps(ak.adam(0.05), 2).gradient_transformation()  # noqa: E731
  with jax.numpy_dtype_promotion("standard"):
    want_p, _ = trajectory(inner(), steps=4)
    got_p, _ = trajectory(ak.offload(inner(), mode="state", chunk_bytes=4096), steps=4)
    assert_close(got_p, want_p, 1e-6)
    around = optax.MultiSteps(ak.offload(ak.adam(0.05), chunk_bytes=4096), 2)
    got_p, _ = trajectory(around.gradient_transformation(), steps=4)
    assert_close(got_p, want_p, 1e-6)
