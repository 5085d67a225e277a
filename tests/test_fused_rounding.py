"""The fused steps with ``param_rounding=``: bf16/fp16 params rounded in the step's own pass.

References: ``ak.param_rounding`` around the same fused transform, applied with
``optax.apply_updates`` (itself checked against NumPy rules in tests/test_rounding.py),
bit for bit on XLA; and the XLA step for the C++ kernel, bit for bit where the float32
step is exact in its products (XLA may contract a multiply and an add into one FMA, the
kernel never does, so elsewhere the two sums can differ in their last float32 bit).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import adamkit as ak
from adamkit import _backend

METHODS = ("nearest", "stochastic", "kahan")
NAMED = {"adam": ak.fused_adam, "adamw": ak.fused_adamw, "adamax": ak.fused_adamax}
TARGET = "adamkit_cpu_step_rounded"


def make_params(dtype=jnp.bfloat16, seed=0, big=False):
  """Low-precision leaves, a float32 leaf (passes straight through) and a None leaf."""
  rng = np.random.default_rng(seed)
  shapes = {"w": (300, 7), "b": (20,), "s": ()}
  if big:  # past the kernel's threshold for splitting over the thread pool
    shapes["emb"] = (700, 300)
  params = {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}
  params["f32"] = jnp.asarray(rng.standard_normal(5), jnp.float32)
  params["none"] = None
  return params


def grads_at(params, t, dtype=None, dyadic=False):
  """Gradients of each leaf's dtype (or, for the low-precision leaves, ``dtype``);
  ``dyadic``: multiples of 1/16 in [-1, 1), whose squares and moment updates are exact in
  float32."""
  rng = np.random.default_rng(100 + t)

  def one(p):
    x = rng.integers(-16, 16, p.shape) / 16 if dyadic else rng.standard_normal(p.shape)
    return jnp.asarray(x, dtype if dtype and p.dtype != jnp.float32 else p.dtype)

  return jax.tree.map(one, params)


def seeded(method, seed=7):
  return {"seed": seed} if method == "stochastic" else {}


def run_step(opt, params, steps, donate=False, **grad_kw):
  step = jax.jit(opt.step, donate_argnums=(0, 1) if donate else ())
  state = opt.init(params)
  p = jax.tree.map(jnp.copy, params)
  for t in range(steps):
    p, state = step(p, state, grads=grads_at(params, t, **grad_kw))
  return p, state


def run_wrapper(tx, params, steps, **grad_kw):
  update = jax.jit(tx.update)
  state = tx.init(params)
  p = params
  for t in range(steps):
    u, state = update(grads_at(params, t, **grad_kw), state, p)
    p = optax.apply_updates(p, u)
  return p, state


def assert_same_bits(a, b):
  """Equal trees, bit for bit (NaN equal to NaN, -0 not equal to +0)."""
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    if x.dtype.itemsize in (2, 4) and jnp.issubdtype(x.dtype, jnp.floating):
      same = (x.view(f"u{x.dtype.itemsize}") == y.view(f"u{x.dtype.itemsize}")) | (
          np.isnan(x.astype(np.float32)) & np.isnan(y.astype(np.float32)))
      assert same.all(), f"{int((~same).sum())} of {x.size} elements differ"
    else:
      np.testing.assert_array_equal(x, y)


CASES = [
    ("adamw", dict(weight_decay=0.1)),
    ("adamw", dict(amsgrad=True, eps_mode="hat", weight_decay=0.05, weight_decay_mask=None)),
    ("adam", dict(weight_decay=0.01, nesterov=True)),  # L2 decay, masked (MindSpore default)
    ("adamax", dict(weight_decay=0.01)),
]


@pytest.mark.parametrize("algo,kw", CASES)
@pytest.mark.parametrize("multi_tensor", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("method", METHODS)
def test_step_is_the_wrapper_bit_for_bit(method, dtype, multi_tensor, algo, kw):
  """The one-pass step writes the params ``ak.param_rounding(fused)`` + apply_updates
  writes, and the same state (key and step, or Kahan buffer, and the moments)."""
  make = functools.partial(NAMED[algo], 3e-3, multi_tensor=multi_tensor, backend="xla", **kw)
  params = make_params(dtype)
  fused = make(param_rounding=method, **seeded(method))
  wrapper = ak.param_rounding(make(), method, **seeded(method))
  assert_same_bits(fused.init(params), wrapper.init(params))
  p, state = run_step(fused, params, 4)
  ref_p, ref_state = run_wrapper(wrapper, params, 4)
  assert_same_bits(p, ref_p)
  assert_same_bits(state, ref_state)
  assert type(state) is type(wrapper.init(params))
  assert p["none"] is None and p["w"].dtype == dtype and p["f32"].dtype == jnp.float32
  moved = np.asarray(p["w"], np.float32) != np.asarray(params["w"], np.float32)
  assert moved.mean() > 0.5  # the comparison is not between two unchanged trees
  if method == "kahan":
    assert np.any(np.asarray(state.compensation["w"], np.float32) != 0)
    assert state.compensation["f32"] is None
  # the optax form is the wrapper's too
  g = grads_at(params, 0)
  assert_same_bits(fused.update(g, fused.init(params), params),
                   wrapper.update(g, wrapper.init(params), params))


def test_stochastic_steps_draw_from_their_seed():
  params = make_params()
  runs = [run_step(ak.fused_adamw(1e-3, param_rounding="stochastic", seed=s, backend="xla"),
                   params, 2)[0]["w"] for s in (3, jax.random.key(3), 4)]
  assert_same_bits(runs[0], runs[1])
  assert not np.array_equal(np.asarray(runs[0], np.float32), np.asarray(runs[2], np.float32))


def test_kahan_keeps_small_updates_that_nearest_drops():
  """Steps of about 1e-4 on weights near 1 (under half a bf16 unit, 2**-8): round to
  nearest never moves them, the Kahan-compensated step follows the float32 run."""
  params = {"w": jnp.ones(4096, jnp.bfloat16)}
  out = {}
  for method in ("nearest", "kahan", None):
    p = params if method else {"w": jnp.ones(4096, jnp.float32)}
    opt = ak.fused_adam(1e-4, param_rounding=method, backend="xla")
    step, state = jax.jit(opt.step), opt.init(p)
    for _ in range(30):
      p, state = step(p, state, grads={"w": jnp.ones(4096, p["w"].dtype)})
    out[method] = np.asarray(p["w"], np.float64)
  assert np.all(out["nearest"] == 1.0)
  assert np.all(np.abs(out["kahan"] - out[None]) <= 2**-9)
  assert np.all(out[None] < 1.0 - 2.5e-3)  # the float32 run did move, by 30 steps of ~1e-4


def test_float32_params_take_the_plain_step():
  """float32 leaves pass straight through: "kahan" keeps no buffer (a documented no-op)."""
  params = make_params(jnp.float32)
  opt = ak.fused_adamw(1e-2, param_rounding="kahan", backend="xla")
  state = opt.init(params)
  assert all(c is None for c in jax.tree.leaves(state.compensation, is_leaf=lambda x: x is None))
  p, _ = run_step(opt, params, 3)
  q, _ = run_step(ak.fused_adamw(1e-2, backend="xla"), params, 3)
  assert_same_bits(p, q)


@pytest.mark.parametrize("method", ["stochastic", "kahan"])
@pytest.mark.parametrize("lazy", [True, False])
def test_row_sparse_gradient_of_a_bf16_table(method, lazy):
  """A RowSparse gradient of a bf16 table: the wrapper's numbers (its rows' update applied
  to the whole table, Kahan adding back the untouched rows' buffer)."""
  params = {"emb": jnp.asarray(np.random.default_rng(0).standard_normal((50, 4)), jnp.bfloat16),
            "w": jnp.ones((3, 3), jnp.bfloat16)}
  make = functools.partial(ak.fused_adamw, 1e-2, weight_decay=0.1, lazy=lazy, backend="xla")
  fused = make(param_rounding=method, **seeded(method))
  wrapper = ak.param_rounding(make(), method, **seeded(method))

  def grads(t):
    rows = jnp.asarray(np.random.default_rng(t).standard_normal((3, 4)), jnp.bfloat16)
    return {"emb": ak.RowSparse(jnp.array([4, 9, 4]), rows, 50),
            "w": jnp.full((3, 3), 0.5, jnp.bfloat16)}

  p, state = params, fused.init(params)
  q, ref_state = params, wrapper.init(params)
  for t in range(3):
    p, state = jax.jit(fused.step)(p, state, grads=grads(t))
    u, ref_state = jax.jit(wrapper.update)(grads(t), ref_state, q)
    q = optax.apply_updates(q, u)
  assert_same_bits(p, q)
  assert_same_bits(state, ref_state)
  moved = np.flatnonzero(np.any(np.asarray(p["emb"] != params["emb"]), axis=1)).tolist()
  assert 4 in moved and 9 in moved


def test_quantized_moments_with_rounding_match_the_wrapper():
  q8 = ak.Quantized("8bit", min_size=0)
  params = make_params()
  make = functools.partial(ak.fused_adamw, 1e-2, mu_dtype=q8, nu_dtype=q8, backend="xla")
  p, state = run_step(make(param_rounding="kahan"), params, 3)
  ref_p, ref_state = run_wrapper(ak.param_rounding(make(), "kahan"), params, 3)
  assert_same_bits(p, ref_p)
  assert_same_bits(state, ref_state)


def test_bad_arguments_and_states():
  params = make_params()
  with pytest.raises(ValueError, match="`param_rounding` must be one of"):
    ak.fused_adamw(param_rounding="round_up")
  for seed in (1.5, "0", True, jnp.ones(2)):
    with pytest.raises(TypeError, match="`seed` must be an int"):
      ak.fused_adam(param_rounding="stochastic", seed=seed)
  with pytest.raises(ValueError, match=r"`seed` must be an int in \[0, 2\*\*64\)"):
    ak.fused_adamax(param_rounding="stochastic", seed=-1)
  with pytest.raises(ValueError, match="param_rounding='kahan' draws none"):
    ak.fused_adamw(param_rounding="kahan", seed=3)
  with pytest.raises(ValueError, match="this fused step has no param_rounding"):
    ak.fused_adamw(seed=3)
  with pytest.raises(TypeError, match="unexpected keyword argument 'bf16_stochastic_round'; "
                     "adamkit's is `param_rounding='stochastic'`"):
    ak.fused_adamw(bf16_stochastic_round=True)
  with pytest.raises(TypeError, match="leaf 'steps' has dtype int32"):
    ak.fused_adamw(param_rounding="kahan").init({"w": jnp.ones(2, jnp.bfloat16),
                                                 "steps": jnp.zeros(2, jnp.int32)})
  kahan = ak.fused_adamw(param_rounding="kahan", backend="xla")
  stochastic = ak.fused_adamw(param_rounding="stochastic", backend="xla")
  g = grads_at(params, 0)
  with pytest.raises(TypeError, match=r"param_rounding='kahan' takes the KahanState .* got a "
                     r"state from param_rounding\(method='stochastic'\)"):
    kahan.step(params, stochastic.init(params), grads=g)
  with pytest.raises(TypeError, match="takes the StochasticRoundingState .* got a FusedAdamState"):
    stochastic.step(params, ak.fused_adamw().init(params), grads=g)
  plain = ak.fused_adamw(backend="xla")
  with pytest.raises(TypeError, match="takes the FusedAdamState made by its own `init`, got a "
                     "KahanState"):
    plain.step(params, kahan.init(params), grads=g)
  state = kahan.init(params)
  bad = state._replace(compensation={**state.compensation, "w": jnp.zeros((300, 7), jnp.float32)})
  with pytest.raises(ValueError, match="the Kahan buffer of 'w' is float32\\(300, 7\\); the param "
                     "is bfloat16\\(300, 7\\), whose buffer is bfloat16"):
    kahan.step(params, bad, grads=g)


@pytest.mark.parametrize("multi_tensor", [True, False])
def test_state_dict_names_the_kahan_buffer_by_param(multi_tensor):
  params = {"fc": {"weight": jnp.ones((3, 2), jnp.bfloat16)}, "bias": jnp.zeros(2)}
  g = jax.tree.map(lambda p: jnp.full_like(p, 0.3), params)
  for tx in (ak.fused_adamw(1e-3, param_rounding="kahan", multi_tensor=multi_tensor),
             ak.param_rounding(ak.adamw(1e-3), "kahan")):
    _, state = tx.update(g, tx.init(params), params)
    flat = ak.state_dict(state, params)
    assert flat["fc.weight.compensation"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(flat["fc.weight.compensation"],
                                  np.asarray(state.compensation["fc"]["weight"]))
    assert "bias.compensation" not in flat and "fc.weight.moment1" in flat
    assert not any(k.startswith("state.compensation") for k in flat)
    assert_same_bits(ak.load_state_dict(flat, tx.init(params)), state)


# ------------------------------------------------------------------ the C++ kernel


def kernel_calls(opt, params, **grad_kw):
  hlo = jax.jit(opt.step).lower(params, opt.init(params),
                                grads=grads_at(params, 0, **grad_kw)).as_text()
  return hlo.count(TARGET)


EXACT = [  # b1 = 1/2, b2 = 3/4, powers of two: every product of the float32 step is exact
    ("adamw", dict(eps_mode="hat", amsgrad=True, weight_decay=0.125, weight_decay_mask=None)),
    ("adam", dict(nesterov=True)),
    ("adamax", dict(weight_decay=0.25)),
]


@pytest.mark.parametrize("algo,kw", EXACT)
@pytest.mark.parametrize("multi_tensor", [True, False])
@pytest.mark.parametrize("grad_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("method", METHODS)
def test_kernel_rounds_as_xla_bit_for_bit(kernel, method, grad_dtype, multi_tensor, algo, kw):
  """The kernel reads and writes the bf16 params (and Kahan buffers) and rounds in its
  pass: the XLA step's bits, threefry included, on leaves small and split over threads."""
  params = make_params(big=True)
  make = functools.partial(NAMED[algo], 2.0**-6, b1=0.5, b2=0.75, multi_tensor=multi_tensor,
                           param_rounding=method, **seeded(method), **kw)
  grad_kw = dict(dtype=grad_dtype, dyadic=True)
  opt = make(backend="kernel")
  low = [x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params)]
  runs = sum(1 for i, lo in enumerate(low) if lo and (i == 0 or not low[i - 1]))
  assert kernel_calls(opt, params, **grad_kw) == (runs if multi_tensor else sum(low))
  assert kernel_calls(make(backend="xla"), params, **grad_kw) == 0
  p, state = run_step(opt, params, 4, donate=True, **grad_kw)
  ref_p, ref_state = run_step(make(backend="xla"), params, 4, **grad_kw)
  assert_same_bits(p, ref_p)
  assert_same_bits(state, ref_state)
  moved = np.asarray(p["emb"], np.float32) != np.asarray(params["emb"], np.float32)
  assert moved.mean() > 0.5


@pytest.mark.parametrize("method", METHODS)
def test_kernel_with_any_hyperparameters_is_within_one_rounding(kernel, method):
  """With products that round (AdamW's defaults), the kernel's float32 sum may differ from
  XLA's contracted one in its last bit: a bf16 param then at most one unit apart, rarely."""
  params = make_params(big=True)
  make = functools.partial(ak.fused_adamw, 1e-2, param_rounding=method, **seeded(method))
  p, _ = run_step(make(backend="kernel"), params, 3)
  ref_p, _ = run_step(make(backend="xla"), params, 3)
  for k in ("w", "emb", "b"):
    a, b = np.asarray(p[k], np.float32), np.asarray(ref_p[k], np.float32)
    ulp = np.spacing(np.abs(b).astype(ml_dtypes.bfloat16)).astype(np.float32)
    assert np.all(np.abs(a - b) <= ulp)
    assert np.mean(a != b) < 0.01


def test_kernel_refuses_what_it_cannot_take(kernel):
  """fp16 params, quantized moments: XLA even when forced (rule 3 of adamkit._backend)."""
  assert kernel_calls(ak.fused_adamw(param_rounding="kahan", backend="kernel"),
                      make_params(jnp.float16)) == 0
  q8 = ak.Quantized("8bit", min_size=0)
  assert kernel_calls(ak.fused_adamw(param_rounding="kahan", mu_dtype=q8, backend="kernel"),
                      make_params()) == 0
  assert kernel_calls(ak.fused_adamw(param_rounding="kahan", backend="kernel"),
                      make_params()) == 2  # the bf16 leaves before and after the float32 one
  fits = _backend.use_kernel("kernel", jnp.zeros(4), narrow=(jnp.zeros(4, jnp.float16),))
  assert not fits


def test_kernel_without_donation_leaves_its_inputs(kernel):
  params = make_params()
  opt = ak.fused_adamw(1e-2, param_rounding="kahan", backend="kernel")
  state = opt.init(params)
  state = state._replace(compensation=jax.tree.map(lambda c: c + 1e-3, state.compensation))
  before = jax.tree.map(np.array, (params, state))
  jax.block_until_ready(jax.jit(opt.step)(params, state, grads=grads_at(params, 0)))
  assert_same_bits((params, state), before)
