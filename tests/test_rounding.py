"""ak.stochastic_round and ak.param_rounding: bf16/fp16 params without a float32 master copy.

References are independent: JAX's own Threefry primitive for the random bits, a NumPy
float64 rounding that looks each value's neighbours up in the table of every value of the
format, and NumPy float32 loops for the update rules.
"""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.extend.random import threefry2x32_p
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import adamkit as ak
from adamkit import _rounding

NP = {jnp.bfloat16: ml_dtypes.bfloat16, jnp.float16: np.float16}
DTYPES = [jnp.bfloat16, jnp.float16]
METHODS = ("nearest", "stochastic", "kahan")


# ------------------------------------------------------------------ references


def all_magnitudes(dtype) -> np.ndarray:
  """Every finite non-negative value of a 16-bit format, sorted, as float64."""
  bits = np.arange(0, 2**15, dtype=np.uint16)  # sign bit clear
  with np.errstate(invalid="ignore"):
    values = bits.view(NP[dtype]).astype(np.float64)
  return np.sort(values[np.isfinite(values)])


def reference_round(x, dtype, u):
  """Stochastic rounding in float64 from the table of the format's values: the neighbours
  lo <= |x| < hi, round up when u < (|x| - lo) / (hi - lo)."""
  x = np.asarray(x, np.float64)
  table = all_magnitudes(dtype)
  a = np.abs(x)
  out = np.empty_like(x)
  for i, (ai, ui) in enumerate(zip(a.ravel(), np.asarray(u).ravel())):
    if not np.isfinite(ai) or ai > table[-1]:
      with np.errstate(over="ignore"):
        out.flat[i] = np.float64(NP[dtype](ai))  # as astype
      continue
    k = np.searchsorted(table, ai, side="right") - 1
    lo = table[k]
    if lo == ai:
      out.flat[i] = ai
      continue
    hi = table[k + 1]
    out.flat[i] = hi if ui < (ai - lo) / (hi - lo) else lo
  return np.where(np.signbit(x), -out, out).astype(NP[dtype])


def jax_threefry(k0, k1, c0, c1):
  """JAX's own Threefry-2x32 primitive (the reference for adamkit's written-out one)."""
  c0, c1 = np.broadcast_arrays(np.asarray(c0, np.uint32), np.asarray(c1, np.uint32))
  k0 = np.full(c0.shape, k0, np.uint32)
  k1 = np.full(c0.shape, k1, np.uint32)
  return [np.asarray(y) for y in threefry2x32_p.bind(*map(jnp.asarray, (k0, k1, c0, c1)))]


def positions(shape):
  """(index along axis 0, row-major index within the other axes), in NumPy."""
  if not shape:
    return np.uint32(0), np.uint32(0)
  idx = np.arange(int(np.prod(shape))).reshape(shape)
  rest = int(np.prod(shape[1:]))
  return (idx // rest).astype(np.uint32), (idx % rest).astype(np.uint32)


def uniforms(words, shape):
  bits = jax_threefry(words[0], words[1], *positions(shape))[0]
  return (bits >> 8).astype(np.float64) * 2.0**-24


def key_words(key):
  return np.asarray(jax.random.key_data(key), np.uint32)


# ------------------------------------------------------------------ the primitive


def test_threefry_matches_jax_and_the_known_answer():
  assert [hex(int(y)) for y in _rounding.threefry2x32(*[jnp.uint32(0)] * 4)] == [
      "0x6b200159", "0x99ba4efe"]  # Salmon et al.'s known-answer test, key 0 counter 0
  rng = np.random.default_rng(0)
  k0, k1 = rng.integers(0, 2**32, 2, dtype=np.uint32)
  c0, c1 = rng.integers(0, 2**32, (2, 1000), dtype=np.uint32)
  ours = _rounding.threefry2x32(jnp.uint32(k0), jnp.uint32(k1), jnp.asarray(c0), jnp.asarray(c1))
  for a, b in zip(ours, jax_threefry(k0, k1, c0, c1)):
    np.testing.assert_array_equal(np.asarray(a), b)


def special_values(dtype):
  """Zeros, exact values, ties, subnormals, overflow, infinities. bfloat16's subnormals are
  float32's, which XLA flushes to zero on CPU: left out for bfloat16."""
  info = jnp.finfo(dtype)
  tiny, eps, big = float(info.smallest_subnormal), float(info.eps), float(info.max)
  subnormals = [tiny * 0.3, tiny * 1.5, -tiny * 2.7] if dtype == jnp.float16 else []
  return np.array([0.0, -0.0, 1.0, -1.0, 1.0 + eps / 3, -(1.0 + eps / 3), 1.0 + eps / 2,
                   *subnormals, big, big * 1.001, -big * 1.001, np.inf, -np.inf, 65519.0,
                   65521.0], np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (7,), (5, 3, 4)])
def test_matches_the_float64_table_reference(dtype, shape):
  rng = np.random.default_rng(1)
  n = int(np.prod(shape))
  scale = 10.0 ** rng.uniform(-9, 4, n)  # normals and fp16 subnormals
  x = (rng.standard_normal(n) * scale).astype(np.float32)
  specials = special_values(dtype)
  x[:min(n, len(specials))] = specials[:min(n, len(specials))]
  x = x.reshape(shape)
  key = jax.random.key(7)
  got = np.asarray(ak.stochastic_round(jnp.asarray(x), dtype, key))
  want = reference_round(x, dtype, uniforms(key_words(key), shape))
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))  # bits, signed 0


def test_nan_stays_nan():
  x = jnp.array([jnp.nan, 1.0], jnp.float32)
  y = ak.stochastic_round(x, jnp.bfloat16, jax.random.key(0))
  assert bool(jnp.isnan(y[0])) and float(y[1]) == 1.0


@pytest.mark.parametrize("dtype,value", [
    (jnp.bfloat16, 1.0 + 0.3 * 2**-7), (jnp.bfloat16, -3.7e-3), (jnp.bfloat16, 1234.5678),
    (jnp.float16, 1.0 + 0.71 * 2**-10), (jnp.float16, -0.01234), (jnp.float16, 1.3e-6),
])
def test_unbiased_mean_of_2_20_roundings(dtype, value):
  n = 2**20
  x = np.float32(value)
  y = np.asarray(ak.stochastic_round(jnp.full((n,), x), dtype, jax.random.key(3)), np.float64)
  values = np.unique(y)
  assert len(values) == 2  # the two neighbours, nothing else
  lo, hi = values
  p = (abs(float(x)) - abs(lo if x > 0 else hi)) / (hi - lo)
  se = (hi - lo) * np.sqrt(p * (1 - p) / n)
  assert abs(y.mean() - float(x)) < 4 * se, (y.mean(), float(x), se)
  # round to nearest is biased by far more than that
  assert abs(float(np.float64(NP[dtype](x))) - float(x)) > 40 * se


def test_deterministic_per_key_and_jittable():
  x = jnp.linspace(-1.0, 1.0, 1001, dtype=jnp.float32) * 1.2345
  k = jax.random.key(5)
  a = ak.stochastic_round(x, jnp.bfloat16, k)
  b = jax.jit(ak.stochastic_round, static_argnums=1)(x, jnp.bfloat16, k)
  c = ak.stochastic_round(x, jnp.bfloat16, jax.random.PRNGKey(5))  # raw key, same data
  d = ak.stochastic_round(x, jnp.bfloat16, jax.random.key(6))
  chex.assert_trees_all_equal(a, b, c)
  assert not np.array_equal(np.asarray(a), np.asarray(d))


@pytest.mark.parametrize("spec", [P("a", "b"), P(None, ("a", "b")), P("b"), P()])
def test_same_numbers_whatever_the_sharding(spec):
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
  x = jax.random.normal(jax.random.key(0), (16, 24), jnp.float32) * 0.37
  key = jax.random.key(11)
  want = ak.stochastic_round(x, jnp.bfloat16, key)
  sharding = NamedSharding(mesh, spec)
  got = jax.jit(ak.stochastic_round, static_argnums=1)(jax.device_put(x, sharding),
                                                      jnp.bfloat16, key)
  assert got.sharding.is_equivalent_to(sharding, 2)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_primitive_bad_input():
  x = jnp.ones(3)
  with pytest.raises(ValueError, match="`dtype` must be jnp.bfloat16 or jnp.float16"):
    ak.stochastic_round(x, jnp.float32, jax.random.key(0))
  with pytest.raises(TypeError, match="`dtype`"):
    ak.stochastic_round(x, jnp.int8, jax.random.key(0))
  with pytest.raises(TypeError, match="`x` must be a floating-point array"):
    ak.stochastic_round(jnp.ones(3, jnp.int32), jnp.bfloat16, jax.random.key(0))
  with pytest.raises(TypeError, match="`key` must be a JAX key"):
    ak.stochastic_round(x, jnp.bfloat16, 0)
  with pytest.raises(ValueError, match="`key` must be one key"):
    ak.stochastic_round(x, jnp.bfloat16, jax.random.split(jax.random.key(0)))


# ------------------------------------------------- the difference of nearby values


@pytest.mark.parametrize("dtype", DTYPES)
def test_difference_of_nearby_values_is_exact(dtype):
  """Sterbenz: for a, b of one format with b/2 <= a <= 2b, b - a is exact in the format, so
  optax.apply_updates(a, b - a) writes b exactly."""
  rng = np.random.default_rng(2)
  n = 200_000
  info = jnp.finfo(dtype)
  # float16's whole range (its subnormals are float32 normals); bfloat16 from 2**-116, so
  # that a difference of one unit stays a float32 normal (XLA flushes subnormals on CPU)
  lowest = np.log2(float(info.smallest_subnormal)) if dtype == jnp.float16 else -116.0
  exps = rng.uniform(lowest, np.log2(float(info.max)) - 1, n)
  a = (np.sign(rng.standard_normal(n)) * 2.0**exps).astype(NP[dtype])
  ratio = np.where(rng.random(n) < 0.3,  # a third one or a few units apart, the rest anywhere
                   1.0 + rng.integers(-4, 5, n) * float(info.eps),
                   rng.uniform(0.5, 2.0, n))
  b = (a.astype(np.float64) * ratio).astype(NP[dtype])
  af, bf = a.astype(np.float64), b.astype(np.float64)
  keep = (np.abs(bf) <= 2 * np.abs(af)) & (np.abs(af) <= 2 * np.abs(bf)) & np.isfinite(bf)
  a, b, af, bf = a[keep], b[keep], af[keep], bf[keep]
  assert len(a) > 0.9 * n
  a_j, b_j = jnp.asarray(a), jnp.asarray(b)
  delta = jax.jit(lambda a, b: (b.astype(jnp.float32) - a.astype(jnp.float32)).astype(a.dtype))(
      a_j, b_j)
  np.testing.assert_array_equal(np.asarray(delta).astype(np.float64), bf - af)  # exact
  for apply in (optax.apply_updates, ak.apply_updates, jax.jit(optax.apply_updates)):
    np.testing.assert_array_equal(np.asarray(apply({"w": a_j}, {"w": delta})["w"]), b)


# ------------------------------------------------------------------ the wrapper


def make_params(dtype=jnp.bfloat16):
  k = jax.random.split(jax.random.key(0), 3)
  return {"w": jax.random.normal(k[0], (8, 6), jnp.float32).astype(dtype),
          "b": (0.01 * jax.random.normal(k[1], (6,), jnp.float32)).astype(dtype),
          "f32": jax.random.normal(k[2], (3,), jnp.float32),
          "none": None}


def grads_at(params, t):
  return jax.tree.map(lambda p: (jnp.sin(3.0 * p.astype(jnp.float32) + 0.5 * t)
                                 + 0.1).astype(p.dtype), params)


def run(tx, params, steps, jit=True):
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  for t in range(steps):
    u, state = update(grads_at(params, t), state, params)
    params = optax.apply_updates(params, u)
  return params, state


def np32(x):
  return np.asarray(x, np.float32) if x.dtype != jnp.bfloat16 else np.asarray(
      x.astype(jnp.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_trajectory_matches_the_numpy_rule(method, dtype):
  """Each step: the inner AdamW on the float32 view gives u; NumPy float32 applies the
  method's rule; the wrapped run must write the same bits."""
  lr, seed = 3e-3, 123
  params = make_params(dtype)
  tx = ak.param_rounding(ak.adamw(lr, weight_decay=0.1), method, seed=seed)
  inner = ak.adamw(lr, weight_decay=0.1)
  state = tx.init(params)
  p = params
  view = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
  ref_state = inner.init(view(params))
  ref = {k: np32(v) for k, v in params.items() if v is not None}
  comp = {k: np.zeros_like(v) for k, v in ref.items()}
  low = {k: params[k].dtype != jnp.float32 for k in ref}
  leaf_index = {k: i for i, k in enumerate(["b", "f32", "w"])}  # jax.tree.leaves order
  crossings = 0
  for t in range(4):
    g = grads_at(p, t)
    u, state = tx.update(g, state, p)
    p = optax.apply_updates(p, u)
    ref_p = {k: jnp.asarray(v).astype(params[k].dtype) for k, v in ref.items()}
    ref_p["none"] = None
    u_ref, ref_state = inner.update(view(g), ref_state, view(ref_p))
    for k in ref:
      ui = np32(u_ref[k])
      if not low[k]:
        ref[k] = np32(ref_p[k] + u_ref[k])
        continue
      npd = NP[dtype]
      s_ = ref[k] + (ui + comp[k]) if method == "kahan" else ref[k] + ui
      if method == "stochastic":
        words = jax_threefry(0, seed, t, leaf_index[k])
        target = reference_round(s_, dtype, uniforms([w[()] for w in words], s_.shape))
      else:
        target = s_.astype(npd)
      target = target.astype(np.float32)
      # the update is target - w in the param's dtype; apply_updates adds it and rounds
      delta = (target - ref[k]).astype(npd).astype(np.float32)
      written = (ref[k] + delta).astype(npd).astype(np.float32)
      # exact whenever the new value is within a factor of two of the old (Sterbenz);
      # otherwise (a weight crossing zero) within one rounding
      off = written != target
      sterbenz = (np.abs(target) <= 2 * np.abs(ref[k])) & (np.abs(ref[k]) <= 2 * np.abs(target))
      assert not np.any(off & sterbenz)
      crossings += int(np.sum(off))
      if method == "kahan":
        comp[k] = (s_ - written).astype(npd).astype(np.float32)
      ref[k] = written
    for k in ref:
      np.testing.assert_array_equal(np32(p[k]), ref[k], err_msg=f"{method} step {t} leaf {k}")
    if method == "kahan":
      for k in ("w", "b"):
        np.testing.assert_array_equal(np32(state.compensation[k]), comp[k])
  assert p["none"] is None
  assert crossings <= 2  # rare: the comparison is of the rules, not of that corner


def test_kahan_and_stochastic_keep_updates_that_nearest_drops():
  """1e-3 steps on params near 1: under half a bf16 unit (2**-8), so round to nearest never
  moves; Kahan ends within a buffer rounding of the float32 run, stochastic close to it."""
  params = {"w": jnp.full((4096,), 1.0, jnp.bfloat16)}
  g = {"w": jnp.full((4096,), 1.0, jnp.bfloat16)}
  out = {}
  for method in METHODS:
    tx = ak.param_rounding(optax.sgd(1e-3), method)
    p, state = params, tx.init(params)
    step = jax.jit(tx.update)
    for _ in range(50):
      u, state = step(g, state, p)
      p = optax.apply_updates(p, u)
    out[method] = np.asarray(p["w"].astype(jnp.float32), np.float64)
  assert np.all(out["nearest"] == 1.0)
  assert np.all(np.abs(out["kahan"] - 0.95) <= 2**-8)  # within one bf16 unit of 1 - 50e-3
  assert abs(out["stochastic"].mean() - 0.95) < 1e-3
  assert len(np.unique(out["stochastic"])) > 1  # random, not a constant offset


def test_inner_sees_float32_and_float32_leaves_pass_through():
  seen = []

  def init(params):
    seen.append(("init", jax.tree.map(lambda x: x.dtype, params)))
    return optax.EmptyState()

  def update(updates, state, params):
    seen.append(("update", jax.tree.map(lambda x: x.dtype, (updates, params))))
    return jax.tree.map(lambda g: -0.37 * g, updates), state

  spy = optax.GradientTransformation(init, update)
  params = make_params()
  for method in METHODS:
    seen.clear()
    tx = ak.param_rounding(spy, method)
    g = grads_at(params, 0)
    u, _ = tx.update(g, tx.init(params), params)
    assert {d for _, tree in seen for d in jax.tree.leaves(tree)} == {jnp.dtype(jnp.float32)}
    # the float32 leaf's update is the inner's, untouched (the same bits)
    np.testing.assert_array_equal(np.asarray(u["f32"]), np.asarray(-0.37 * g["f32"]))
    chex.assert_trees_all_equal_shapes_and_dtypes(u, params)
  # Adam's moments are float32: the inner state is built on the float32 view
  state = ak.param_rounding(ak.adam(1e-3), "kahan").init(params)
  assert {x.dtype for x in jax.tree.leaves(optax.tree_utils.tree_get(state, "mu"))} == {
      jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("kind", ["8bit", "4bit", "fp8"])
def test_quantized_inner_moments_read_the_narrow_gradient_chunk_by_chunk(monkeypatch, kind):
  """Over quantized moments, the inner step's loop that stores the new codes reads each
  bf16 gradient leaf itself, chunk by chunk, instead of the float32 copy param_rounding
  hands the inner step (a whole-leaf float32 buffer on a GPU): the same updates and state,
  bit for bit, jitted, for a strided matrix, a leaf of contiguous chunks and a float32
  leaf beside them."""
  from adamkit import _quant_ops
  monkeypatch.setattr(_quant_ops, "_on_kernel", lambda *a: False)  # the loop on a CPU too
  rng = np.random.default_rng(5)
  shapes = {"w": (128, 512), "v": (3000,), "f": (64, 256)}
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32 if k == "f" else jnp.bfloat16)
            for k, s in shapes.items()}
  grads = [{k: jnp.asarray(rng.normal(size=s), p.dtype) for (k, s), p in
            zip(shapes.items(), params.values())} for _ in range(3)]
  q = ak.Quantized(kind, min_size=0)
  tx = ak.param_rounding(ak.adamw(1e-2, mu_dtype=q, nu_dtype=q), "stochastic")
  seen = []
  requantize = _quant_ops._requantize
  monkeypatch.setattr(_quant_ops, "_requantize", lambda m, g, *a: (
      seen.append(g.dtype), requantize(m, g, *a))[1])

  def run():
    step = jax.jit(lambda s, g: tx.update(g, s, params))
    s, us = tx.init(params), []
    for g in grads:
      u, s = step(s, g)
      us.append(u)
    return us, s

  narrow = run()
  assert sorted(map(str, seen)) == ["bfloat16", "bfloat16", "float32"]
  seen.clear()
  monkeypatch.setattr(_quant_ops, "_narrow_of", lambda g: g)
  wide = run()
  assert sorted(map(str, seen)) == ["float32"] * 3
  chex.assert_trees_all_equal(narrow, wide)


@pytest.mark.parametrize("method", METHODS)
def test_state_layout(method):
  params = make_params()
  tx = ak.param_rounding(ak.adamw(1e-3), method, seed=jax.random.key(9))
  state0 = tx.init(params)
  p, state = run(tx, params, 2)
  chex.assert_trees_all_equal_shapes_and_dtypes(state0, state)
  chex.assert_trees_all_equal_shapes_and_dtypes(p, params)
  assert type(state).__name__ == {"nearest": "NearestRoundingState",
                                  "stochastic": "StochasticRoundingState",
                                  "kahan": "KahanState"}[method]
  if method == "kahan":  # a buffer in the params' dtype; none for the float32 leaf
    c = state.compensation
    assert (c["w"].dtype, c["b"].dtype, c["f32"], c["none"]) == (jnp.bfloat16, jnp.bfloat16,
                                                                 None, None)
    assert float(jnp.max(jnp.abs(c["w"].astype(jnp.float32)))) > 0
  if method == "stochastic":  # the key's data and a step count
    np.testing.assert_array_equal(np.stack(state.key), key_words(jax.random.key(9)))
    assert {k.dtype for k in state.key} == {jnp.dtype(jnp.uint32)} and int(state.step) == 2


def test_seed_forms_give_the_same_bits():
  params = make_params()
  runs = [run(ak.param_rounding(ak.adamw(1e-2), "stochastic", seed=s), params, 2)[0]
          for s in (4, jax.random.key(4), jax.random.PRNGKey(4), np.int64(4))]
  chex.assert_trees_all_equal(*runs)
  other = run(ak.param_rounding(ak.adamw(1e-2), "stochastic", seed=5), params, 2)[0]
  assert not np.array_equal(np32(other["w"]), np32(runs[0]["w"]))


def test_float32_params_with_kahan_are_a_documented_no_op():
  params = make_params(jnp.float32)
  tx = ak.param_rounding(ak.adamw(1e-2), "kahan")
  state = tx.init(params)
  assert all(c is None for c in jax.tree.leaves(state.compensation, is_leaf=lambda x: x is None))
  p, _ = run(tx, params, 3)
  q, _ = run(ak.adamw(1e-2), params, 3)
  chex.assert_trees_all_equal(p, q)


def test_bad_input():
  params = make_params()
  with pytest.raises(ValueError, match="`method` must be one of"):
    ak.param_rounding(ak.adam(1e-3), "round_up")
  for seed in (1.5, "0", True, None, jnp.ones(2)):
    with pytest.raises(TypeError, match="`seed` must be an int"):
      ak.param_rounding(ak.adam(1e-3), "stochastic", seed=seed)
  with pytest.raises(ValueError, match=r"`seed` must be an int in \[0, 2\*\*64\)"):
    ak.param_rounding(ak.adam(1e-3), "stochastic", seed=-1)
  with pytest.raises(ValueError, match="`seed` must be one key"):
    ak.param_rounding(ak.adam(1e-3), "stochastic", seed=jax.random.split(jax.random.key(0)))
  with pytest.raises(TypeError, match="`tx` must be an optax GradientTransformation"):
    ak.param_rounding(ak.adam, "kahan")
  with pytest.raises(TypeError, match="leaf 'steps' has dtype int32"):
    ak.param_rounding(ak.adam(1e-3), "kahan").init({"w": jnp.ones(2, jnp.bfloat16),
                                                    "steps": jnp.zeros(2, jnp.int32)})
  with pytest.raises(TypeError, match="rounds bfloat16 and float16 params; params leaf 'w8'"):
    ak.param_rounding(ak.adam(1e-3), "nearest").init({"w8": jnp.ones(2, jnp.float8_e4m3fn)})
  g = grads_at(params, 0)
  stochastic = ak.param_rounding(ak.adam(1e-3), "stochastic")
  kahan = ak.param_rounding(ak.adam(1e-3), "kahan")
  with pytest.raises(TypeError, match=r"method='kahan'.*got a state from "
                     r"param_rounding\(method='stochastic'\) as `state`"):
    kahan.update(g, stochastic.init(params), params)
  with pytest.raises(TypeError, match="takes the StochasticRoundingState .* got a ScaleByAdamState"):
    stochastic.update(g, ak.scale_by_adam().init(params), params)
  with pytest.raises(ValueError, match="needs `params`"):
    kahan.update(g, kahan.init(params))


# ------------------------------------------------------------------ composition, bf16


@pytest.mark.parametrize("method", ["stochastic", "kahan"])
def test_sharded_run_is_bit_identical_and_buffer_follows_param(method):
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
  params = make_params()
  specs = {"w": P("a", "b"), "b": P("b"), "f32": P(), "none": None}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda x: isinstance(x, P))
  sharded = jax.device_put(params, shardings)
  tx = ak.param_rounding(ak.adamw(1e-2, weight_decay=0.1), method, seed=3)
  state = tx.init(sharded)
  if method == "kahan":
    for k in ("w", "b"):
      assert state.compensation[k].sharding.is_equivalent_to(shardings[k], 2 if k == "w" else 1)

  def make_step():
    @jax.jit
    def step(p, s, t):
      u, s = tx.update(grads_at(p, t), s, p)
      return optax.apply_updates(p, u), s
    return step

  def run_steps(p, s):
    step = make_step()
    for t in range(3):
      p, s = step(p, s, jnp.float32(t))
    assert step._cache_size() == 1
    return p, s

  p, s = run_steps(sharded, state)
  ref_p, ref_s = run_steps(params, tx.init(params))
  chex.assert_trees_all_equal(p, ref_p)
  chex.assert_trees_all_equal(s, ref_s)
  assert p["w"].sharding.is_equivalent_to(shardings["w"], 2)
  if method == "kahan":
    assert s.compensation["w"].sharding.is_equivalent_to(shardings["w"], 2)


@pytest.mark.parametrize("method", ["stochastic", "kahan"])
def test_multisteps_of_two_equal_grads_is_one_step(method):
  params = make_params()
  g = grads_at(params, 0)
  tx = ak.param_rounding(ak.adamw(1e-2), method)
  u, want_state = tx.update(g, tx.init(params), params)
  want = optax.apply_updates(params, u)
  for ms in (optax.MultiSteps(tx, 2), ak.multi_steps(tx, 2)):
    state, p = ms.init(params), params
    for _ in range(2):
      with jax.numpy_dtype_promotion("standard"):  # optax.MultiSteps mixes int and float
        u, state = jax.jit(ms.update)(g, state, p)
      p = optax.apply_updates(p, u)
    chex.assert_trees_all_equal(p, want)
    chex.assert_trees_all_equal(state.inner_opt_state, want_state)


def _offload_supported():
  from adamkit import _offload
  devices = jax.devices()
  return "pinned_host" in {m.kind for m in devices[0].addressable_memories()} and all(
      _offload._probe(devices[0].platform, m) is None for m in ("compute", "state"))


@pytest.mark.skipif(not _offload_supported(), reason="ak.offload unsupported here")
@pytest.mark.parametrize("mode", ["state", "compute"])
@pytest.mark.parametrize("method", ["stochastic", "kahan"])
def test_offload_keeps_the_buffer_on_the_host_like_a_moment(method, mode):
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
  specs = {"w": P("a", "b"), "b": P("b"), "f32": P(), "none": None}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda x: isinstance(x, P))
  params = jax.device_put(make_params(), shardings)
  plain = ak.param_rounding(ak.adamw(1e-2, weight_decay=0.1), method, seed=1)
  tx = ak.offload(plain, mode=mode)
  state = tx.init(params)

  def where(s):
    return {jax.tree_util.keystr(path): (x.sharding.memory_kind, x.ndim)
            for path, x in jax.tree_util.tree_flatten_with_path(s)[0]}

  for name, (kind, ndim) in where(state).items():
    assert kind == ("device" if ndim == 0 else "pinned_host"), name  # scalars: the step, key
  if method == "kahan":
    c = state.compensation["w"]
    assert c.dtype == jnp.bfloat16 and c.sharding.memory_kind == "pinned_host"
    assert c.sharding.with_memory_kind("device").is_equivalent_to(shardings["w"], 2)

  def make_step(tx):
    @jax.jit
    def step(p, s, t):
      u, s = tx.update(grads_at(p, t), s, p)
      return optax.apply_updates(p, u), s
    return step

  p, s = params, state
  q, r = params, plain.init(params)
  step, ref_step = make_step(tx), make_step(plain)
  for t in range(3):
    p, s = step(p, s, jnp.float32(t))
    q, r = ref_step(q, r, jnp.float32(t))
  assert where(s) == where(state)
  chex.assert_trees_all_equal(p, q)  # the maths is the wrapper's, unchanged
  chex.assert_trees_all_equal(jax.device_put(s, jax.tree.map(lambda x: x.sharding.with_memory_kind(
      "device"), s)), r)


nnx = pytest.importorskip("flax.nnx")


@pytest.mark.parametrize("method", ["stochastic", "kahan"])
def test_nnx_optimizer_with_bf16_params(method):
  def model():
    return nnx.Linear(5, 3, param_dtype=jnp.bfloat16, dtype=jnp.float32, rngs=nnx.Rngs(0))

  x = jnp.linspace(-1.0, 1.0, 20, dtype=jnp.float32).reshape(4, 5)

  def loss(m):
    return jnp.mean((m(x) - 1.0) ** 2)

  tx = lambda: ak.param_rounding(ak.adamw(1e-2), method, seed=2)  # noqa: E731
  m = model()
  opt = nnx.Optimizer(m, tx(), wrt=nnx.Param)

  @nnx.jit
  def step(m, opt):
    opt.update(m, nnx.grad(loss)(m))

  for _ in range(3):
    step(m, opt)
  graphdef, params = nnx.split(model(), nnx.Param)
  p = nnx.to_pure_dict(params)
  assert {x.dtype for x in jax.tree.leaves(p)} == {jnp.dtype(jnp.bfloat16)}

  def pure_loss(p):
    return loss(nnx.merge(graphdef, nnx.State(p)))

  t, state = tx(), None
  state = t.init(p)
  for _ in range(3):
    u, state = jax.jit(t.update)(jax.grad(pure_loss)(p), state, p)
    p = optax.apply_updates(p, u)
  got = nnx.to_pure_dict(nnx.state(m, nnx.Param))
  chex.assert_trees_all_equal(got, p)
  assert not np.array_equal(np32(got["kernel"]), np32(nnx.to_pure_dict(params)["kernel"]))


@pytest.mark.parametrize("method", METHODS)
def test_row_sparse_update_of_a_bf16_table(method):
  """A lazy sparse step's RowSparse update is applied to the whole table: untouched rows
  keep their bits, touched rows move as the dense rule says."""
  table = (jnp.linspace(-1.0, 1.0, 40, dtype=jnp.float32).reshape(10, 4)).astype(jnp.bfloat16)
  params = {"emb": table}
  ids = jnp.array([1, 7, 1])
  values = jnp.linspace(0.5, 2.0, 12, dtype=jnp.float32).reshape(3, 4).astype(jnp.bfloat16)
  grads = {"emb": ak.RowSparse(ids, values, 10)}
  tx = ak.param_rounding(ak.sparse_adam(0.05), method)
  u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert not isinstance(u["emb"], ak.RowSparse) and u["emb"].dtype == jnp.bfloat16
  new = ak.apply_updates(params, u)["emb"]
  untouched = np.setdiff1d(np.arange(10), [1, 7])
  np.testing.assert_array_equal(np32(new)[untouched], np32(table)[untouched])
  # the inner lazy step on the float32 view, rounded by the dense rule
  inner = ak.sparse_adam(0.05)
  view = {"emb": table.astype(jnp.float32)}
  g32 = {"emb": ak.RowSparse(ids, values.astype(jnp.float32), 10)}
  ui, _ = inner.update(g32, inner.init(view), view)
  target = np32(table) + np.asarray(ui["emb"].todense())
  rows = [1, 7]
  if method == "stochastic":  # one of the two neighbours (the reference with u = 0 or 1)
    t = target[rows]
    up = reference_round(t, jnp.bfloat16, np.zeros(t.shape)).astype(np.float32)
    down = reference_round(t, jnp.bfloat16, np.ones(t.shape)).astype(np.float32)
    got = np32(new)[rows]
    assert np.all((got == up) | (got == down)) and np.any(up != down)
  else:  # nearest; kahan starts from a zero buffer
    np.testing.assert_array_equal(np32(new)[rows],
                                  target[rows].astype(ml_dtypes.bfloat16).astype(np.float32))
