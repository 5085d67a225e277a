"""The fused steps with quantized moments (``mu_dtype`` / ``nu_dtype`` = ``ak.Quantized``).

References: the 8-bit format's encoder (``_quant.encode_blocks`` under jit) for the kernel's
codes and scales, bit for bit, ties and midpoints included; a float32 NumPy replica of the
quantized step (its own nearest-code search, ``np.searchsorted``) for the kernel's whole
trajectory, bit for bit; torchao's ``AdamW8bit`` trajectory (the golden file) for the
format and the step; and the XLA path against the kernel. Also the chain form's kernel
(``ak.adamw(mu_dtype="8bit", ...)`` on one CPU device: the new codes by
``adamkit_cpu_requantize``), against the same encoder and against the step written out
eagerly (dequantize, the moment rows, quantize), bit for bit.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import GOLDEN, load_ao_8bit_run
from reference import round_4bit_mu

import adamkit as ak
from adamkit import _adam, _quant, _quant_ops
from adamkit._cpu import ffi

Q8 = ak.Quantized("8bit", min_size=0)
F32 = np.float32


def shapes_params(seed=0):
  rng = np.random.default_rng(seed)
  shapes = {"a": (64, 512), "b": (300,), "c": (3, 1000), "d": (7,)}
  return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}


def grads_for(params, steps, seed=1):
  rng = np.random.default_rng(seed)
  return [{k: jnp.asarray(rng.standard_normal(p.shape) * 10.0 ** rng.uniform(-4, 1), jnp.float32)
           for k, p in params.items()} for _ in range(steps)]


# ------------------------------------------------------------ the kernel's codes


def _direct_codes(g, block, amsgrad=False):
  """The kernel on ``g`` with b1 = b2 = 0, so that its new moments are exactly ``g`` and
  ``g * g``: returns the stored (codes, scales) of each state buffer."""
  n = g.size
  variant = ffi.Variant("corrected", amsgrad=amsgrad)
  s = ffi.scalars("corrected", b1=0.0, b2=0.0, eps=1e-8, lr=0.1, wd=0.0, bc1=1.0, bc2=1.0)
  roles = ("mu", "nu", "nu")[:3 if amsgrad else 2]
  state = []
  for role in roles:
    z = _quant.zeros((n,), _quant.Format("8bit", role, block))
    state.append(ffi.Codes(z.codes, z.scales, _quant.code_book("8bit", role),
                           _quant.kernel_midpoints(z.fmt)))
  _, out = jax.jit(functools.partial(ffi.dense_step_quantized, variant, offsets=[0] * len(roles),
                                     block=block))(s, [jnp.zeros_like(g)], [g], tuple(state))
  return [(np.asarray(c.codes).reshape(-1, block), np.asarray(c.scales)) for c in out]


def _hard_values(block, seed=0):
  """Blocks of every magnitude, plus ties: exact midpoints (scale 1), the floats just
  below them, zeros, signed zeros, NaN and Inf, a block of tiny values."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((40, block)) * 10.0 ** rng.uniform(-30, 30, (40, 1))).astype(F32)
  rows = []
  for role in ("mu", "nu"):
    mid = _quant._midpoints("8bit", role)
    for tie in (mid, np.nextafter(mid, F32(-np.inf)), np.nextafter(mid, F32(np.inf))):
      row = np.resize(tie, block).astype(F32)
      row[rng.integers(block)] = 1.0  # the block's scale is 1: r is the value itself
      rows.append(row)
  special = np.zeros(block, F32)
  special[: min(block, 6)] = [np.nan, np.inf, -np.inf, -0.0, 1e-40, -3.0][: min(block, 6)]
  # the second moment's floor: g * g at 2^-126 (and a float32 either side) beside g = 1
  floor = np.resize(np.array([2.0**-63, np.nextafter(F32(2.0**-63), F32(0)),
                              np.nextafter(F32(2.0**-63), F32(1)), -(2.0**-63)], F32), block)
  floor[-1] = 1.0
  rows += [special, np.zeros(block, F32), np.full(block, 1e-38, F32), floor]
  return np.concatenate([x, np.stack(rows)]).reshape(-1)


@pytest.mark.parametrize("block", [256, 64, 8, 2])
@pytest.mark.parametrize("amsgrad", [False, True])  # the kernel's vector pass; its general path
def test_kernel_codes_are_the_formats_bit_for_bit(kernel, block, amsgrad):
  g = _hard_values(block)
  got = _direct_codes(jnp.asarray(g), block, amsgrad=amsgrad)
  with np.errstate(over="ignore"):  # g * g overflows to inf: stored as 0
    squares = g * g
  for (codes, scales), x, role in zip(got, (g, squares, squares), ("mu", "nu", "nu")):
    fmt = _quant.Format("8bit", role, block)
    want = jax.jit(lambda x, fmt=fmt: _quant.encode_blocks(x.reshape(-1, block), fmt))(x)
    np.testing.assert_array_equal(codes, np.asarray(want[0]))
    np.testing.assert_array_equal(scales, np.asarray(want[1]))
    if block >= 64:
      assert len(np.unique(codes)) > 100  # not a degenerate block


def test_kernel_codes_in_multi_leaf_calls_with_partial_blocks(kernel):
  """Leaves of 1, 255, 257 and 1000 elements back to back: each starts a block, its last
  block is padded with zeros (codes of 0), the codes are the format's leaf by leaf."""
  rng = np.random.default_rng(3)
  sizes = [1, 255, 257, 1000]
  gs = [jnp.asarray(rng.standard_normal(n) * 10.0 ** rng.uniform(-5, 2), jnp.float32) for n in sizes]
  fmts = [_quant.Format("8bit", r, 256) for r in ("mu", "nu")]
  blocks = sum(-(-n // 256) for n in sizes)
  state = []
  for fmt in fmts:
    z = _quant.zeros((blocks * 256 + 512,), fmt)  # two spare blocks, left untouched
    state.append(ffi.Codes(_quant.code_blocks(z).at[-1].set(7), z.scales.at[-1].set(3.0),
                           _quant.code_book("8bit", fmt.role), _quant.kernel_midpoints(fmt)))
  s = ffi.scalars("hat", b1=0.0, b2=0.0, eps=1e-8, lr=0.1, wd=0.0, bc1=1.0, bc2=1.0)
  _, out = jax.jit(functools.partial(ffi.dense_step_quantized, ffi.Variant("hat"),
                                     offsets=[1, 1], block=256))(s, [jnp.zeros_like(g) for g in gs],
                                                                 gs, tuple(state))
  for c, fmt, square in zip(out, fmts, (False, True)):
    codes, scales = np.asarray(c.codes), np.asarray(c.scales)
    at = 1
    for g in gs:
      x = g * g if square else g
      want = jax.jit(lambda x, fmt=fmt: _quant.quantize(x, fmt))(x)
      nb = -(-g.size // 256)
      np.testing.assert_array_equal(codes[at:at + nb].reshape(-1), np.asarray(want.codes).reshape(-1))
      np.testing.assert_array_equal(scales[at:at + nb], np.asarray(want.scales))
      at += nb
    assert codes[-1, 0] == 7 and scales[-1] == 3.0 and scales[0] == F32(1e-12)


# ------------------------------------------------- the trajectory, against NumPy


class NumpyQuantizedAdamW:
  """AdamW ("corrected" eps) with 8-bit moments in float32 NumPy, operation by operation
  as the kernel computes it, with its own nearest-code search. The step's scalars (bias
  corrections and their reciprocals) are the kernel's, so the comparison is bit for bit."""

  def __init__(self, lr, wd, b1, b2, eps, amsgrad, mu_q, nu_q, block=256):
    self.lr, self.wd, self.b1, self.b2, self.eps = map(F32, (lr, wd, b1, b2, eps))
    self.amsgrad, self.q, self.block = amsgrad, {"mu": mu_q, "nu": nu_q}, block
    self.state = {}

  def encode(self, x, role):
    n = x.size
    xb = np.zeros(-(-n // self.block) * self.block, F32)
    xb[:n] = x.ravel()
    xb = xb.reshape(-1, self.block)
    xb = np.where(np.isfinite(xb), xb, F32(0))
    if role == "nu":
      xb = np.maximum(xb, F32(0))
    scale = np.maximum(np.abs(xb).max(axis=1), F32(1e-12))
    r = xb * (F32(1) / scale)[:, None]
    codes = np.searchsorted(_quant._midpoints("8bit", role), r, side="right")
    if role == "nu":  # the floor: a positive r from 2^-126 up is never the code of 0
      codes = np.where((codes == 0) & (r >= F32(2.0**-126)), 1, codes)
    return codes, scale

  def decode(self, stored, role, shape):
    codes, scale = stored
    x = _quant.code_book("8bit", role)[codes] * scale[:, None]
    # a negative, NaN or infinite scale (a damaged state) reads its block as zeros
    x = np.where(((scale >= 0) & (scale <= np.finfo(np.float32).max))[:, None], x, F32(0))
    return x.reshape(-1)[:int(np.prod(shape))].reshape(shape)

  def load(self, name, k, role, shape):
    stored = self.state.get((name, k))
    if stored is None:
      return np.zeros(shape, F32)
    return self.decode(stored, role, shape) if self.q[role] else stored

  def step(self, params, grads, c1, c2):
    out = {}
    for name, p in params.items():
      g = grads[name]
      m = self.load(name, 0, "mu", p.shape)
      v = self.load(name, 1, "nu", p.shape)
      m = self.b1 * m + (F32(1) - self.b1) * g
      v = self.b2 * v + (F32(1) - self.b2) * (g * g)
      den = v
      if self.amsgrad:
        old = self.load(name, 2, "nu", p.shape)
        den = np.where(np.isnan(v) | (v > old), v, old)
      u = (m * c1) / (np.sqrt(den * c2) + self.eps)
      u = u + self.wd * p
      out[name] = p + (-self.lr * u)
      for k, x, role in ((0, m, "mu"), (1, v, "nu"), (2, den, "nu"))[:3 if self.amsgrad else 2]:
        self.state[(name, k)] = self.encode(x, role) if self.q[role] else x
    return out


@pytest.mark.parametrize("mu_dtype,nu_dtype,amsgrad", [
    (Q8, Q8, False), (Q8, None, False), (None, Q8, True), (Q8, Q8, True)])
@pytest.mark.parametrize("multi_tensor", [True, False])
def test_kernel_trajectory_is_the_numpy_replica_bit_for_bit(kernel, mu_dtype, nu_dtype, amsgrad,
                                                            multi_tensor):
  _check_trajectory(shapes_params(), mu_dtype, nu_dtype, amsgrad, multi_tensor, steps=6)


def test_kernel_trajectory_of_a_leaf_split_into_chunks(kernel):
  """A leaf large enough that the kernel splits it into chunks run on several threads (and
  not a whole number of blocks): the same trajectory, bit for bit."""
  rng = np.random.default_rng(3)
  params = {"w": jnp.asarray(rng.standard_normal((520, 631)), jnp.float32)}
  _check_trajectory(params, Q8, Q8, False, False, steps=2)


def test_kernel_trajectory_with_nonfinite_values(kernel):
  """The vector pass meets NaN and +-inf gradients, gradients whose square overflows (an
  infinite v beside a finite m) and a first moment whose stored scale is NaN (a damaged
  state): it stores what is not finite as 0 and leaves it out of the scales, as the replica
  (and _quant.encode_blocks) do, bit for bit."""
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.standard_normal((8, 512)), jnp.float32)}
  grads = grads_for(params, 4, seed=5)
  bad = np.asarray(grads[1]["w"]).copy()
  bad[0, 3], bad[1, 300], bad[2, 7], bad[3, 100], bad[4, 5] = np.nan, np.inf, -np.inf, 3e19, -3e19
  grads[1] = {"w": jnp.asarray(bad)}

  def damage(t, state, ref):
    if t != 2:
      return state
    ref.state[("w", 0)][1][5] = np.nan  # block 5 of the flattened leaf
    q = state.mu["w"]
    scales = q.scales.reshape(-1).at[5].set(jnp.nan).reshape(q.scales.shape)
    return state._replace(mu={"w": dataclasses.replace(q, scales=scales)})

  _check_trajectory(params, Q8, Q8, False, False, steps=4, grads=grads, before_step=damage)


def _check_trajectory(params, mu_dtype, nu_dtype, amsgrad, multi_tensor, steps, grads=None,
                      before_step=None):
  lr, wd, b1, b2, eps = 0.01, 0.05, 0.9, 0.99, 1e-8
  opt = ak.fused_adamw(lr, b1, b2, eps, weight_decay=wd, weight_decay_mask=None,
                       amsgrad=amsgrad, mu_dtype=mu_dtype, nu_dtype=nu_dtype,
                       multi_tensor=multi_tensor, backend="kernel")
  ref = NumpyQuantizedAdamW(lr, wd, b1, b2, eps, amsgrad, mu_dtype is not None,
                            nu_dtype is not None)
  step = jax.jit(opt.step, donate_argnums=(0, 1))
  state = opt.init(jax.tree.map(jnp.copy, params))
  p, np_p = jax.tree.map(jnp.copy, params), {k: np.asarray(v) for k, v in params.items()}
  for t, g in enumerate(grads or grads_for(params, steps)):
    if before_step is not None:
      state = before_step(t, state, ref)
    bc1, bc2 = _adam.bias_corrections(b1, b2, jnp.asarray(t + 1, jnp.int32))
    scal = np.asarray(ffi.scalars("corrected", b1=b1, b2=b2, eps=eps, lr=lr, wd=wd, bc1=bc1,
                                  bc2=bc2))
    p, state = step(p, state, grads=g)
    with np.errstate(over="ignore", invalid="ignore"):
      np_p = ref.step(np_p, {k: np.asarray(v) for k, v in g.items()}, scal[7], scal[8])
    for k in params:
      np.testing.assert_array_equal(np.asarray(p[k]), np_p[k], err_msg=f"{k} step {t + 1}")
      for i, (moments, role) in enumerate(((state.mu, "mu"), (state.nu, "nu"))):
        if ref.q[role] and not multi_tensor:  # the stored state too (a NaN p hides it)
          codes, scales = ref.state[(k, i)]
          np.testing.assert_array_equal(np.asarray(moments[k].codes).reshape(-1), codes.reshape(-1))
          np.testing.assert_array_equal(np.asarray(moments[k].scales).reshape(-1), scales)
  big = max(params, key=lambda k: params[k].size)
  assert float(jnp.max(jnp.abs(p[big] - params[big]))) > steps * lr / 2  # it moved


# --------------------------------------------------- the state, both backends


CASES = [
    (ak.fused_adamw, dict(weight_decay=0.05, weight_decay_mask=None)),
    (ak.fused_adam, dict(weight_decay=0.01, nesterov=True, eps_mode="hat")),
    (ak.fused_adam, dict(amsgrad=True, b2=0.9)),
    (ak.fused_adamax, dict(weight_decay=0.01)),
]


@pytest.mark.parametrize("make,kw", CASES)
@pytest.mark.parametrize("multi_tensor", [True, False])
def test_kernel_and_xla_agree(kernel, make, kw, multi_tensor):
  """The two backends form the new moments in another order (XLA may fuse a multiply and
  an add), so a code can flip at a boundary; the params stay within a small fraction of
  the learning rate and almost every code agrees."""
  params, lr = shapes_params(), 0.01
  runs = {}
  for backend in ("xla", "kernel"):
    opt = make(lr, mu_dtype=Q8, nu_dtype=Q8, multi_tensor=multi_tensor, backend=backend, **kw)
    p, state = params, opt.init(params)
    step = jax.jit(opt.step)
    for g in grads_for(params, 5):
      p, state = step(p, state, grads=g)
    runs[backend] = p, state
  (px, sx), (pk, sk) = runs["xla"], runs["kernel"]
  assert jax.tree.structure(sx) == jax.tree.structure(sk)
  for k in params:
    np.testing.assert_allclose(np.asarray(pk[k]), np.asarray(px[k]), atol=0.05 * lr, rtol=0)
  for a, b in zip(jax.tree.leaves(sx), jax.tree.leaves(sk)):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == jnp.uint8:
      assert np.mean(np.asarray(a) != np.asarray(b)) < 2e-3


@pytest.mark.parametrize("kind", ["4bit", "fp8"])
@pytest.mark.parametrize("multi_tensor", [True, False])
def test_other_formats_run_on_xla(kernel, kind, multi_tensor):
  """4-bit and fp8 moments take the XLA path whatever the backend ("auto" and "kernel"
  alike) and stay close to the float32 step."""
  params, lr = shapes_params(), 0.01
  q = ak.Quantized(kind, min_size=0)
  ends = {}
  for name, kw in (("q", dict(mu_dtype=q, nu_dtype=q, backend="kernel")), ("f32", {})):
    opt = ak.fused_adamw(lr, multi_tensor=multi_tensor, **kw)
    p, state = params, opt.init(params)
    for g in grads_for(params, 4):
      p, state = jax.jit(opt.step)(p, state, grads=g)
    ends[name] = p, state
  codes = [x for x in jax.tree.leaves(ends["q"][1]) if x.dtype == jnp.uint8]
  assert codes and all(np.asarray(c).any() for c in codes)
  # Adam moves an element at most lr (1 - b1) / sqrt(1 - b2) (about 3.2 lr) a step; the
  # 4-bit first moment's stochastic levels let a rare element use that room, so the bound
  # is on the worst element, and the typical one stays close to float32.
  for k in params:
    diff = np.abs(np.asarray(ends["q"][0][k]) - np.asarray(ends["f32"][0][k]))
    assert diff.max() <= 2 * 4 * 3.2 * lr, (k, diff.max())
    assert diff.mean() <= 0.25 * lr * 4, (k, diff.mean())


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
@pytest.mark.parametrize("multi_tensor", [True, False])
@pytest.mark.parametrize("shape", [(2048, 2048), (4194301,)])
@pytest.mark.parametrize("form,donate", [("step", (0,)), ("step", (0, 1)), ("update", (0,))])
def test_xla_step_keeps_no_float32_moment(kind, multi_tensor, shape, form, donate):
  """The fused step's XLA path (other devices, several devices, 4-bit, no kernel) at 4M
  params keeps no full-size float32 copy of m or v under jit (4 bytes per param each; the
  one-pass step kept 16), and no copy of the codes when the state is donated: it steps
  chunk by chunk in place, strided rows of a leaf whose codes keep its rows (the 2-D
  per-leaf case), contiguous runs otherwise. Its optax form (``update``, then
  ``optax.apply_updates``) takes the chain form's two passes, the state not donated."""
  opt = ak.fused_adamw(1e-3, mu_dtype=kind, nu_dtype=kind, weight_decay_mask=None,
                       multi_tensor=multi_tensor, backend="xla")
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  state = jax.eval_shape(opt.init, params)

  def step(p, s, g):
    if form == "step":
      return opt.step(p, s, grads=g)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  compiled = jax.jit(step, donate_argnums=donate).lower(params, state, params).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp / np.prod(shape) <= 1.0


@pytest.mark.parametrize("multi_tensor", [True, False])
def test_4bit_first_moment_codes_are_the_dither_reference(multi_tensor):
  """With b1 = 0 the stored first moment is the gradient itself: its 4-bit codes are the
  reference's (tests/reference.py, float32 r = g * (1 / scale) as the format computes
  it) bit for bit at the step count t, each leaf's elements numbered from 0 in its own
  flat order (a multi-tensor buffer too), at every step."""
  params = shapes_params()
  q = ak.Quantized("4bit", block_size=64, min_size=0)
  opt = ak.fused_adamw(0.01, b1=0.0, mu_dtype=q, nu_dtype=q, multi_tensor=multi_tensor)
  step = jax.jit(opt.step)
  p, state = params, opt.init(params)
  for t, g in enumerate(grads_for(params, 3), start=1):
    p, state = step(p, state, grads=g)
    for name, x in g.items():
      if multi_tensor:
        (at,) = [at for leaf, _, _, at in state.mu.slots if leaf == name]
        buf = state.mu["4bit"]
        n = -(-x.size // 64)
        codes = _quant.code_blocks(buf)[at // 64:at // 64 + n]
        scales = buf.scales[at // 64:at // 64 + n]
      else:
        codes, scales = state.mu[name].codes, state.mu[name].scales
      codes = np.asarray(codes).reshape(-1, 32).astype(int)
      levels = np.stack([codes & 15, codes >> 4], -1).reshape(-1)[:x.size] - 7
      flat = np.asarray(x, np.float32).reshape(-1)
      blocks = np.pad(flat, (0, -flat.size % 64)).reshape(-1, 64)
      scale = np.maximum(np.abs(blocks).max(1), F32(1e-12))
      np.testing.assert_array_equal(np.asarray(scales).reshape(-1), scale)
      r = (blocks * (F32(1) / scale)[:, None]).reshape(-1)[:x.size]
      want = round_4bit_mu(r, np.arange(x.size), t)
      np.testing.assert_array_equal(levels, want, err_msg=f"{name} step {t}")


EXACT = ak.Quantized("8bit", exact=True)  # torchao's arithmetic (no floor of v)


def test_torchao_adamw8bit_replay(kernel):
  """The fused 8-bit step on the kernel replays torchao's AdamW8bit within 0.1 x lr at
  every step (the golden README: a wrong map or per-tensor scales land 0.45 x lr away)."""
  d = np.load(GOLDEN / "ao_adamw8bit_public.npz")
  lr = float(d["lr"])
  opt = ak.fused_adamw(lr, float(d["b1"]), float(d["b2"]), float(d["eps"]),
                       weight_decay=float(d["weight_decay"]), weight_decay_mask=None,
                       mu_dtype=EXACT, nu_dtype=EXACT, backend="kernel")
  params = {k: jnp.asarray(d[f"init.{k}"]) for k in ("b", "w")}
  state = opt.init(params)
  assert state.mu["8bit"].shape == (64 * 256,) and state.mu["float32"].shape == (300,)
  step = jax.jit(opt.step)
  worst = 0.0
  for t in range(int(d["steps"])):
    params, state = step(params, state, grads={k: jnp.asarray(d[f"grads.{k}"][t]) for k in params})
    for k in params:
      worst = max(worst, float(np.max(np.abs(np.asarray(params[k]) - d[f"params.{k}"][t]))))
  assert worst <= 0.1 * lr, worst / lr
  dq = np.asarray(_quant.dequantize(state.mu["8bit"]))
  np.testing.assert_allclose(dq.reshape(64, 256), d["exp_avg.w"], atol=0.02 * np.abs(d["exp_avg.w"]).max())


@pytest.mark.parametrize("run", ["adamw_block128", "adamw_block512", "adamw_warmup"])
def test_torchao_adamw8bit_other_runs(kernel, run):
  """The fused 8-bit step on the kernel replays torchao's other AdamW8bit runs (blocks of
  128 and 512, a learning rate changed at every step) within 0.1 x lr, a 4500-element leaf
  kept in float32 by ``pad=False`` as torchao keeps it."""
  config, init, grads, recorded, quantized = load_ao_8bit_run(run)
  kw, lrs = config["kwargs"], config["lr"]
  q = ak.Quantized("8bit", block_size=kw.get("block_size"), pad=False, exact=True)
  opt = ak.fused_adamw(lambda count: jnp.asarray(lrs)[count], *kw.get("betas", (0.9, 0.999)),
                       kw.get("eps", 1e-8), weight_decay=kw["weight_decay"],
                       weight_decay_mask=None, mu_dtype=q, nu_dtype=q, backend="kernel")
  params = {k: jnp.asarray(v) for k, v in init.items()}
  state = opt.init(params)
  assert state.mu["8bit"].size == sum(init[k].size for k in init if quantized[k])
  assert state.mu["float32"].size == sum(init[k].size for k in init if not quantized[k])
  step = jax.jit(opt.step)
  worst = 0.0
  for t in range(len(lrs)):
    params, state = step(params, state, grads={k: jnp.asarray(g[t]) for k, g in grads.items()})
    for k, want in recorded.get(t, {}).items():
      worst = max(worst, float(np.max(np.abs(np.asarray(params[k]) - want))))
  assert worst <= 0.1 * max(lrs), worst / max(lrs)


def test_state_bytes_per_parameter():
  """2 bytes of codes per parameter and a float32 scale per 256: 2.03 bytes, per leaf and
  multi-tensor (the bound of the issue: 2.05)."""
  params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  for mt in (True, False):
    state = jax.eval_shape(ak.fused_adamw(mu_dtype="8bit", nu_dtype="8bit", multi_tensor=mt).init,
                           params)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert 2.0 < nbytes / 2**20 <= 2.05


def test_min_size_keeps_small_leaves_float32():
  params = {"big": jnp.zeros((64, 64)), "small": jnp.zeros(100)}
  state = ak.fused_adam(mu_dtype="8bit", nu_dtype="8bit").init(params)
  assert set(state.mu) == {"8bit", "float32"} and state.mu["float32"].shape == (100,)
  per_leaf = ak.fused_adam(mu_dtype="8bit", multi_tensor=False).init(params)
  assert _quant.is_qarray(per_leaf.mu["big"]) and per_leaf.mu["small"].dtype == jnp.float32
  assert per_leaf.nu["big"].dtype == jnp.float32  # nu_dtype=None: the params' dtype


# --------------------------------------------------------------------- errors


def test_a_state_of_another_format_or_block_is_refused():
  params = {"w": jnp.ones((8, 512))}
  g = {"w": jnp.ones((8, 512))}
  for mt in (True, False):
    opt = ak.fused_adam(mu_dtype=Q8, nu_dtype=Q8, multi_tensor=mt)
    for other in (ak.Quantized("8bit", block_size=128, min_size=0), ak.Quantized("4bit", min_size=0),
                  None):
      state = ak.fused_adam(mu_dtype=other, nu_dtype=Q8, multi_tensor=mt).init(params)
      with pytest.raises(ValueError, match="mu"):
        opt.step(params, state, grads=g)
    # and a float state for a quantized optimizer's other way round
    state = opt.init(params)
    with pytest.raises(ValueError, match="mu"):
      ak.fused_adam(multi_tensor=mt).step(params, state, grads=g)


def test_bad_formats_name_the_argument():
  with pytest.raises((TypeError, ValueError), match="mu_dtype"):
    ak.fused_adamw(mu_dtype="9bit")
  with pytest.raises((TypeError, ValueError), match="nu_dtype"):
    ak.fused_adamax(nu_dtype="int8")
  with pytest.raises(ValueError, match="block_size"):
    ak.fused_adam(mu_dtype=ak.Quantized("8bit", block_size=100))


def test_lazy_row_sparse_leaf_with_blocks_across_rows_is_refused():
  """A table whose rows are not whole blocks (48 elements, blocks of 32) cannot be
  stepped lazily on its own blocks: a ValueError names the leaf, the block, the row and
  the ways out, per leaf and multi-tensor alike; lazy=False densifies it instead."""
  params = {"emb": jnp.zeros((100, 48))}
  q = ak.Quantized("8bit", block_size=32, min_size=0)
  g = {"emb": ak.RowSparse(jnp.array([1, 5]), jnp.ones((2, 48)), 100)}
  for mt in (True, False):
    for fmt in (dict(mu_dtype=q, nu_dtype=q), dict(nu_dtype=q)):
      opt = ak.fused_adamw(0.1, multi_tensor=mt, **fmt)
      with pytest.raises(ValueError, match=r"'emb'.*blocks of 32.*rows of 48 elements.*"
                                           r"lazy=False.*ak\.sparse_adam"):
        opt.step(params, opt.init(params), grads=g)
      with pytest.raises(ValueError, match="'emb'"):
        opt.update(g, opt.init(params), params)
    dense = ak.fused_adam(0.1, mu_dtype=q, nu_dtype=q, lazy=False, multi_tensor=mt)
    new, _ = dense.step(params, dense.init(params), grads=g)
    assert float(jnp.abs(new["emb"][1]).min()) > 0 and float(jnp.abs(new["emb"][0]).max()) == 0


# ------------------------------------------ lazy row-sparse tables, quantized moments

# Tables: rows of two blocks of 32; one block per row of 2 x 16; (with "y") four rows of 16 per
# block pair, whose codes do not lead with the rows (blocks of 32 in rows of 64 elements).
TABLES = {"emb": (40, 64), "z": (16, 2, 16)}
WITH_Y = {**TABLES, "y": (8, 4, 16)}


def _table_params(tables=TABLES, seed=0):
  """A dense leaf before the tables (so that their blocks start past the buffer's start in
  multi-tensor mode), then the tables."""
  rng = np.random.default_rng(seed)
  params = {"a": jnp.asarray(rng.standard_normal(300), jnp.float32)}
  params.update({k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in tables.items()})
  return params


def _table_grads(steps, tables=TABLES, seed=1):
  """Row-sparse gradients with repeated ids (every id inside its table), and a dense one."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    scale = 10.0 ** rng.uniform(-3, 0)
    g = {"a": jnp.asarray(rng.standard_normal(300) * scale, jnp.float32)}
    for name, shape in tables.items():
      k = max(3, shape[0] // 3)
      ids = rng.integers(0, shape[0], k)
      ids[2] = ids[0]  # a repeat at every step
      g[name] = ak.RowSparse(jnp.asarray(ids, jnp.int32), jnp.asarray(
          rng.standard_normal((k, *shape[1:])) * scale, jnp.float32), shape[0])
    out.append(g)
  return out


def _leaf_moment(moments, name, params):
  """Leaf ``name``'s moment, as a QuantizedArray of its own: per leaf as stored, or its
  blocks cut out of a multi-tensor buffer."""
  if not isinstance(moments, ak.FlatMoments):
    return moments[name]
  (key, at) = [(k, at) for leaf, _, k, at in moments.slots if leaf == name][0]
  buf = moments[key]
  shape = tuple(params[name].shape)
  block = buf.fmt.block_size
  first, n = at // block, _quant.stored_layout(shape, buf.fmt).scales.size
  return _quant.from_code_blocks(_quant.code_blocks(buf)[first:first + n],
                                 buf.scales[first:first + n], shape, buf.fmt)


LAZY_CASES = [  # fused step, its sparse reference, options
    (ak.fused_adam, ak.sparse_adam, dict(eps_mode="corrected")),
    (ak.fused_adamw, ak.sparse_adamw, dict(weight_decay=0.05, weight_decay_mask=None)),
    (ak.fused_adam, ak.sparse_adam, dict(amsgrad=True, b2=0.9)),
]


def _adam_state(state):
  """The moments' state inside an optax chain's state (nested tuples)."""
  if hasattr(state, "mu"):
    return state
  found = [_adam_state(x) for x in state if isinstance(x, tuple)]
  return next(x for x in found if x is not None) if any(x is not None for x in found) else None


def _run_sparse(ref, params, grads):
  update = jax.jit(ref.update)
  p, state = params, ref.init(params)
  for g in grads:
    u, state = update(g, state, p)
    p = ak.apply_updates(p, u)
  return p, _adam_state(state)


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
@pytest.mark.parametrize("multi_tensor", [True, False])
@pytest.mark.parametrize("make,make_ref,kw", LAZY_CASES)
def test_lazy_quantized_table_is_sparse_adam(kind, multi_tensor, make, make_ref, kw):
  """The fused lazy step on tables with quantized moments (blocks of 32 in rows of 64, and
  one block per row of a (16, 2, 16) table) is ak.sparse_adam's / ak.sparse_adamw's step
  with the same format, over 4 steps with repeated ids: the same arithmetic on the same
  rows (the touched rows' blocks dequantized, stepped, requantized with the dither at the
  table's own positions, row * D + column), so the tables and their codes and scales are
  bit for bit the reference's, per leaf and from a multi-tensor buffer alike. The dense
  leaf is laid out otherwise by each (sparse_adam: a 1-D leaf in its own blocks, the fused
  step: blocks of the flat buffer), so it is compared to float32 rounding of the update
  only where both store it alike (8-bit: within a code of the other's)."""
  q = ak.Quantized(kind, block_size=32, min_size=0)
  params, grads = _table_params(), _table_grads(4)
  opt = make(0.01, mu_dtype=q, nu_dtype=q, multi_tensor=multi_tensor, **kw)
  step = jax.jit(opt.step)
  p, state = params, opt.init(params)
  for g in grads:
    p, state = step(p, state, grads=g)
  rp, rstate = _run_sparse(make_ref(0.01, mu_dtype=q, nu_dtype=q, **kw), params, grads)
  fields = ("mu", "nu", "nu_max") if kw.get("amsgrad") else ("mu", "nu")
  moved = 0
  for name in ("emb", "z"):
    np.testing.assert_array_equal(np.asarray(p[name]), np.asarray(rp[name]), err_msg=name)
    moved += int(np.sum(np.asarray(p[name]) != np.asarray(params[name])))
    for f in fields:
      got = _leaf_moment(getattr(state, f), name, params)
      want = getattr(rstate, f)[name]
      assert want.fmt.block_size == 32 and got.fmt == want.fmt, (name, f)
      np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes), err_msg=f)
      np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales), err_msg=f)
      np.testing.assert_array_equal(np.asarray(_quant.dequantize(got)),
                                    np.asarray(_quant.dequantize(want)))
  assert moved > 0
  # Adam moves an element at most about 3.2 lr a step: the dense leaf's two layouts stay
  # well inside that of each other (their moments differ by a code's rounding).
  np.testing.assert_allclose(np.asarray(p["a"]), np.asarray(rp["a"]), atol=0.5 * 0.01 * 4, rtol=0)


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
@pytest.mark.parametrize("multi_tensor", [True, False])
def test_lazy_quantized_step_leaves_untouched_rows_bit_identical(kind, multi_tensor):
  """Rows that a step does not look up keep their params, codes and scales bit for bit
  (a repeated id's padding and the table's neighbours in a flat buffer included); the
  touched rows' do change."""
  q = ak.Quantized(kind, block_size=32, min_size=0)
  params, (g1, g2) = _table_params(WITH_Y), _table_grads(2, WITH_Y)
  opt = ak.fused_adamw(0.01, mu_dtype=q, nu_dtype=q, multi_tensor=multi_tensor)
  step = jax.jit(opt.step)
  p1, s1 = step(params, opt.init(params), grads=g1)
  p2, s2 = step(p1, s1, grads=g2)
  for name in WITH_Y:
    touched = np.zeros(params[name].shape[0], bool)
    touched[np.asarray(g2[name].indices)] = True
    np.testing.assert_array_equal(np.asarray(p2[name])[~touched], np.asarray(p1[name])[~touched])
    assert (np.asarray(p2[name])[touched] != np.asarray(p1[name])[touched]).any(axis=-1).all()
    for f in ("mu", "nu"):
      old = _leaf_moment(getattr(s1, f), name, params)
      new = _leaf_moment(getattr(s2, f), name, params)
      rows = lambda x, n=params[name].shape[0]: np.asarray(x).reshape(n, -1)  # noqa: E731
      for a, b in ((old.codes, new.codes), (old.scales, new.scales)):
        np.testing.assert_array_equal(rows(b)[~touched], rows(a)[~touched], err_msg=f"{name}.{f}")
      assert (rows(new.scales)[touched] != rows(old.scales)[touched]).any(), (name, f)


def test_lazy_quantized_flat_step_touches_the_buffers_by_scatter_only():
  """O(rows touched): in the multi-tensor step of a table with quantized moments, every
  array as large as the table's state is made by a scatter of the touched rows' blocks
  into the donated buffer (no slice of the leaf's region, no write-back of it)."""
  params = {"emb": jnp.zeros((4096, 64))}
  q = ak.Quantized("8bit", block_size=32, min_size=0)
  g = {"emb": ak.RowSparse(jnp.array([1, 5, 5]), jnp.ones((3, 64)), 4096)}
  for mt in (True, False):
    opt = ak.fused_adamw(0.01, mu_dtype=q, nu_dtype=q, multi_tensor=mt)
    jaxpr = jax.make_jaxpr(opt.step.positional)(params, opt.init(params), g).jaxpr
    big = [e.primitive.name for e in jaxpr.eqns
           if any(np.prod(v.aval.shape) >= 4096 * 64 // 32 for v in e.outvars)]
    assert big and set(big) <= {"scatter", "scatter-add", "shard_alike"}, big


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
@pytest.mark.parametrize("multi_tensor", [True, False])
def test_lazy_quantized_jit_eager_and_optax_form_agree(kind, multi_tensor):
  """The fused lazy step under jit and its optax form (jitted ``update`` +
  ``ak.apply_updates``) give the same tables, codes and scales bit for bit. Eager, XLA
  does not contract a multiply and an add into one FMA, so the new moments and params may
  differ by a rounding (seen: 1 ulp of the params, of a 4-bit first moment's scale) and a
  code may then flip where a value lies at a level's boundary (none seen here)."""
  q = ak.Quantized(kind, block_size=32, min_size=0)
  params, grads = _table_params(), _table_grads(3)
  opt = ak.fused_adamw(0.01, weight_decay_mask=None, mu_dtype=q, nu_dtype=q,
                       multi_tensor=multi_tensor)
  runs = {}
  for how in ("eager", "jit", "optax"):
    p, state = params, opt.init(params)
    step = jax.jit(opt.step) if how == "jit" else opt.step
    for g in grads:
      if how == "optax":
        u, state = jax.jit(opt.update)(g, state, p)
        assert isinstance(u["emb"], ak.RowSparse)
        p = ak.apply_updates(p, u)
      else:
        p, state = step(p, state, grads=g)
    runs[how] = p, state
  moment = lambda how, f, name: _leaf_moment(getattr(runs[how][1], f), name, params)  # noqa: E731
  for name in TABLES:
    np.testing.assert_array_equal(np.asarray(runs["optax"][0][name]),
                                  np.asarray(runs["jit"][0][name]))
    np.testing.assert_allclose(np.asarray(runs["eager"][0][name]), np.asarray(runs["jit"][0][name]),
                               rtol=1e-6, atol=1e-7)
    for f in ("mu", "nu"):
      a, b, c = (moment(how, f, name) for how in ("optax", "jit", "eager"))
      np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
      np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
      assert np.mean(np.asarray(c.codes) != np.asarray(b.codes)) <= 0.01
      np.testing.assert_allclose(np.asarray(c.scales), np.asarray(b.scales), rtol=1e-6)


def test_lazy_quantized_per_leaf_and_flat_give_the_same_codes():
  """The same tables give the same params and 4-bit codes per leaf and from a flat buffer
  (each element dithered at its position in its table), "y" included, whose per-leaf
  codes do not lead with its rows (rows of 64 elements, last axis 16, blocks of 32)."""
  q = ak.Quantized("4bit", block_size=32, min_size=0)
  params, grads = _table_params(WITH_Y), _table_grads(3, WITH_Y)
  runs = []
  for mt in (True, False):
    opt = ak.fused_adam(0.01, mu_dtype=q, nu_dtype=q, multi_tensor=mt)
    p, state = params, opt.init(params)
    for g in grads:
      p, state = jax.jit(opt.step)(p, state, grads=g)
    runs.append((p, state))
  for name in WITH_Y:
    np.testing.assert_array_equal(np.asarray(runs[0][0][name]), np.asarray(runs[1][0][name]))
    for f in ("mu", "nu"):
      a, b = (_leaf_moment(getattr(s, f), name, params) for _, s in runs)
      np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes), err_msg=name)
      np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales), err_msg=name)


def test_nonfinite_gradients_leave_no_nan_scale(kernel):
  params = {"w": jnp.ones(4096)}
  g = {"w": jnp.ones(4096).at[3].set(jnp.nan).at[700].set(jnp.inf)}
  for backend in ("xla", "kernel"):
    opt = ak.fused_adamw(mu_dtype="8bit", nu_dtype="8bit", amsgrad=True, backend=backend)
    _, state = jax.jit(opt.step)(params, opt.init(params), grads=g)
    for buf in (state.mu, state.nu, state.nu_max):
      assert np.isfinite(np.asarray(buf["8bit"].scales)).all()


# ------------------------------------------ the chain form's kernel (requantize)


def _requantized(g, olds, kind="adam", b1=0.9, b2=0.999):
  rule = _quant_ops.MomentRule(kind, jnp.float32(b1), jnp.float32(b2))
  return jax.jit(lambda g, *o: _quant_ops._kernel_requantize(rule, g, o))(g, *olds)


@pytest.mark.parametrize("block", [256, 64, 8, 2])  # the AVX-512 pass (>= 64); the general path
@pytest.mark.parametrize("kind,amsgrad", [("adam", False), ("adam", True), ("adamax", False)])
def test_requantize_codes_are_the_formats_bit_for_bit(kernel, block, kind, amsgrad):
  """b1 = b2 = 0 from zero moments: the new moments are g and g * g (AdaMax: |g|; AMSGrad's
  maximum: g * g), whose codes and scales are the format's encoder's, ties included."""
  g = _hard_values(block)
  roles = ("mu", "nu", "nu")[:3 if amsgrad else 2]
  olds = tuple(_quant.zeros(g.shape, _quant.Format("8bit", r, block)) for r in roles)
  got = _requantized(jnp.asarray(g), olds, kind, b1=0.0, b2=0.0)
  with np.errstate(over="ignore"):  # g * g overflows to inf: stored as 0
    second = np.abs(g) if kind == "adamax" else g * g
  for q, x, old in zip(got, (g, second, second), olds):
    want = jax.jit(lambda x, fmt=old.fmt: _quant.encode_blocks(x.reshape(-1, block), fmt))(x)
    assert q.codes.shape == old.codes.shape and q.scales.shape == old.scales.shape
    np.testing.assert_array_equal(np.asarray(q.codes).reshape(-1, block), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(want[1]))


def _eager_moments(kind, g, olds, b1, b2):
  """The new moments stored, written out eagerly: dequantize, the moment rows, quantize."""
  with jax.disable_jit():
    x = [_quant.dequantize(o) for o in olds]
    if kind == "adamax":
      new = [b1 * x[0] + (1.0 - b1) * g, jnp.maximum(b2 * x[1], jnp.abs(g))]
    else:
      new = list(_adam.adam_moments(g, x[0], x[1], b1=b1, b2=b2))
      if len(olds) == 3:
        new.append(jnp.maximum(x[2], new[1]))
    return [_quant.quantize(n, o.fmt) for n, o in zip(new, olds)]


@pytest.mark.parametrize("shape,block,kind,amsgrad", [
    ((256, 1024), 256, "adam", False),  # codes keep the rows
    ((300, 1001), 256, "adam", True),  # flattened, the last block padded
    ((70001,), 64, "adamax", False),
    ((128, 512), 32, "adam", False),  # the general path
    ((33, 4096), 4096, "adam", False),  # blocks over the AVX-512 pass's bound
])
def test_requantize_is_the_step_written_out(kernel, shape, block, kind, amsgrad):
  """Random old states and gradients of every magnitude, NaN and Inf in some blocks: the
  kernel's codes and scales are those of the eager step, bit for bit."""
  rng = np.random.default_rng(block)
  q = ak.Quantized("8bit", block_size=block, min_size=0)
  g = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 4, shape)).astype(F32).reshape(-1)
  g[[5, 700, -3]] = [np.nan, np.inf, -np.inf]
  g = jnp.asarray(g.reshape(shape))
  olds = [_quant.quantize(jnp.asarray(0.1 * rng.standard_normal(shape), jnp.float32),
                          _quant.resolve(q, "mu"))]
  for _ in range(2 if amsgrad else 1):
    olds.append(_quant.quantize(jnp.asarray(0.01 * rng.random(shape), jnp.float32),
                                _quant.resolve(q, "nu")))
  b1, b2 = jnp.float32(0.9), jnp.float32(0.999)
  got = _requantized(g, tuple(olds), kind)
  for a, b in zip(got, _eager_moments(kind, g, olds, b1, b2)):
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
    assert np.isfinite(np.asarray(a.scales)).all()


def test_chain_form_takes_the_kernel_where_the_rule_allows(kernel):
  """8-bit moments of one block size, a float32 gradient of 2^15 elements or more, one
  CPU device; otherwise the XLA loop."""
  rule = _quant_ops.MomentRule("adam", jnp.float32(0.9), jnp.float32(0.999))
  zeros = lambda n, r, kind="8bit", b=256: _quant.zeros((n,), _quant.Format(kind, r, b))  # noqa: E731
  n = 1 << 15
  g = jnp.ones(n, jnp.float32)
  assert _quant_ops._on_kernel(rule, g, (zeros(n, "mu"), zeros(n, "nu")))
  assert _quant_ops._on_kernel(rule, g, (zeros(n, "mu"), zeros(n, "nu"), zeros(n, "nu")))
  assert not _quant_ops._on_kernel(None, g, (zeros(n, "mu"), zeros(n, "nu")))
  assert not _quant_ops._on_kernel(rule, g[:-1], (zeros(n - 1, "mu"), zeros(n - 1, "nu")))
  assert not _quant_ops._on_kernel(rule, g.astype(jnp.bfloat16), (zeros(n, "mu"), zeros(n, "nu")))
  assert not _quant_ops._on_kernel(rule, g, (zeros(n, "mu"), zeros(n, "nu", "4bit")))
  assert not _quant_ops._on_kernel(rule, g, (zeros(n, "mu"), zeros(n, "nu", b=128)))
  assert not _quant_ops._on_kernel(rule, g, (zeros(n, "mu"), jnp.zeros(n)))
  adamax = _quant_ops.MomentRule("adamax", jnp.float32(0.9), jnp.float32(0.999))
  assert not _quant_ops._on_kernel(adamax, g, (zeros(n, "mu"), zeros(n, "nu"), zeros(n, "nu")))
  if jax.device_count() > 1:  # spread over devices: XLA, which keeps the sharding
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    olds = tuple(jax.device_put(zeros(n, r), spec) for r in ("mu", "nu"))
    assert not _quant_ops._on_kernel(rule, jax.device_put(g, spec), olds)


def test_chain_form_on_the_kernel_matches_the_xla_loop(kernel, monkeypatch):
  """ak.adamw with 8-bit moments, eager (one device: the kernel) against the same steps
  with the kernel turned off (the XLA loop, eager): the same params and states, bit for
  bit (eager, neither side contracts a multiply and an add)."""
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.standard_normal((64, 1024)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(3000), jnp.float32)}
  grads = [{k: jnp.asarray(rng.standard_normal(p.shape) * 10.0 ** rng.uniform(-3, 1), jnp.float32)
            for k, p in params.items()} for _ in range(3)]
  runs, calls = [], []
  on_kernel = _quant_ops._on_kernel
  monkeypatch.setattr(_quant_ops, "_on_kernel", lambda *a: calls.append(on_kernel(*a)) or calls[-1])
  for _ in range(2):
    tx = ak.adamw(1e-2, weight_decay=0.01, weight_decay_mask=None,
                  mu_dtype=ak.Quantized("8bit", min_size=0), nu_dtype=ak.Quantized("8bit", min_size=0))
    p, state = params, tx.init(params)
    with jax.disable_jit():
      for g in grads:
        u, state = tx.update(g, state, p)
        p = jax.tree.map(lambda a, b: a + b, p, u)
    runs.append((p, state))
    monkeypatch.setattr(_quant_ops, "_on_kernel", lambda *a: calls.append(False) or False)
  assert any(calls[:6])  # the first run took the kernel (for w, 2^16 elements): "now"
  for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
