"""The 8-bit second moment's floor (issue 32, "the 8-bit format's stale elements").

bitsandbytes' and torchao's 8-bit arithmetic rounds a second moment under 1.6e-7 of its
block's maximum to 0; a weight whose gradient then falls to 0 keeps a first moment, and
m / (sqrt(0) + eps) moves it hundreds of learning rates per step. adamkit's default 8-bit
format stores such a v as the smallest non-zero code; ``ak.Quantized("8bit", exact=True)``
keeps the anchors' arithmetic. The reduced case of the issue: one 4096-element leaf whose
element 0 gets a gradient of -2.4e-5 once and then 0, while the others draw N(0, 0.03).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adamkit as ak
from adamkit import _quant

N, T, LR, B1, B2, WD = 4096, 20, 0.01, 0.9, 0.999, 0.01


def _case():
  rng = np.random.default_rng(0)
  g = rng.normal(0, 0.03, size=(T, N)).astype(np.float32)
  g[0, 0] = -2.4e-5
  g[1:, 0] = 0.0
  return {"w": jnp.asarray(rng.normal(0, 0.1, size=N), jnp.float32)}, g


def _adam_bound(t: np.ndarray) -> np.ndarray:
  r"""The largest :math:`|\hat m_t| / \sqrt{\hat v_t}` of float32 Adam over all gradient
  sequences (float64; Cauchy-Schwarz, reached): :math:`\frac{1-\beta_1}{\sqrt{1-\beta_2}}
  \sqrt{\sum_{j<t} (\beta_1^2/\beta_2)^j}\ \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}`, about 1
  to 1.16 over these 20 steps (:math:`(1-\beta_1)/\sqrt{1-\beta_2}` times
  :math:`1/\sqrt{1-\beta_1^2/\beta_2}` in the limit)."""
  r = B1**2 / B2
  return ((1 - B1) / np.sqrt(1 - B2) * np.sqrt((1 - r**t) / (1 - r))
          * np.sqrt(1 - B2**t) / (1 - B1**t))


def _steps(fmt, form):
  """The jitted step and initial state of AdamW with both moments in ``fmt``: the chain
  (``ak.adamw`` + ``optax.apply_updates``) or the fused step on ``form``'s backend."""
  params, _ = _case()
  if form == "chain":
    tx = ak.adamw(LR, b1=B1, b2=B2, weight_decay=WD, mu_dtype=fmt, nu_dtype=fmt)

    def step(p, s, g):
      u, s = tx.update({"w": g}, s, p)
      return optax.apply_updates(p, u), s
    return jax.jit(step), tx.init(params)
  opt = ak.fused_adamw(LR, b1=B1, b2=B2, weight_decay=WD, mu_dtype=fmt, nu_dtype=fmt,
                       backend=form)
  return jax.jit(lambda p, s, g: opt.step(p, s, grads={"w": g})), opt.init(params)


def _moves(fmt, form):
  """Per step and element, |move| / (lr * (Adam's bound + wd |w|)), and the last state."""
  params, grads = _case()
  step, state = _steps(fmt, form)
  bound = _adam_bound(np.arange(1, T + 1, dtype=np.float64))
  out = []
  for t in range(T):
    new, state = step(params, state, jnp.asarray(grads[t]))
    w = np.asarray(params["w"], np.float64)
    move = np.abs(np.asarray(new["w"], np.float64) - w) / LR
    out.append(move / (bound[t] + WD * np.abs(w)))
    params = new
  return np.array(out), state


@pytest.mark.parametrize("form", ["chain", "xla", "kernel"])
def test_default_8bit_moves_within_float32_adams_bound(form, request):
  """Every element of the default 8-bit AdamW moves at most 1.1 x float32 Adam's per-step
  bound (measured: 1.03; the dead element 1.0, where the anchors' arithmetic moves it 1,186
  lr in one step)."""
  if form == "kernel":
    request.getfixturevalue("kernel")
  ratio, _ = _moves("8bit", form)
  assert ratio[:, 0].max() <= 1.1, ratio[:, 0]
  assert ratio.max() <= 1.1, (ratio.max(), np.unravel_index(ratio.argmax(), ratio.shape))
  f32, _ = _moves(None, "chain")
  assert f32.max() <= 1.0 + 1e-6  # the bound holds for float32 itself


def test_exact_8bit_keeps_the_anchors_stale_element(kernel):
  """``exact=True`` is bitsandbytes' and torchao's arithmetic: the dead element's v rounds
  to 0 and it moves 1,186 lr at the second step (chain and fused kernel alike), while the
  default's codes differ from it in the second moment only, by the floor."""
  exact = ak.Quantized("8bit", exact=True)
  for form in ("chain", "kernel"):
    ratio, state = _moves(exact, form)
    assert ratio[1, 0] > 1000, ratio[:, 0]
    assert ratio[:, 1:].max() <= 1.1
  (_, s_exact), (_, s_floor) = (_moves(q, "xla") for q in (exact, "8bit"))
  np.testing.assert_array_equal(np.asarray(s_exact.mu["8bit"].codes),
                                np.asarray(s_floor.mu["8bit"].codes))
  nu_exact, nu_floor = (np.asarray(s.nu["8bit"].codes) for s in (s_exact, s_floor))
  differ = nu_exact != nu_floor
  assert differ.any() and np.all(nu_exact[differ] == 0) and np.all(nu_floor[differ] == 1)


def test_floor_codes_in_the_encoder_and_the_kernel(kernel):
  """The floor itself: a positive v / scale in [2^-126, first midpoint) gets code 1 (the
  smallest non-zero value), below 2^-126 and 0 code 0, from the first midpoint up the
  nearest code (float64 NumPy reference); exact=True gives code 0 there. The kernel's
  midpoints (``kernel_midpoints``) encode alike: one fused step from a zero state, kernel
  and XLA, gives the same codes bit for bit."""
  book = _quant.code_book("8bit", "nu").astype(np.float64)
  mids = (book[:-1] + book[1:]) / 2
  r = np.array([1.0, 0.5, mids[0] * 1.0001, mids[0] * 0.9999, 1e-9, 1e-30, 2.0**-126,
                2.0**-127, 1e-39, 0.0], np.float32)
  xb = jnp.asarray(np.tile(r, 26)[:256].reshape(1, 256))
  want_exact = np.searchsorted(mids, r.astype(np.float64), side="right")
  want = np.where((r >= 2.0**-126) & (want_exact == 0), 1, want_exact)
  for exact, expected in [(False, want), (True, want_exact)]:
    fmt = _quant.resolve(ak.Quantized("8bit", exact=exact), "nu")
    codes, scales = _quant.encode_blocks(xb, fmt)
    assert float(scales[0]) == 1.0
    np.testing.assert_array_equal(np.asarray(codes)[0, :r.size], expected)
    assert _quant.floors(fmt) is not exact
    kmid = _quant.kernel_midpoints(fmt)
    np.testing.assert_array_equal(np.searchsorted(kmid, r, side="right"), expected)
  # kernel against XLA: a gradient whose squares span the floor's range in every block
  rng = np.random.default_rng(1)
  g = {"w": jnp.asarray(rng.normal(size=8192) * 10.0 ** rng.integers(-12, 0, 8192), jnp.float32)}
  p = {"w": jnp.zeros(8192, jnp.float32)}
  states = []
  for backend in ("kernel", "xla"):
    opt = ak.fused_adamw(LR, mu_dtype="8bit", nu_dtype="8bit", backend=backend)
    states.append(jax.jit(lambda p, s, g, opt=opt: opt.step(p, s, grads=g))(p, opt.init(p), g))
  (pk, sk), (px, sx) = states
  np.testing.assert_array_equal(np.asarray(sk.nu["8bit"].codes), np.asarray(sx.nu["8bit"].codes))
  np.testing.assert_array_equal(np.asarray(pk["w"]), np.asarray(px["w"]))
  assert np.any(np.asarray(sx.nu["8bit"].codes) == 1)


@pytest.mark.parametrize("kind", ["4bit", "fp8"])
def test_4bit_and_fp8_second_moments_never_read_back_zero(kind):
  """The 4-bit (zero-free logarithmic map) and fp8 (raised to the smallest subnormal)
  second moments never decode a non-zero v to 0: the dead element moves within float32
  Adam's bound (measured 1.0; other elements: fp8 1.05, 4-bit 2.4, its first moment's
  stochastic rounding)."""
  ratio, _ = _moves(kind, "chain")
  assert ratio[:, 0].max() <= 1.1, ratio[:, 0]


def test_exact_is_for_8bit_only():
  with pytest.raises(ValueError, match="`exact`.*'8bit' only"):
    ak.Quantized("4bit", exact=True)
  with pytest.raises(ValueError, match="`exact` must be True or False"):
    ak.Quantized("8bit", exact="yes")
  assert _quant.resolve(ak.Quantized("8bit", exact=True), "nu").exact
