"""The fused step (ak.fused_adam / ak.fused_adamw / ak.fused_adamax) against the reference chain.

Reference: the named optimizer's ``update`` followed by ``optax.apply_updates`` (itself
checked against float64 NumPy in test_reference.py), plus one direct float64 NumPy check
per algorithm. Both backends: the pure-JAX path always, the C++ kernel where it can be
built (it is compiled into a temporary directory when missing; skipped without a compiler).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import NumpyAdam

import adamkit as ak
from adamkit import _backend

STEPS = 3


def make_params(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  shapes = {"conv": (4, 3, 2), "dense": {"kernel": (6, 5), "bias": (5,)}, "bn": {"gamma": (3,)},
            "scalar": ()}
  return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s), dtype), shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


def grads_like(params, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)


def run_reference(tx, params, steps=STEPS):
  state = tx.init(params)
  for t in range(steps):
    updates, state = tx.update(grads_like(params, 100 + t), state, params)
    params = optax.apply_updates(params, updates)
  return params


def run_fused(opt, params, steps=STEPS, donate=True):
  step = jax.jit(opt.step, donate_argnums=(0, 1) if donate else ())
  state = opt.init(params)
  params = jax.tree.map(jnp.copy, params)
  for t in range(steps):
    params, state = step(params, state, grads=grads_like(params, 100 + t))
  return params, state


SCHEDULE = optax.linear_schedule(0.1, 0.01, 3)
CASES = [
    ("adam", dict()),
    ("adam", dict(eps_mode="corrected")),
    ("adam", dict(nesterov=True)),
    ("adam", dict(eps_mode="corrected", nesterov=True, weight_decay=0.1)),
    ("adam", dict(weight_decay=0.05, weight_decay_mask=None)),
    ("adam", dict(learning_rate=SCHEDULE, weight_decay=lambda c: 0.01 * (c.astype(jnp.float32) + 1.0))),
    ("adam", dict(b1=0.8, b2=0.95, eps=1e-3)),
    ("adam", dict(amsgrad=True)),
    ("adam", dict(amsgrad=True, eps_mode="corrected", nesterov=True, weight_decay=0.1)),
    ("adam", dict(amsgrad=True, b2=0.9, mu_dtype=jnp.bfloat16)),  # b2 < b1: the max matters
    ("adamw", dict()),
    # MindSpore nn.AdamWeightDecay: no bias correction, eps on sqrt(v)
    ("adamw", dict(eps=1e-6, weight_decay=0.05, bias_correction=False, eps_mode="hat")),
    # Paddle AdamW / torch AdamW: every leaf decays
    ("adamw", dict(weight_decay=0.05, weight_decay_mask=None)),
    ("adamw", dict(learning_rate=SCHEDULE, amsgrad=True, weight_decay=0.1, b2=0.9)),
    ("adamw", dict(weight_decay=lambda c: 0.05 * (c.astype(jnp.float32) + 1.0), amsgrad=True,
                   bias_correction=False, weight_decay_mask=None)),
    ("adamax", dict()),
    ("adamax", dict(weight_decay=0.05)),
    ("adamax", dict(learning_rate=SCHEDULE, b1=0.8, b2=0.95, eps=1e-3)),
]
NAMED = {"adam": (ak.adam, ak.fused_adam), "adamw": (ak.adamw, ak.fused_adamw),
         "adamax": (ak.adamax, ak.fused_adamax)}


def assert_close(actual, expected, rtol=2e-6, atol=1e-7):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.dtype == e.dtype and a.shape == e.shape
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64),
                               rtol=rtol, atol=atol)


@pytest.mark.parametrize("algo,kw", CASES)
@pytest.mark.parametrize("backend,multi_tensor",
                         [("xla", True), ("xla", False), ("kernel", True), ("kernel", False)])
def test_fused_equals_reference_chain(kernel, algo, kw, backend, multi_tensor):
  kw = dict(kw)
  lr = kw.pop("learning_rate", 0.1)
  named, fused = NAMED[algo]
  params = make_params()
  expected = run_reference(named(lr, **kw), params)
  actual, state = run_fused(fused(lr, **kw, backend=backend, multi_tensor=multi_tensor), params)
  # bf16 first moments round differently once the kernel is out of the loop: 1e-5
  assert_close(actual, expected, **(dict(rtol=1e-5, atol=1e-6) if "mu_dtype" in kw else {}))
  assert int(state.count) == STEPS
  assert isinstance(state, ak.FusedAmsgradState if kw.get("amsgrad") else ak.FusedAdamState)
  # The step moved the params: the comparison is not between two unchanged trees.
  assert float(jnp.max(jnp.abs(actual["conv"] - params["conv"]))) > 1e-2


FLOAT64_CASES = {
    "adam": ("adam", dict(eps_mode="corrected"), {}),
    "adamax": ("adamax", {}, {}),
    "adam_amsgrad": ("adam", dict(amsgrad=True, b2=0.9), {}),
    # the two orders of AdamW's decay: the fused step computes u + wd w, then -lr u; the
    # references take MindSpore's order and Paddle's (w *= 1 - lr wd first)
    # (without bias correction the first steps are about 3 sign(g): a gradient near eps
    # loses a few more ulps, 1e-5 of max|w| as the golden replays allow)
    "adamw_mindspore": ("adamw", dict(bias_correction=False, eps_mode="hat", eps=1e-6),
                        dict(decoupled="mindspore")),
    "adamw_paddle_amsgrad": ("adamw", dict(amsgrad=True, b2=0.9, eps_mode="corrected"),
                             dict(decoupled="paddle")),
}


@pytest.mark.parametrize("case", sorted(FLOAT64_CASES))
def test_kernel_against_float64_numpy(kernel, case):
  algo, kw, ref_kw = FLOAT64_CASES[case]
  params = make_params(1)
  ref = NumpyAdam(0.05, **dict(dict(b1=0.9, b2=0.999, eps=1e-8), **kw), weight_decay=0.01,
                  algo="adamax" if algo == "adamax" else "adam",
                  decay=lambda name: "gamma" not in name, **ref_kw)
  named = {"/".join(str(getattr(k, "key", k)) for k in path): leaf
           for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  np_params = {k: np.asarray(v) for k, v in named.items()}
  for t in range(STEPS):
    grads = grads_like(params, 100 + t)
    g_named = dict(zip(named, jax.tree.leaves(grads)))
    np_params = ref.step(np_params, {k: np.asarray(v) for k, v in g_named.items()})
  opt = NAMED[algo][1](0.05, weight_decay=0.01, backend="kernel", **kw)
  actual, _ = run_fused(opt, params)
  assert not np.allclose(np.asarray(actual["conv"]), np.asarray(params["conv"]), atol=1e-2)
  atol = 1e-5 if "bias_correction" in kw else 1e-6
  for k, leaf in zip(named, jax.tree.leaves(actual)):
    np.testing.assert_allclose(np.asarray(leaf, np.float64), np_params[k], rtol=1e-5, atol=atol)


def test_without_donation_inputs_are_untouched(kernel):
  params = make_params()
  opt = ak.fused_adam(0.1, backend="kernel")
  state = opt.init(params)
  before = jax.tree.map(np.array, (params, state))
  new_params, new_state = jax.jit(opt.step)(params, state, grads=grads_like(params, 0))
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(a), b)
  assert not np.allclose(np.asarray(new_params["conv"]), before[0]["conv"])
  assert float(jnp.max(jnp.abs(new_state.nu["float32"]))) > 0


@pytest.mark.parametrize("block", [None, 256, 32])  # 32: the quantized AVX2 loop
def test_adamax_nonfinite_gradients_kernel_equals_xla(kernel, block):
  """AdaMax's norm ``max(b2 v, |g|)`` keeps a NaN of either side, as ``jnp.maximum`` does
  on XLA: the kernel's state and params equal XLA's after a NaN / Inf gradient and a
  finite step after it (float32 moments: NaN where XLA has NaN; 8-bit: stored as 0)."""
  n = 4 * 8192  # a kernel-sized leaf: every vector lane and the scalar tail
  params = {"w": jnp.linspace(-1.0, 1.0, n + 5, dtype=jnp.float32)}
  bad = jnp.ones(n + 5).at[3].set(jnp.nan).at[700].set(-jnp.inf).at[n + 4].set(jnp.nan)
  fmt = ak.Quantized("8bit", block_size=block, min_size=0) if block else None
  out = {}
  for backend in ("kernel", "xla"):
    opt = ak.fused_adamax(1e-2, multi_tensor=False, backend=backend, mu_dtype=fmt, nu_dtype=fmt)
    p, s = opt.step(params, opt.init(params), grads={"w": bad})
    p, s = opt.step(p, s, grads={"w": jnp.full(n + 5, 0.5)})
    out[backend] = jax.tree.map(np.asarray, (p, s))
  for a, b in zip(jax.tree.leaves(out["kernel"]), jax.tree.leaves(out["xla"])):
    np.testing.assert_array_equal(a, b)
  nu = out["xla"][1].nu["w"]
  if block is None:  # the NaNs are really there (the comparison above is not vacuous)
    assert np.isnan(nu[3]) and np.isnan(nu[n + 4]) and np.isinf(nu[700]), nu[[3, 700, n + 4]]


def test_mixed_dtypes_take_the_jax_path_for_low_precision_leaves(kernel):
  params = make_params()
  params["dense"]["kernel"] = params["dense"]["kernel"].astype(jnp.bfloat16)
  expected = run_reference(ak.adam(0.1), params)
  actual, state = run_fused(ak.fused_adam(0.1), params)
  assert actual["dense"]["kernel"].dtype == jnp.bfloat16
  assert state.mu["bfloat16"].shape == (30,) and state.mu["float32"].shape == (33,)
  assert_close(actual, expected, rtol=1e-2, atol=1e-2)  # bf16 leaf: bf16 rounding
  assert_close(actual["conv"], expected["conv"])


def test_low_precision_moments_match_the_chain():
  params = make_params()
  kw = dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, eps_mode="corrected")
  expected = run_reference(ak.adam(0.1, **kw), params)
  actual, state = run_fused(ak.fused_adam(0.1, **kw), params)
  assert set(state.mu) == set(state.nu) == {"bfloat16"}
  assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_auto_backend_without_kernel_is_pure_jax(monkeypatch):
  monkeypatch.setattr(_backend, "kernel_built", lambda: False)
  params = make_params()
  opt = ak.fused_adam(0.1)
  hlo = jax.jit(opt.step).lower(params, opt.init(params), grads=grads_like(params, 0)).as_text()
  assert "adamkit_cpu_step" not in hlo
  assert_close(run_fused(opt, params)[0], run_reference(ak.adam(0.1), params))
  with pytest.raises(RuntimeError, match="not built"):
    ak.fused_adam(0.1, backend="kernel").step(params, opt.init(params), grads=grads_like(params, 0))


def test_multi_tensor_is_one_kernel_call(kernel):
  params = make_params()
  grads, count = grads_like(params, 0), {}
  for make in (ak.fused_adam, functools.partial(ak.fused_adamw, amsgrad=True)):
    for mt in (True, False):
      opt = make(0.1, backend="kernel", multi_tensor=mt, weight_decay_mask=None,
                 weight_decay=0.1)
      hlo = jax.jit(opt.step, donate_argnums=(0, 1)).lower(params, opt.init(params),
                                                           grads=grads).as_text()
      count[mt] = hlo.count("adamkit_cpu_step")
    assert count[True] == 1 and count[False] == len(jax.tree.leaves(params))


def test_donated_step_updates_in_place(kernel):
  """With donate_argnums=(0, 1) XLA aliases each kernel result to its input: no copies."""
  params = make_params()
  opt = ak.fused_adam(0.1, backend="kernel")
  compiled = jax.jit(opt.step, donate_argnums=(0, 1)).lower(
      params, opt.init(params), grads=grads_like(params, 0)).compile()
  assert " copy(" not in compiled.as_text()


def test_bad_arguments():
  params = make_params()
  opt = ak.fused_adam()
  with pytest.raises(ValueError, match="does not match"):
    opt.step(params, opt.init(params), grads={"conv": params["conv"]})
  with pytest.raises(ValueError, match="backend"):
    ak.fused_adam(backend="gpu")
  with pytest.raises(ValueError, match="b2"):
    ak.fused_adamax(b2=1.0)
  with pytest.raises(TypeError, match="integer|dtype"):
    opt.init({"w": jnp.arange(3)})
  with pytest.raises(TypeError, match="decoupled coefficient"):
    ak.fused_adamw(weight_decay=ak.L2Decay(0.1))
  with pytest.raises(TypeError, match="amsgrad"):
    ak.fused_adamw(amsgrad=1)
  with pytest.raises(ValueError, match="eps_mode"):
    ak.fused_adamw(eps_mode="paddle")


@pytest.mark.parametrize("backend", ["kernel", "xla"])
def test_multi_tensor_many_leaves_split_into_runs(kernel, backend):
  """70 leaves, decay flags changing along the tree and one bf16 leaf in the middle: the
  flat buffers are cut into several kernel calls and JAX updates; all must line up."""
  rng = np.random.default_rng(5)
  params = {f"l{i:02d}" + ("_gamma" if i % 7 == 3 else ""):
            jnp.asarray(rng.standard_normal((i % 5 + 1, 3)),
                        jnp.bfloat16 if i == 40 else jnp.float32) for i in range(70)}
  kw = dict(weight_decay=0.1, eps_mode="corrected")
  expected = run_reference(ak.adam(0.1, **kw), params)
  opt = ak.fused_adam(0.1, backend=backend, **kw)
  actual, state = run_fused(opt, params)
  assert_close({k: v for k, v in actual.items() if k != "l40"},
               {k: v for k, v in expected.items() if k != "l40"})
  assert_close(actual["l40"], expected["l40"], rtol=1e-2, atol=1e-2)
  if backend == "kernel":
    hlo = jax.jit(opt.step).lower(params, opt.init(params), grads=grads_like(params, 0)).as_text()
    assert 3 <= hlo.count("adamkit_cpu_step") < 70


def test_build_reports_a_missing_compiler(tmp_path):
  with pytest.raises(RuntimeError, match="compiler|failed"):
    ak.build_cpu_kernel(tmp_path / "k.so", compiler=str(tmp_path / "no-such-c++"))


def test_per_leaf_state_is_born_with_the_params_sharding():
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:4]), ("rows",))
  sharding = NamedSharding(mesh, P("rows"))
  params = {"w": jax.device_put(jnp.ones((8, 3)), sharding)}
  state = ak.fused_adam(0.1, multi_tensor=False, mu_dtype=jnp.bfloat16).init(params)
  for moment in (state.mu["w"], state.nu["w"]):
    assert moment.sharding.is_equivalent_to(sharding, 2)
  assert state.mu["w"].dtype == jnp.bfloat16 and state.nu["w"].dtype == jnp.float32


def test_kernel_step_batches_under_vmap(kernel):
  """jax.vmap over independent models: one kernel call per member (vmap_method
  "sequential"), the same numbers as the pure-JAX path."""
  params = {"w": jnp.asarray(np.random.default_rng(2).normal(size=(4, 64)), jnp.float32)}
  grads = {"w": jnp.asarray(np.random.default_rng(3).normal(size=(4, 64)), jnp.float32)}

  def member(backend, p, g):
    opt = ak.fused_adam(0.1, weight_decay=0.01, backend=backend)
    state = opt.init(p)
    for _ in range(2):
      p, state = opt.step(p, state, grads=g)
    return p

  got = jax.jit(jax.vmap(lambda p, g: member("kernel", p, g)))(params, grads)
  want = jax.jit(jax.vmap(lambda p, g: member("xla", p, g)))(params, grads)
  np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------ malformed states and inputs


@pytest.mark.parametrize("backend", ["auto", "kernel", "xla"])
def test_a_first_moment_smaller_than_its_param_is_refused(kernel, backend):
  """Known defect: the dense kernel sized both moments by the second one and wrote past a
  short first moment (heap corruption, abort). Now a ValueError names the leaf."""
  opt = ak.fused_adam(0.1, multi_tensor=False, backend=backend)
  params = {"w": jnp.ones(100_000)}
  state = opt.init(params)._replace(mu={"w": jnp.zeros(10)})
  with pytest.raises(ValueError, match=r"state.mu of 'w' has shape \(10,\)"):
    jax.jit(opt.step)(params, state, grads=params)
  bad_nu = opt.init(params)._replace(nu={"w": jnp.zeros((100_000,), jnp.int32)})
  with pytest.raises(ValueError, match="state.nu of 'w'"):
    jax.jit(opt.step)(params, bad_nu, grads=params)


def test_a_state_of_another_optimizer_is_refused():
  params = make_params()
  opt = ak.fused_adam(0.1)
  with pytest.raises(TypeError, match="FusedAdamState.*tuple"):
    opt.step(params, ak.adam(0.1).init(params), grads=grads_like(params, 0))
  per_leaf = ak.fused_adam(0.1, multi_tensor=False).init(params)
  with pytest.raises(ValueError, match="multi-tensor state's mu"):
    opt.step(params, per_leaf, grads=grads_like(params, 0))
  with pytest.raises(ValueError, match="state's mu tree does not match"):
    ak.fused_adam(0.1, multi_tensor=False).step(params, opt.init(params), grads=grads_like(params, 0))
  ams = ak.fused_adam(0.1, amsgrad=True)
  with pytest.raises(TypeError, match="amsgrad=True takes the FusedAmsgradState.*FusedAdamState"):
    ams.step(params, opt.init(params), grads=grads_like(params, 0))
  short = ams.init(params)._replace(nu_max={"float32": jnp.zeros(3)})
  with pytest.raises(ValueError, match="nu_max buffers"):
    ams.step(params, short, grads=grads_like(params, 0))
  ams = ak.fused_adamw(0.1, amsgrad=True, multi_tensor=False)
  with pytest.raises(ValueError, match="state.nu_max of 'conv'"):
    state = ams.init(params)
    ams.step(params, state._replace(nu_max={**state.nu_max, "conv": jnp.zeros(3)}),
             grads=grads_like(params, 0))


# ------------------------------------------------------------- the optax protocol


def run_update(tx, params, steps=STEPS, jit=False):
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(params)
  for t in range(steps):
    updates, state = update(grads_like(params, 100 + t), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("algo,kw", CASES)
@pytest.mark.parametrize("multi_tensor", [True, False])
def test_update_is_the_named_optimizer_bit_for_bit(algo, kw, multi_tensor):
  """``update`` + ``optax.apply_updates`` is ak.adam's / ak.adamax's trajectory bit for bit
  op by op (eager: both run the same arithmetic), to float32 rounding under ``jit`` (XLA
  fuses the two programs differently), and ``step`` equals both to float32 rounding."""
  kw = dict(kw)
  lr = kw.pop("learning_rate", 0.1)
  named, fused = NAMED[algo]
  params = make_params()
  tx = fused(lr, **kw, multi_tensor=multi_tensor)
  assert isinstance(tx, optax.GradientTransformation)
  expected, _ = run_update(named(lr, **kw), params)
  got, state = run_update(tx, params)
  for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  assert float(jnp.max(jnp.abs(got["conv"] - params["conv"]))) > 1e-2
  assert_close(run_update(tx, params, jit=True)[0], expected)
  stepped, step_state = run_fused(tx, params)
  assert_close(stepped, got)
  assert_close(step_state, state, atol=1e-6)  # one state type for both forms
  assert jax.tree.structure(step_state) == jax.tree.structure(state)


@pytest.mark.parametrize("multi_tensor", [True, False])
@pytest.mark.parametrize("lazy", [True, False])
def test_update_with_row_sparse_leaves_is_sparse_adam(lazy, multi_tensor):
  """A RowSparse leaf (a table between dense leaves) through ``update``: the lazy update is
  a RowSparse of the touched rows, as ak.sparse_adam's; ``ak.apply_updates`` then gives
  sparse_adam's params bit for bit."""
  params = {"a": jnp.linspace(-1.0, 1.0, 6), "emb": jnp.linspace(0.0, 1.0, 40).reshape(10, 4),
            "z": jnp.ones((2, 3))}
  tx = ak.fused_adam(0.1, weight_decay=0.01, weight_decay_mask=None, lazy=lazy,
                     multi_tensor=multi_tensor)
  ref = ak.sparse_adam(0.1, weight_decay=0.01, weight_decay_mask=None, lazy=lazy)
  p, s, rp, rs = params, tx.init(params), params, ref.init(params)
  for t in range(3):
    g = {"a": jnp.sin(params["a"] + t), "z": jnp.cos(params["z"] + t),
         "emb": ak.RowSparse(jnp.array([1, 7, 1]), jnp.full((3, 4), 0.5 + t), 10)}
    u, s = tx.update(g, s, p)
    ru, rs = ref.update(g, rs, rp)
    assert isinstance(u["emb"], ak.RowSparse) == lazy
    p, rp = ak.apply_updates(p, u), ak.apply_updates(rp, ru)
  for a, e in zip(jax.tree.leaves(p), jax.tree.leaves(rp)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  untouched = np.setdiff1d(np.arange(10), [1, 7])  # zero gradient, zero moments: no move
  np.testing.assert_array_equal(np.asarray(p["emb"][untouched]), np.asarray(params["emb"][untouched]))
  assert float(jnp.max(jnp.abs(p["emb"][1] - params["emb"][1]))) > 0.1


def test_update_without_params_and_its_errors():
  params = {"w": jnp.array([1.0, -2.0])}
  g = {"w": jnp.array([2.0, -4.0])}
  tx = ak.fused_adam(0.1, eps_mode="corrected")
  u, _ = tx.update(g, tx.init(params))  # no decay: the params are not needed
  np.testing.assert_allclose(np.asarray(u["w"]), [-0.1, 0.1], rtol=1e-6)
  with pytest.raises(ValueError, match="needs `params`"):
    ak.fused_adam(0.1, weight_decay=0.1).update(g, tx.init(params))
  with pytest.raises(TypeError, match="FusedAdamState"):
    tx.update(g, ak.adam(0.1).init(params), params)


def test_fused_transform_composes():
  """optax.chain and a jitted update: the fused optimizer is a link (every other idiom:
  tests/test_composition.py over the registry)."""
  params = make_params()
  grads = [grads_like(params, 100 + t) for t in range(2)]
  chained = optax.chain(optax.clip_by_global_norm(1.0), ak.fused_adam(0.1))
  ref = optax.chain(optax.clip_by_global_norm(1.0), ak.adam(0.1))
  p, s, rp, rs = params, chained.init(params), params, ref.init(params)
  for g in grads:
    u, s = jax.jit(chained.update)(g, s, p)
    ru, rs = jax.jit(ref.update)(g, rs, rp)
    p, rp = optax.apply_updates(p, u), optax.apply_updates(rp, ru)
  assert_close(p, rp)


def test_nnx_optimizer_takes_the_fused_step():
  from flax import nnx
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  ref_model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, ak.fused_adam(0.05), wrt=nnx.Param)
  ref = nnx.Optimizer(ref_model, ak.adam(0.05), wrt=nnx.Param)
  x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)

  @nnx.jit
  def train(model, opt):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)
    opt.update(model, grads)

  for _ in range(3):
    train(model, opt)
    train(ref_model, ref)
  assert_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
  assert float(jnp.max(jnp.abs(model.kernel[...] - nnx.Linear(3, 2, rngs=nnx.Rngs(0)).kernel[...]))) > 0.1


@pytest.mark.parametrize("multi_tensor", [True, False])
def test_master_weights_of_a_fused_step(multi_tensor):
  """Paddle multi_precision + use_multi_tensor: the wrapped fused optimizer keeps float32
  masters through ``step`` and ``update``; both follow ak.master_weights(ak.adam)."""
  params = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.bfloat16).reshape(3, 4),
            "b": jnp.zeros(4, jnp.float32)}
  tx = ak.master_weights(ak.fused_adam(1e-3, multi_tensor=multi_tensor))
  assert isinstance(tx, ak.FusedStep)
  ref = ak.master_weights(ak.adam(1e-3))
  grads = [jax.tree.map(lambda p, t=t: jnp.cos(p.astype(jnp.float32) + t).astype(p.dtype), params)
           for t in range(4)]
  p, s, rp, rs, sp, ss = params, tx.init(params), params, ref.init(params), params, tx.init(params)
  step = jax.jit(tx.step, donate_argnums=(0, 1))
  for g in grads:
    u, s = tx.update(g, s, p)
    ru, rs = ref.update(g, rs, rp)
    p, rp = optax.apply_updates(p, u), optax.apply_updates(rp, ru)
    sp, ss = step(jax.tree.map(jnp.copy, sp), ss, grads=g)
  for a, e in zip(jax.tree.leaves((p, s.master)), jax.tree.leaves((rp, rs.master))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  assert_close(ss.master, s.master)
  # the step writes the cast master (Paddle); the update path rounds the delta to bf16
  np.testing.assert_array_equal(np.asarray(sp["w"]), np.asarray(ss.master["w"].astype(jnp.bfloat16)))
  assert sp["w"].dtype == jnp.bfloat16 and ss.master["w"].dtype == jnp.float32
  assert float(jnp.max(jnp.abs(ss.master["w"] - params["w"].astype(jnp.float32)))) > 1e-3


@pytest.mark.parametrize("multi_tensor", [True, False])
def test_state_dict_names_fused_moments_by_param(multi_tensor):
  params = {"fc": {"weight": jnp.ones((2, 3)), "bias": jnp.zeros(3)},
            "h": jnp.ones(2, jnp.bfloat16)}
  opt = ak.fused_adam(0.1, multi_tensor=multi_tensor)
  _, state = opt.step(params, opt.init(params), grads=jax.tree.map(lambda x: x + 1, params))
  sd = ak.state_dict(state, params)
  assert sorted(sd) == ["fc.bias.moment1", "fc.bias.moment2", "fc.weight.moment1",
                        "fc.weight.moment2", "h.moment1", "h.moment2", "step"]
  assert sd["fc.weight.moment1"].shape == (2, 3) and sd["h.moment2"].dtype == jnp.bfloat16
  np.testing.assert_allclose(sd["fc.weight.moment1"], 0.2, rtol=1e-6)  # (1 - b1) * g
  np.testing.assert_allclose(sd["fc.bias.moment1"], 0.1, rtol=1e-6)
  back = ak.load_state_dict(sd, opt.init(params))
  assert jax.tree.structure(back) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("mode", ["state", "compute"])
@pytest.mark.parametrize("make", [lambda: ak.fused_adam(0.1, amsgrad=True),
                                  lambda: ak.fused_adamw(0.1, weight_decay_mask=None)],
                         ids=["adam_amsgrad", "adamw"])
def test_an_offloaded_fused_step_has_the_optax_form(make, mode):
  """``ak.offload`` of a fused step offloads its ``update`` too: the state stays in host
  memory and ``update`` + ``apply_updates`` agrees with ``step``."""
  opt = ak.offload(make(), mode=mode)
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.arange(3.0)}
  p_upd, p_step = params, params
  s_upd, s_step = opt.init(params), opt.init(params)
  update, step = jax.jit(opt.update), jax.jit(opt.step)
  for t in range(2):
    g = grads_like(params, t)
    u, s_upd = update(g, s_upd, p_upd)
    p_upd = optax.apply_updates(p_upd, u)
    p_step, s_step = step(p_step, s_step, grads=g)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(s_upd) if x.ndim} == {"pinned_host"}
  for a, b in zip(jax.tree.leaves((p_upd, s_upd)), jax.tree.leaves((p_step, s_step))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("multi_tensor", [True, False])
def test_amsgrad_state_dict_names_the_running_maximum(multi_tensor):
  """``FusedAmsgradState``'s ``nu_max`` is ``<param>.moment2_max``, as for
  ``ScaleByAmsgradState``, in both layouts; ``load_state_dict`` writes it back."""
  opt = ak.fused_adamw(0.1, amsgrad=True, multi_tensor=multi_tensor)
  params = {"fc": {"weight": jnp.ones((2, 3))}, "b": jnp.ones(3)}
  grads = {"fc": {"weight": jnp.full((2, 3), 2.0)}, "b": jnp.ones(3)}
  _, state = opt.step(params, opt.init(params), grads=grads)
  sd = ak.state_dict(state)
  assert sorted(sd) == sorted(f"{p}.{m}" for p in ("b", "fc.weight")
                              for m in ("moment1", "moment2", "moment2_max")) + ["step"]
  np.testing.assert_allclose(sd["fc.weight.moment2_max"], (1 - np.float32(0.999)) * 4.0,
                             rtol=1e-6)  # (1 - b2) g^2, b2 in float32
  back = ak.load_state_dict(sd, opt.init(params))
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
