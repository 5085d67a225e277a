"""Quantized moments (``mu_dtype`` / ``nu_dtype`` = ``ak.Quantized`` or "8bit"/"4bit"/"fp8")
in the chain form: torchao's 8-bit trajectory, a float64 NumPy reference of the 4-bit and
fp8 steps, memory, layouts, errors, checkpoints and sharding."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import GOLDEN, load_ao_8bit_run
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import round_4bit_mu

import adamkit as ak
from adamkit import _platform, _quant, _quant_ops

MOMENT_STATES = (ak.ScaleByAdamState, ak.ScaleByAmsgradState, ak.ScaleByAdamaxState,
                 ak.FusedAdamState)


def moments_of(state):
  """The one Adam/AMSGrad/AdaMax moment node of an optimizer state."""
  is_node = lambda x: isinstance(x, MOMENT_STATES)  # noqa: E731
  (node,) = [x for x in jax.tree.leaves(state, is_leaf=is_node) if is_node(x)]
  return node


# ------------------------------------------------------------------ torchao's 8-bit


def _replay_torchao(mu_dtype, nu_dtype):
  """Max over the 20 steps of |p - p_torchao| / lr, per param, for ``ak.adamw`` with
  torchao AdamW8bit's hyperparameters (its formula: eps added to sqrt(v_hat), decoupled
  decay of every leaf)."""
  d = np.load(GOLDEN / "ao_adamw8bit_public.npz")
  lr = float(d["lr"])
  tx = ak.adamw(lr, float(d["b1"]), float(d["b2"]), float(d["eps"]),
                weight_decay=float(d["weight_decay"]), eps_mode="corrected",
                weight_decay_mask=None, mu_dtype=mu_dtype, nu_dtype=nu_dtype)
  params = {k: jnp.asarray(d[f"init.{k}"]) for k in ("w", "b")}
  state = tx.init(params)
  update = jax.jit(tx.update)
  worst = {k: 0.0 for k in params}
  for t in range(int(d["steps"])):
    u, state = update({k: jnp.asarray(d[f"grads.{k}"][t]) for k in params}, state, params)
    params = optax.apply_updates(params, u)
    for k in params:
      worst[k] = max(worst[k], float(np.max(np.abs(np.asarray(params[k]) - d[f"params.{k}"][t]))))
  return {k: w / lr for k, w in worst.items()}, state, d


def test_8bit_replays_torchao_adamw8bit():
  exact = ak.Quantized("8bit", exact=True)  # torchao's arithmetic (no floor of v)
  worst, state, d = _replay_torchao(exact, exact)
  assert max(worst.values()) < 0.1, worst
  # w (64 x 256) is quantized, b (300 elements) under min_size keeps float32, as torchao
  inner = moments_of(state)
  assert isinstance(inner.mu["w"], ak.QuantizedArray) and inner.mu["w"].fmt.kind == "8bit"
  assert inner.mu["b"].dtype == jnp.float32 and inner.nu["b"].shape == (300,)
  sd = ak.state_dict(state)
  for name, key in (("moment1", "exp_avg"), ("moment2", "exp_avg_sq")):
    # the same codes but for a few at a rounding boundary; scales to float32 rounding
    same = np.isclose(sd[f"w.{name}"], d[f"{key}.w"], rtol=1e-4, atol=1e-12)
    assert same.mean() >= 0.999, same.mean()


def test_torchao_tolerance_tells_formats_apart():
  """The 0.1 x lr bound is meaningful: one scale for the whole of w (a block of 64 x 256)
  or unquantized float32 moments land further away from torchao's trajectory."""
  per_tensor = ak.Quantized("8bit", block_size=64 * 256, exact=True)
  worst, _, _ = _replay_torchao(per_tensor, per_tensor)
  assert worst["w"] > 0.1, worst
  worst, _, _ = _replay_torchao(None, None)
  assert worst["w"] > 0.1, worst


AO_RUNS = ("adamw_block128", "adamw_block512", "adam_l2", "adamw_warmup")


def _replay_ao_run(run, pad):
  """Max over the recorded steps of |p - p_torchao| / lr, per param, for a torchao run of
  ``tests/golden/ao_8bit_runs.npz`` replayed with ``ak.adamw`` (AdamW8bit) or ``ak.adam``
  (Adam8bit: L2 decay, g + wd * p before the moments), 8-bit moments in the run's block
  size, padded or not; with the final state and torchao's choice of quantized leaves."""
  config, init, grads, recorded, quantized = load_ao_8bit_run(run)
  kw, lrs = config["kwargs"], config["lr"]
  q = ak.Quantized("8bit", block_size=kw.get("block_size"), pad=pad, exact=True)
  make = ak.adamw if config["optimizer"] == "AdamW8bit" else ak.adam
  b1, b2 = kw.get("betas", (0.9, 0.999))
  tx = make(lambda count: jnp.asarray(lrs)[count], b1, b2, kw.get("eps", 1e-8),
            weight_decay=kw["weight_decay"], eps_mode="corrected", weight_decay_mask=None,
            mu_dtype=q, nu_dtype=q)
  params = {k: jnp.asarray(v) for k, v in init.items()}
  state = tx.init(params)
  update = jax.jit(tx.update)
  worst = {k: 0.0 for k in params}
  for t in range(len(lrs)):
    u, state = update({k: jnp.asarray(g[t]) for k, g in grads.items()}, state, params)
    params = optax.apply_updates(params, u)
    for k, want in recorded.get(t, {}).items():
      worst[k] = max(worst[k], float(np.max(np.abs(np.asarray(params[k]) - want))) / max(lrs))
  return worst, state, quantized


@pytest.mark.parametrize("run", AO_RUNS)
def test_8bit_replays_other_torchao_runs(run):
  """Other block sizes, L2 decay, other betas and eps, a learning rate changed at every
  step, and a leaf of 4500 elements (not a multiple of the block): torchao keeps that
  leaf's moments in float32, which ``pad=False`` reproduces; the default pads it to
  whole blocks instead (as bitsandbytes), and lands visibly away from torchao there."""
  worst, state, quantized = _replay_ao_run(run, pad=False)
  assert max(worst.values()) < 0.1, worst
  inner = moments_of(state)
  assert {k: _quant.is_qarray(inner.mu[k]) for k in quantized} == quantized
  assert {k: _quant.is_qarray(inner.nu[k]) for k in quantized} == quantized
  padded, _, _ = _replay_ao_run(run, pad=True)
  assert padded["w"] < 0.1 and padded["t"] > 0.1, padded


# ------------------------------------------------- float64 NumPy reference, 4-bit and fp8


def _np_dynamic_map(signed, bits, decades):
  """The "dynamic" code book in float64: per decade 10^-(E-1) .. 1, the midpoints of an
  even split of [0.1, 1] (2^i of them in decade i, twice as many when unsigned), +-, 0, 1."""
  vals = [0.0, 1.0]
  for i in range(decades):
    n = 2 ** (i + bits - 1 - decades) * (1 if signed else 2)
    edges = np.linspace(0.1, 1.0, n + 1)
    mids = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - decades + 1)
    vals += list(mids) + (list(-mids) if signed else [])
  vals += [0.0] * (2 ** bits - len(vals))
  return np.sort(np.asarray(vals))


def _np_e4m3_round(y):
  """|y| <= 448 rounded to float8 e4m3 (3 mantissa bits, subnormals from 2^-6, steps of
  2^-9), nearest, ties to even."""
  a = np.abs(y)
  e = np.floor(np.log2(np.maximum(a, 2.0 ** -6)))
  quantum = 2.0 ** (e - 3)
  return np.sign(y) * np.round(a / quantum) * quantum


def _np_quantize(x, kind, role, block, step=None):
  """float64 blocks of ``x`` (flattened, zero-padded) -> the values they read back as
  (``step``: the step count of the 4-bit first moment's dither, tests/reference.py; the
  positions are the flat indices)."""
  flat = np.asarray(x, np.float64).reshape(-1)
  flat = np.pad(flat, (0, -flat.size % block)).reshape(-1, block)
  flat = np.where(np.isfinite(flat), flat, 0.0)
  if role == "nu":
    flat = np.maximum(flat, 0.0)
    if kind != "8bit":
      flat = np.sqrt(flat)
  scale = np.maximum(np.abs(flat).max(axis=1, keepdims=True), 1e-12)
  r = flat / scale
  if kind == "fp8":
    y = np.clip(r * 448.0, -448.0, 448.0)
    if role == "nu":
      y = np.where(y > 0, np.maximum(y, 2.0 ** -9), y)
    q = _np_e4m3_round(y) / 448.0
  elif kind == "4bit" and role == "nu":
    q = 2.0 ** (-(15 - np.clip(np.round(15 + 2 * np.log2(np.maximum(r, 2.0 ** -16))), 0, 15)) / 2)
  elif kind == "4bit":  # levels k/7, rounded down or up by the dither
    q = round_4bit_mu(r, np.arange(r.size).reshape(r.shape), step) / 7
  else:
    book = _np_dynamic_map(role == "mu", 8 if kind == "8bit" else 4, 7 if kind == "8bit" else 3)
    mids = (book[:-1] + book[1:]) / 2
    q = book[np.searchsorted(mids, r, side="right")]  # nearest, ties up
  out = q * scale
  if role == "nu" and kind != "8bit":
    out = out * out
  return out.reshape(-1)[:np.size(x)].reshape(np.shape(x)), scale.reshape(-1)


def _np_decode(q):
  """An adamkit QuantizedArray read back in float64 by NumPy, from its codes and scales."""
  codes, scales, fmt = np.asarray(q.codes), np.asarray(q.scales, np.float64), q.fmt
  codes = codes.reshape(scales.size, -1)  # a row of bytes per block
  if fmt.kind == "4bit":  # two codes per byte, the even element in the low nibble
    codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(codes.shape[0], -1)
  if fmt.kind == "fp8":
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e, m = (codes >> 3) & 15, codes & 7
    vals = sign * np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e.astype(float) - 7))
    vals = vals / 448.0
  elif fmt.kind == "4bit" and fmt.role == "nu":
    vals = 2.0 ** (-(15 - codes.astype(float)) / 2)
  elif fmt.kind == "4bit":
    vals = (codes.astype(float) - 7) / 7
  else:
    book = _np_dynamic_map(fmt.role == "mu", 8 if fmt.kind == "8bit" else 4,
                           7 if fmt.kind == "8bit" else 3)
    vals = book[codes]
  out = vals * scales.reshape(-1, 1)
  if fmt.role == "nu" and fmt.kind != "8bit":
    out = out * out
  n = int(np.prod(q.shape))
  return out.reshape(-1)[:n].reshape(q.shape)


def _assert_stored_as(q, want, scales, *, tol_frac=2e-3):
  """``q`` reads back (NumPy) as ``want`` but for a few codes at a rounding boundary (the
  float32 step rounds m and v differently from float64), with the reference's scales."""
  got = _np_decode(q)
  np.testing.assert_allclose(np.asarray(q.scales).reshape(-1), scales, rtol=2e-5)
  off = ~np.isclose(got, want, rtol=1e-5, atol=1e-12)
  assert off.mean() <= tol_frac, (off.sum(), off.size)


@pytest.mark.parametrize("kind", ["4bit", "fp8", "8bit"])
@pytest.mark.parametrize("shape", [(48, 256), (37, 129)])
def test_quantized_step_matches_float64_reference(kind, shape):
  """Each step from adamkit's stored state: params, stored m and v against float64 NumPy
  (AdamW, eps_mode="corrected", AMSGrad's maximum in nu's format)."""
  lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.1
  q = ak.Quantized(kind, block_size=64, min_size=0)
  tx = ak.adamw(lr, b1, b2, eps, weight_decay=wd, weight_decay_mask=None, amsgrad=True,
                mu_dtype=q, nu_dtype=q)
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=shape), jnp.float32)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(1, 4):
    g = rng.normal(size=shape).astype(np.float32) * (1.0 + 10.0 * (t == 2))
    inner = moments_of(state)
    m0, v0, vmax0 = (_np_decode(x["w"]) for x in (inner.mu, inner.nu, inner.nu_max))
    u, state = update({"w": jnp.asarray(g)}, state, params)
    new_p = np.asarray(optax.apply_updates(params, u)["w"], np.float64)
    g64, p64 = g.astype(np.float64), np.asarray(params["w"], np.float64)
    b1, b2 = float(np.float32(b1)), float(np.float32(b2))  # 1 - beta of float32 betas
    m = b1 * m0 + (1 - b1) * g64
    v = b2 * v0 + (1 - b2) * g64 ** 2
    vmax = np.maximum(vmax0, v)
    step = (m / (1 - b1 ** t)) / (np.sqrt(vmax / (1 - b2 ** t)) + eps)
    np.testing.assert_allclose(new_p, p64 - lr * (step + wd * p64), rtol=0, atol=1e-6)
    inner = moments_of(state)
    for stored, x, role in ((inner.mu, m, "mu"), (inner.nu, v, "nu"), (inner.nu_max, vmax, "nu")):
      _assert_stored_as(stored["w"], *_np_quantize(x, kind, role, 64, step=t))
    params = {"w": jnp.asarray(new_p, jnp.float32)}


def test_adamax_infinity_norm_is_a_second_moment():
  """AdaMax's nu (max(b2 nu, |g|)) is stored in the non-negative role of nu_dtype."""
  q = ak.Quantized("4bit", block_size=64, min_size=0)
  tx = ak.scale_by_adamax(mu_dtype=q, nu_dtype=q)
  g = jnp.asarray(np.random.default_rng(1).normal(size=(8, 128)), jnp.float32)
  u, state = tx.update({"w": g}, tx.init({"w": g}))
  assert state.nu["w"].fmt.role == "nu" and state.mu["w"].fmt.role == "mu"
  _assert_stored_as(state.nu["w"], *_np_quantize(np.abs(np.asarray(g, np.float64)), "4bit", "nu", 64))
  g64 = np.asarray(g, np.float64)
  np.testing.assert_allclose(u["w"], g64 / (np.abs(g64) + 1e-8), rtol=1e-6)  # first step


# ------------------------------------------------------------------------- memory


def _state_bytes(state):
  return sum(x.nbytes for x in jax.tree.leaves(state))


@pytest.mark.parametrize("kind,bound", [("8bit", 2.05), ("4bit", 1.05)])
def test_persistent_state_bytes_per_param(kind, bound):
  params = {"w": jax.ShapeDtypeStruct((1024, 4096), jnp.float32)}
  tx = ak.scale_by_adam(mu_dtype=kind, nu_dtype=kind)
  state = jax.eval_shape(tx.init, params)
  per_param = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / (1024 * 4096)
  assert per_param <= bound, per_param
  assert per_param >= bound - 0.1  # and the moments are really there


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
@pytest.mark.parametrize("shape", [(2048, 2048), (4194301,)])
def test_jitted_step_keeps_under_a_byte_per_param_of_temporaries(kind, shape):
  """update + apply_updates under jit at 4M params: no full-size float32 copy of m or v
  (either would be 4 bytes per param); the strided and contiguous chunkings both."""
  tx = ak.adamw(1e-3, mu_dtype=kind, nu_dtype=kind, weight_decay_mask=None)
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  state = jax.eval_shape(tx.init, params)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  compiled = jax.jit(step, donate_argnums=(0,)).lower(params, state, params).compile()
  per_param = compiled.memory_analysis().temp_size_in_bytes / np.prod(shape)
  assert per_param <= 1.0, per_param


# ------------------------------------------------------------- layouts and min_size


def test_layouts_padding_and_min_size():
  params = {"big": jnp.ones((16, 512)), "odd": jnp.ones((37, 129)), "small": jnp.ones((10, 10),
                                                                                    jnp.bfloat16)}
  state = ak.scale_by_adam(mu_dtype=ak.Quantized("8bit", min_size=1000), nu_dtype="4bit").init(params)
  big, odd = state.mu["big"], state.mu["odd"]
  assert big.codes.shape == (16, 512) and big.scales.shape == (16, 2)  # the leaf's shape
  assert odd.codes.shape == (19, 256) and odd.scales.shape == (19,)  # 4773 -> 19 blocks
  assert state.nu["odd"].codes.shape == (19, 128)  # 4-bit: two codes a byte
  # under min_size: float32 moments, whatever the param's dtype
  assert state.mu["small"].dtype == jnp.float32 and state.mu["small"].shape == (10, 10)
  assert state.nu["small"].dtype == jnp.float32
  # min_size=0 quantizes every leaf; the padding reads back as nothing
  q = ak.scale_by_adam(mu_dtype=ak.Quantized("8bit", min_size=0)).init(params).mu["small"]
  assert isinstance(q, ak.QuantizedArray) and q.codes.shape == (1, 256)
  x = jnp.arange(4773.0).reshape(37, 129) - 2000.0
  q = _quant.quantize(x, odd.fmt, step=1)
  assert _quant.dequantize(q).shape == (37, 129)
  _assert_stored_as(q, *_np_quantize(np.asarray(x), "8bit", "mu", 256))
  assert int(np.asarray(q.codes)[-1, 4773 - 18 * 256:].min()) == 127  # the padding: code of 0


@pytest.mark.parametrize("chunk", [256, 2048])
@pytest.mark.parametrize("shape", [(24, 128), (3000,), (7, 200), (64,)])
def test_chunked_encoding_equals_one_pass(monkeypatch, chunk, shape):
  """Strided chunks (rows), contiguous chunks with a tail: the stored state is the
  one-pass quantize(m_t) at step t, whatever the chunking (the 4-bit dither's positions
  are the leaf's)."""
  monkeypatch.setattr(_quant_ops, "CHUNK", chunk)
  q = ak.Quantized("4bit", block_size=32, min_size=0)
  tx = ak.scale_by_adam(mu_dtype=q, nu_dtype=ak.Quantized("8bit", block_size=64, min_size=0))
  rng = np.random.default_rng(2)
  g = jnp.asarray(rng.normal(size=shape), jnp.float32)
  state = tx.init({"w": g})
  _, s1 = jax.jit(tx.update)({"w": g}, state)
  _, s2 = jax.jit(tx.update)({"w": g * 2}, s1)
  b1, b2 = jnp.float32(0.9), jnp.float32(0.999)
  m = b1 * _quant.dequantize(s1.mu["w"]) + (1 - b1) * (g * 2)
  v = b2 * _quant.dequantize(s1.nu["w"]) + (1 - b2) * (g * 2) ** 2
  for got, want in ((s2.mu["w"], _quant.quantize(m, s1.mu["w"].fmt, step=2)),
                    (s2.nu["w"], _quant.quantize(v, s1.nu["w"].fmt, step=2))):
    assert got.codes.shape == want.codes.shape
    assert np.mean(np.asarray(got.codes) != np.asarray(want.codes)) <= 2e-3
    np.testing.assert_allclose(got.scales, want.scales, rtol=1e-6)


def _steps(opt, params, grads) -> tuple:
  """The updates of jitted ``opt.update`` over ``grads`` from ``opt.init(params)``, and the
  last state (on the host)."""
  step = jax.jit(lambda s, g: opt.update(g, s, params))
  s, us = opt.init(params), []
  for g in grads:
    u, s = step(s, g)
    us.append(u)
  return us, jax.device_get(s)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_in_place_loop_stores_what_the_fresh_buffer_loop_does(monkeypatch, sharded, dtype):
  """The loops a GPU compiles (new codes and scales written over the old ones, each chunk
  read by the iteration that overwrites it) store the same state, bit for bit, as the
  fresh-buffer loops of the CPU and TPU: 4-bit (dithered), 8-bit and fp8 moments, strided
  rows (16 chunks; sharded over 8 devices) and contiguous chunks with a tail (rows of 200,
  no whole blocks), a bf16 gradient widened chunk by chunk."""
  monkeypatch.setattr(_quant_ops, "CHUNK", 2048)  # 8 rows of 256 a chunk: 16 chunks
  tx = ak.adamw(1e-2, mu_dtype=ak.Quantized("4bit", block_size=64, min_size=0),
                nu_dtype=ak.Quantized("8bit", block_size=128, min_size=0))
  fp8 = ak.adamw(1e-2, mu_dtype=ak.Quantized("fp8", block_size=64, min_size=0))
  rng = np.random.default_rng(11)
  shapes = {"w": (128, 256), "b": (30, 200)}  # "b": two chunks of 2048 and a tail
  params = {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in shapes.items()}
  grads = [{k: jnp.asarray(rng.normal(size=s), dtype) for k, s in shapes.items()}
           for _ in range(3)]
  if sharded:
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("rows",))
    where = {"w": NamedSharding(mesh, P("rows", None)), "b": NamedSharding(mesh, P())}
    params, grads = jax.device_put((params, grads), (where, [where] * 3))

  def run(opt, gpu: bool):
    monkeypatch.setattr(_platform, "on_gpu", (lambda g, o: g()) if gpu else (lambda g, o: o()))
    return _steps(opt, params, grads)

  for opt in (tx, fp8):
    chex.assert_trees_all_equal(run(opt, True), run(opt, False))


@pytest.mark.parametrize("sharded", [False, True])
def test_tpu_gathered_rows_loop_stores_what_the_fresh_buffer_loop_does(monkeypatch, sharded):
  """A matrix whose strided view is no whole TPU tiles (75 rows) takes, in the loop a TPU
  compiles, chunks of 8 rows 10 apart read by a gather and written by a scatter over the
  old codes, the last chunks' rows past the leaf's end dropped: the state and updates of
  the CPU's fresh-buffer loop, 4-bit (dithered by position), 8-bit and fp8 moments, the
  leaf split by columns over 8 devices or not. To float32 rounding: the TPU branch, run on
  this CPU, fuses the decode and the moment rows apart from the CPU's (a last-bit
  difference in a scale, a code at a midpoint)."""
  monkeypatch.setattr(_quant_ops, "CHUNK", 2048)  # 8 rows of 256 a chunk
  rng = np.random.default_rng(12)
  params = {"v": jnp.asarray(rng.normal(size=(75, 256)), jnp.float32)}
  grads = [{"v": jnp.asarray(rng.normal(size=(75, 256)), jnp.float32)} for _ in range(3)]
  if sharded:
    where = {"v": NamedSharding(Mesh(np.array(jax.devices()).reshape(8), ("c",)), P(None, "c"))}
    params, grads = jax.device_put((params, grads), (where, [where] * 3))
  plans = []
  real_plan = _quant_ops._GatheredRows.plan_for.__func__
  monkeypatch.setattr(_quant_ops._GatheredRows, "plan_for", classmethod(
      lambda cls, *a: plans.append(real_plan(cls, *a)) or plans[-1]))
  monkeypatch.setattr(_platform, "on_gpu", lambda a, o: o())

  def run(opt, tpu: bool):
    monkeypatch.setattr(_platform, "on_tpu", (lambda a, o: a()) if tpu else (lambda a, o: o()))
    us, s = _steps(opt, params, grads)
    return [u["v"] for u in us], [x for x in jax.tree.leaves(s, is_leaf=_quant.is_qarray)
                                  if _quant.is_qarray(x)]

  for mu, nu in [("4bit", "8bit"), ("fp8", "fp8")]:
    opt = ak.adamw(1e-2, mu_dtype=ak.Quantized(mu, block_size=64, min_size=0),
                   nu_dtype=ak.Quantized(nu, block_size=128, min_size=0))
    (tpu_u, tpu_q), (cpu_u, cpu_q) = run(opt, True), run(opt, False)
    for a, b in zip(tpu_u, cpu_u):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
    for a, b in zip(tpu_q, cpu_q):
      np.testing.assert_allclose(np.asarray(a.scales), np.asarray(b.scales), rtol=1e-6)
      assert np.mean(np.asarray(a.codes) != np.asarray(b.codes)) <= 1e-3
  assert {p.plan for p in plans if p is not None} == {(8, 10)}  # the TPU loop's plan


# ------------------------------------------------------------------------ bad input


def test_bad_formats_are_named():
  with pytest.raises(ValueError, match="kind"):
    ak.Quantized("3bit")
  with pytest.raises(ValueError, match="block_size"):
    ak.Quantized("8bit", block_size=100)
  with pytest.raises(ValueError, match="block_size"):
    ak.Quantized("8bit", block_size=0)
  with pytest.raises(ValueError, match="block_size"):
    ak.Quantized("8bit", block_size=-64)
  with pytest.raises(ValueError, match="min_size"):
    ak.Quantized("8bit", min_size=-1)
  with pytest.raises(ValueError, match="pad.*True or False"):
    ak.Quantized("8bit", pad="no")
  with pytest.raises(TypeError, match="mu_dtype"):
    ak.adam(1e-3, mu_dtype="9bit")
  with pytest.raises(TypeError, match="nu_dtype"):
    ak.adamw(1e-3, nu_dtype=jnp.int8)


def test_quantized_where_a_float_dtype_is_required():
  with pytest.raises(TypeError, match="accumulator_dtype.*moments only"):
    ak.multi_steps(ak.adam(1e-3), 2, accumulator_dtype="8bit")
  with pytest.raises(TypeError, match="master_dtype.*moments only"):
    ak.master_weights(ak.adam(1e-3), master_dtype=ak.Quantized("4bit"))
  state = ak.scale_by_adam(mu_dtype=ak.Quantized("8bit", min_size=0)).init({"w": jnp.ones(8)})
  with pytest.raises(TypeError, match="params leaf 'w' is a QuantizedArray"):
    ak.adam(1e-3).init({"w": state.mu["w"]})
  with pytest.raises(TypeError, match="floating-point"):
    ak.adam(1e-3, mu_dtype="8bit").init({"w": jnp.ones(8000, jnp.int32)})


def test_complex_params_refuse_a_quantized_format():
  params = {"z": jnp.ones(8, jnp.complex64)}
  with pytest.raises(TypeError, match="'z' is complex.*real values only"):
    ak.adam(1e-3, mu_dtype=ak.Quantized("8bit", min_size=0)).init(params)
  # under min_size too: the float32 moments kept there could not hold a complex moment
  with pytest.raises(TypeError, match="'z' is complex"):
    ak.adam(1e-3, nu_dtype="8bit").init(params)


@pytest.mark.parametrize("other", [ak.Quantized("8bit", block_size=128, min_size=0),
                                   ak.Quantized("4bit", min_size=0), None])
def test_state_of_another_format_is_refused(other):
  params = {"layer": {"w": jnp.ones((4, 256))}}
  mine = ak.Quantized("8bit", min_size=0)
  tx = ak.adam(1e-3, mu_dtype=mine, nu_dtype=mine)
  foreign = ak.adam(1e-3, mu_dtype=other, nu_dtype=other).init(params)
  with pytest.raises(ValueError, match="layer.w.*stored as"):
    tx.update(params, foreign, params)


# -------------------------------------------------------------------- NaN and Inf


def test_nonfinite_gradients_leave_no_nan_scale():
  q = ak.Quantized("8bit", block_size=64, min_size=0)
  params = {"w": jnp.ones((4, 128))}
  g = jnp.ones((4, 128)).at[0, 3].set(jnp.nan).at[2, 70].set(jnp.inf)
  tx = ak.adam(1e-3, mu_dtype=q, nu_dtype=q)
  u, state = jax.jit(tx.update)({"w": g}, tx.init(params), params)
  assert bool(jnp.isnan(u["w"][0, 3]))  # "propagate": the NaN reaches the params, as optax
  for x in jax.tree.leaves(state):
    assert bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))
  tx = ak.adam(1e-3, mu_dtype=q, nu_dtype=q, nonfinite="skip")
  state = tx.init(params)
  _, state = tx.update({"w": jnp.ones((4, 128))}, state, params)
  u, skipped = jax.jit(tx.update)({"w": g}, state, params)
  assert float(jnp.max(jnp.abs(u["w"]))) == 0.0
  chex.assert_trees_all_equal(skipped.inner_state, state.inner_state)


# --------------------------------------------------------------------- checkpoints


def test_state_dict_names_float32_moments_and_loads_back():
  params = {"fc": {"weight": jnp.asarray(np.random.default_rng(3).normal(size=(8, 512)),
                                         jnp.float32)}}
  tx = ak.adamw(1e-3, mu_dtype="8bit", nu_dtype="4bit", amsgrad=True)
  q = ak.adamw(1e-3, mu_dtype=ak.Quantized("8bit", min_size=0),
               nu_dtype=ak.Quantized("4bit", min_size=0), amsgrad=True)
  state = q.init(params)
  _, state = q.update(params, state, params)
  sd = ak.state_dict(state, params)
  assert sorted(k for k in sd if not k.startswith("state.")) == [
      "fc.weight.moment1", "fc.weight.moment2", "fc.weight.moment2_max", "step"]
  assert sd["fc.weight.moment1"].dtype == np.float32 and sd["fc.weight.moment1"].shape == (8, 512)
  # into a float32 state, and from it back into a quantized one by quantizing
  dense_state = ak.load_state_dict(sd, ak.adamw(1e-3, amsgrad=True).init(params))
  assert moments_of(dense_state).mu["fc"]["weight"].dtype == jnp.float32
  again = ak.load_state_dict(ak.state_dict(dense_state), state)
  for field, name in (("mu", "moment1"), ("nu", "moment2"), ("nu_max", "moment2_max")):
    stored = getattr(moments_of(again), field)["fc"]["weight"]
    want = _quant.quantize(jnp.asarray(sd[f"fc.weight.{name}"]), stored.fmt)
    chex.assert_trees_all_equal(stored, want)
    # quantize(dequantize(q)) is q but where a block's largest entry has no code of its
    # own (the signed map has 1 but not -1): then the scale and a few codes move
    same = np.isclose(ak.state_dict(again)[f"fc.weight.{name}"], sd[f"fc.weight.{name}"],
                      rtol=1e-2, atol=0)
    assert same.mean() > 0.95
  assert int(ak.state_dict(again)["step"]) == 1
  # the default min_size: an (8, 512) leaf is quantized too
  assert isinstance(moments_of(tx.init(params)).mu["fc"]["weight"], ak.QuantizedArray)


def test_loading_a_4bit_first_moment_dithers_at_the_state_dicts_step():
  """A float32 moment loaded into a 4-bit state is rounded with the dither of the loaded
  step count (the count it is stored at), the same numbers as the reference's."""
  rng = np.random.default_rng(8)
  params = {"w": jnp.zeros((4, 256))}
  tx = ak.adam(1e-3, mu_dtype=ak.Quantized("4bit", block_size=64, min_size=0))
  m = rng.normal(size=(4, 256)).astype(np.float32)
  sd = dict(ak.state_dict(tx.init(params)), **{"w.moment1": m, "step": np.int32(5)})
  loaded = moments_of(ak.load_state_dict(sd, tx.init(params))).mu["w"]
  want, scales = _np_quantize(m, "4bit", "mu", 64, step=5)
  np.testing.assert_allclose(_np_decode(loaded), want, rtol=1e-6, atol=0)
  np.testing.assert_allclose(np.asarray(loaded.scales).reshape(-1), scales, rtol=1e-6)
  other, _ = _np_quantize(m, "4bit", "mu", 64, step=6)
  assert not np.allclose(_np_decode(loaded), other)  # the step matters


def test_framework_states_fill_a_quantized_state():
  params = {"linear_0.w_0": jnp.zeros((4, 256))}
  rng = np.random.default_rng(4)
  m, v = rng.normal(size=(4, 256)).astype(np.float32), rng.random((4, 256)).astype(np.float32)
  q = ak.Quantized("8bit", min_size=0)
  tx = ak.adamw(1e-3, eps_mode="corrected", weight_decay_mask=None, mu_dtype=q, nu_dtype=q)
  state = ak.from_paddle_state({"linear_0.w_0_moment1_0": m, "linear_0.w_0_moment2_0": v},
                               params, tx, step=3)
  sd = ak.state_dict(state)
  np.testing.assert_allclose(sd["linear_0.w_0.moment1"], _np_quantize(m, "8bit", "mu", 256)[0],
                             rtol=1e-6)
  np.testing.assert_allclose(sd["linear_0.w_0.moment2"], _np_quantize(v, "8bit", "nu", 256)[0],
                             rtol=1e-6)
  assert int(sd["step"]) == 3
  ms = ak.from_mindspore_state({"moment1.linear_0.w_0": m, "moment2.linear_0.w_0": v},
                               params, tx, step=3)
  chex.assert_trees_all_equal(ms, state)


# ------------------------------------------------------------------------ sharding


@pytest.mark.parametrize("spec", [P("rows", None), P(None, "cols"), P("rows", "cols")])
@pytest.mark.parametrize("mu_kind", ["8bit", "4bit"])
@pytest.mark.parametrize("form", ["chain", "fused"])
def test_sharded_param_keeps_codes_and_scales_sharded(monkeypatch, spec, mu_kind, form):
  """Codes and scales are split as the param; the step (several strided chunks; the
  fused step's XLA loop, per-leaf moments, steps them in place) runs shard by shard: no
  collective in the compiled step, the same numbers as one device (the 4-bit first
  moment's dither included: its positions are global)."""
  monkeypatch.setattr(_quant_ops, "CHUNK", 2048)  # 8 rows of 256 a chunk: 16 chunks
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("rows", "cols"))
  sharding = NamedSharding(mesh, spec)
  q = ak.Quantized(mu_kind, block_size=64, min_size=0)
  nu = ak.Quantized("4bit", block_size=64, min_size=0)
  rng = np.random.default_rng(5)
  params = {"w": jnp.asarray(rng.normal(size=(128, 256)), jnp.float32)}
  grads = {"w": jnp.asarray(rng.normal(size=(128, 256)), jnp.float32)}
  sharded = jax.device_put(params, sharding)
  if form == "chain":
    tx = ak.adamw(1e-2, mu_dtype=q, nu_dtype=nu)

    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
  else:
    tx = ak.fused_adamw(1e-2, mu_dtype=q, nu_dtype=nu, multi_tensor=False)

    def step(p, s, g):
      return tx.step(p, s, grads=g)
  state = tx.init(sharded)
  mu = moments_of(state).mu["w"]
  assert mu.codes.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec, None, None)), 3)
  assert mu.scales.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec, None)), 3)

  compiled = jax.jit(step).lower(sharded, state, jax.device_put(grads, sharding)).compile()
  hlo = compiled.as_text()
  for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
    assert op not in hlo, op
  p, s = sharded, state
  ref_p, ref_s = params, tx.init(params)
  for _ in range(2):
    p, s = compiled(p, s, jax.device_put(grads, sharding))
    ref_p, ref_s = jax.jit(step)(ref_p, ref_s, grads)
  np.testing.assert_allclose(p["w"], ref_p["w"], rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_equal(jax.device_get(s), jax.device_get(ref_s))
  new_mu = moments_of(s).mu["w"]
  assert new_mu.codes.sharding.is_equivalent_to(mu.codes.sharding, 3)
