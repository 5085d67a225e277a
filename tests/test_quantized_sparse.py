"""Quantized moments of row-sparse tables (issue 19, "Sparse"): ``ak.sparse_adam`` /
``ak.sparse_adamw`` / ``ak.scale_by_sparse_adam`` with ``mu_dtype``/``nu_dtype`` 8-bit,
4-bit and fp8, against a float64 NumPy reference of the lazy quantized step (its own code
books and quantizer, written from the format's definition); properties (untouched rows'
codes and scales bit for bit, duplicates, non-lazy = the dense quantized step), the
layout and bytes per element, the O(k) compiled step, non-finite gradients, offload and
bad input."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from reference import round_4bit_mu
from test_offload import needs_host, transfers

import adamkit as ak
from adamkit._quant import Quantized  # ak.Quantized once exported

KINDS = ("8bit", "4bit", "fp8")


def fmt(kind, block_size=None):
  """The format under test; min_size=0 so that the small tables here are quantized."""
  return Quantized(kind, block_size=block_size, min_size=0)


def _moments(state):
  """The ScaleBy*AdamState inside a named optimizer's chain state."""
  for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "nu")):
    if hasattr(s, "nu"):
      return s
  raise AssertionError("no Adam state found")


def _step(tx):
  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates), state
  return jax.jit(step)


# ------------------------------------------------------------- float64 reference
#
# The formats, from their definition (adamkit/_quant.py's docstring, the golden README):
# per block the scale max|x| (floored at 1e-12) and per element the code whose value is
# nearest x / scale; "4bit" and "fp8" store sqrt(v) for the second moment.


@functools.cache
def dynamic_map(bits: int, signed: bool) -> np.ndarray:
  """The sorted "dynamic" code book: exponent bits ``bits - 1`` decades 10^-(E-1) .. 1, in
  each the midpoints of an even split of [0.1, 1] (2^i of them per sign in decade i for a
  signed map, 2^(i+1) unsigned), plus 0 and 1."""
  decades = bits - 1
  vals = [0.0, 1.0]
  for i in range(decades):
    n = 2 ** i if signed else 2 ** (i + 1)
    edges = np.linspace(0.1, 1.0, n + 1)
    mids = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - decades + 1)
    vals += list(mids) + (list(-mids) if signed else [])
  assert len(vals) == 2 ** bits
  return np.sort(np.asarray(vals))


def code_values(kind, role):
  """Sorted values of the codes (None for fp8, whose code is a float8 number)."""
  if kind == "8bit":
    return dynamic_map(8, role == "mu")
  if kind == "4bit":  # mu: levels k/7 (k = -7..7, code k + 7); nu: 2^((k - 15)/2)
    return np.arange(-7, 9) / 7 if role == "mu" else 2.0 ** (-(15 - np.arange(16)) / 2)
  return None


def ref_quantize(x, kind, role, block, ids=None, step=None):
  """x (rows, D) float64 -> its stored value (float64), blocks of ``block`` within rows.
  The 4-bit first moment's dither (tests/reference.py) takes the step count ``step`` and
  each element's position in the table, ``row * D + column`` for the table rows ``ids``
  that ``x`` holds."""
  rows, d = x.shape
  xb = x.reshape(rows, d // block, block)
  if role == "nu":
    xb = np.maximum(xb, 0.0)
    if kind != "8bit":
      xb = np.sqrt(xb)
  scale = np.maximum(np.abs(xb).max(-1, keepdims=True), 1e-12)
  r = xb / scale
  if kind == "fp8":
    y = np.clip(r * 448.0, -448.0, 448.0)
    if role == "nu":
      y = np.where(y > 0, np.maximum(y, 2.0 ** -9), y)
    q = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / 448.0
  elif kind == "4bit" and role == "nu":  # nearest in log2
    k = np.clip(np.round(15 + 2 * np.log2(np.maximum(r, 2.0 ** -16))), 0, 15)
    q = 2.0 ** (-(15 - k) / 2)
  elif kind == "4bit":  # rounded down or up by the dither of (position, step)
    pos = (np.asarray(ids)[:, None] * d + np.arange(d)).reshape(r.shape)
    q = round_4bit_mu(r, pos, step) / 7
  else:  # nearest value, ties to the larger code
    book = code_values(kind, role)
    dist = np.abs(r[..., None] - book)
    q = book[dist.shape[-1] - 1 - np.argmin(dist[..., ::-1], axis=-1)]
  out = q * scale
  if role == "nu" and kind != "8bit":
    out = out * out
  return out.reshape(rows, d), scale.reshape(rows, d // block)


def ref_decode(q):
  """A QuantizedArray of a 2-D table read back with the reference's code books (the
  layout: codes (N, D), or (N, D/2) for 4-bit, two per byte, low nibble first; a row of
  D/B scales)."""
  codes, scales = np.asarray(q.codes), np.asarray(q.scales, np.float64)
  codes = codes.reshape(scales.shape + (-1,))  # a row of bytes per block
  kind, role = q.fmt.kind, q.fmt.role
  if kind == "4bit":
    codes = np.stack([codes & 0xF, codes >> 4], -1).reshape(*codes.shape[:-1], -1)
    codes = codes[..., :q.fmt.block_size]
  if kind == "fp8":
    vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) / 448.0
  else:
    vals = code_values(kind, role)[codes]
  out = vals * scales[..., None]
  if role == "nu" and kind != "8bit":
    out = out * out
  return out.reshape(q.shape)


F32_B1, F32_B2 = float(np.float32(0.9)), float(np.float32(0.999))  # adamkit's float32 betas


def ref_lazy_step(w, m, v, ids, vals, t, *, kinds, block, lr, b1=F32_B1, b2=F32_B2, eps=1e-8,
                  lazy=True, wd=0.0, decoupled=False, eps_mode="hat"):
  """One sparse Adam / AdamW step with quantized moments, float64: the touched rows' stored
  moments (dequantized) and the merged gradient give the new float moments, the update is
  computed from them, then they are stored quantized (each row its own blocks); untouched
  rows keep their stored values. Returns (w, stored m, stored v, exact m, exact v, rows)."""
  w, m, v = (np.array(x, np.float64) for x in (w, m, v))
  ids = np.asarray(ids)
  g_occ = np.asarray(vals, np.float64) + (0.0 if decoupled else wd * w[ids])
  g = np.zeros_like(w)
  np.add.at(g, ids, g_occ)
  rows = np.unique(ids) if lazy else np.arange(w.shape[0])
  gr = g[rows]
  m_new = b1 * m[rows] + (1 - b1) * gr
  v_new = b2 * v[rows] + (1 - b2) * gr * gr
  bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
  if eps_mode == "hat":
    u = np.sqrt(bc2) / bc1 * m_new / (np.sqrt(v_new) + eps)
  else:
    u = (m_new / bc1) / (np.sqrt(v_new / bc2) + eps)
  if decoupled:
    u = u + wd * w[rows]
  w[rows] -= lr * u
  m[rows] = ref_quantize(m_new, kinds[0], "mu", block, rows, t)[0]
  v[rows] = ref_quantize(v_new, kinds[1], "nu", block, rows, t)[0]
  return w, m, v, m_new, v_new, rows


def assert_stored_close(got, want, exact, kind, role, block, what):
  """The stored moment equals the reference's quantization, but where float32 arithmetic
  put the exact value on the other side of a rounding boundary: at most 1 element in 100
  differs, and such an element holds the value of a code next to the exact one."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  rows = np.arange(exact.shape[0])  # the scales do not depend on the dither
  scale = ref_quantize(exact, kind, role, block, rows, 0)[1].repeat(block, axis=1)
  if role == "nu" and kind != "8bit":
    scale = scale * scale
  close = np.abs(got - want) <= 1e-5 * scale + 1e-30
  assert close.mean() >= 0.99, (what, close.mean())
  # a flipped code: the exact value lies between the two stored candidates
  lo, hi = np.minimum(got, want), np.maximum(got, want)
  between = (exact >= lo - 1e-5 * scale) & (exact <= hi + 1e-5 * scale)
  assert np.all(close | between), what


# ---------------------------------------------------------------- layout, bytes


@pytest.mark.parametrize("d,block,codes,scales", [
    (64, None, (100, 64), (100, 1)),  # rows shorter than the block: one scale per row
    (100, None, (100, 100), (100, 1)),  # any row length; the codes keep the table's shape
    (512, None, (100, 512), (100, 2)),  # the block divides the row: blocks within rows
    (64, 32, (100, 64), (100, 2)),
])
def test_table_layout_one_block_per_row_or_within_rows(d, block, codes, scales):
  state = ak.scale_by_sparse_adam(mu_dtype=fmt("8bit", block), nu_dtype=fmt("8bit", block)).init(
      {"emb": jnp.zeros((100, d))})
  for q in (state.mu["emb"], state.nu["emb"]):
    assert q.codes.shape == codes and q.codes.dtype == jnp.uint8
    assert q.scales.shape == scales and q.scales.dtype == jnp.float32
    assert q.shape == (100, d)
  q4 = ak.scale_by_sparse_adam(mu_dtype=fmt("4bit", block)).init({"e": jnp.zeros((100, d))}).mu["e"]
  b = q4.fmt.block_size  # 4-bit's first moment: blocks of 128 by default
  assert q4.codes.shape == (100, d // 2) and q4.scales.shape == (100, d // b)


@pytest.mark.parametrize("kind,d,most", [("8bit", 64, 2.2), ("8bit", 128, 2.07),
                                         ("8bit", 300, 2.03), ("4bit", 64, 1.13),
                                         ("fp8", 64, 2.2)])
def test_state_bytes_per_element(kind, d, most):
  """Measured from the state's arrays (codes and scales of both moments, the count)."""
  n = 1000
  state = ak.sparse_adam(0.1, mu_dtype=kind, nu_dtype=kind).init({"emb": jnp.zeros((n, d))})
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  assert nbytes / (n * d) <= most
  # and exactly what the docstring's formula says: 2 moments x (codes + a 4-byte scale per row)
  per_row = 2 * ((d // 2 if kind == "4bit" else d) + 4)
  assert nbytes - 4 - 4 == n * per_row  # the count and the learning-rate record


def test_small_rows_keep_their_own_scale():
  """Rows of 8: 12 bytes per 8 elements per moment, 3 per element (the docstring's figure)."""
  state = ak.scale_by_sparse_adam(mu_dtype=fmt("8bit"), nu_dtype=fmt("8bit")).init(
      {"emb": jnp.zeros((50, 8))})
  assert sum(x.nbytes for x in jax.tree.leaves((state.mu, state.nu))) == 50 * 8 * 3


def test_min_size_keeps_small_leaves_float32():
  tx = ak.sparse_adam(0.1, mu_dtype="8bit", nu_dtype="8bit")  # min_size 4096
  state = _moments(tx.init({"big": jnp.zeros((64, 64)), "small": jnp.zeros((63, 64))}))
  assert state.mu["big"].codes.shape == (64, 64) and state.mu["big"].scales.shape == (64, 1)
  assert state.mu["small"].dtype == jnp.float32 and state.mu["small"].shape == (63, 64)


# ------------------------------------------------------- against the reference

N, D = 12, 64


def _run_against_reference(kinds, block, *, lazy=True, adamw=False, steps=3, seed=0,
                           eps_mode="hat"):
  rng = np.random.default_rng(seed)
  w0 = rng.normal(size=(N, D)).astype(np.float32)
  dense0 = rng.normal(size=(8, D)).astype(np.float32)
  lr, wd = 0.05, 0.1
  if adamw:
    tx = ak.sparse_adamw(lr, weight_decay=wd, weight_decay_mask=None, lazy=lazy,
                         eps_mode=eps_mode, mu_dtype=fmt(kinds[0], block),
                         nu_dtype=fmt(kinds[1], block))
  else:
    tx = ak.sparse_adam(lr, weight_decay=wd, weight_decay_mask=None, lazy=lazy,
                        eps_mode=eps_mode, mu_dtype=fmt(kinds[0], block),
                        nu_dtype=fmt(kinds[1], block))
  params = {"emb": jnp.asarray(w0), "w": jnp.asarray(dense0)}
  state = tx.init(params)
  step = _step(tx)
  b = block or D
  ref = {"emb": (w0, np.zeros((N, D)), np.zeros((N, D))),
         "w": (dense0, np.zeros((8, D)), np.zeros((8, D)))}
  kw = dict(kinds=kinds, block=b, lr=lr, wd=wd, decoupled=adamw, eps_mode=eps_mode)
  for t in range(1, steps + 1):
    ids = rng.integers(0, N, size=6)
    ge = rng.normal(size=(6, D)).astype(np.float32) * 10.0 ** rng.uniform(-3, 1, size=(6, 1))
    gd = rng.normal(size=(8, D)).astype(np.float32)
    grads = {"emb": ak.RowSparse(ids, ge.astype(np.float32), N), "w": jnp.asarray(gd)}
    before = (params, state)
    params, state = step(grads, state, params)
    s = _moments(state)
    for name, (i, g, is_lazy) in {"emb": (ids, ge, lazy), "w": (np.arange(8), gd, False)}.items():
      # the reference starts from the implementation's stored state, read back by itself
      s0 = _moments(before[1])
      w_prev = np.asarray(before[0][name], np.float64)
      m_prev, v_prev = ref_decode(s0.mu[name]), ref_decode(s0.nu[name])
      w, m, v, m_new, v_new, rows = ref_lazy_step(w_prev, m_prev, v_prev, i, g, t, lazy=is_lazy,
                                                  **kw)
      # the update comes from the new float moments: float32 rounding only
      np.testing.assert_allclose(np.asarray(params[name], np.float64) - w_prev, w - w_prev,
                                 rtol=1e-5, atol=2e-6, err_msg=f"{name} step {t}")
      got_m, got_v = ref_decode(s.mu[name]), ref_decode(s.nu[name])
      assert_stored_close(got_m[rows], m[rows], m_new, kinds[0], "mu", b, f"m {name} {t}")
      assert_stored_close(got_v[rows], v[rows], v_new, kinds[1], "nu", b, f"v {name} {t}")
      untouched = np.setdiff1d(np.arange(w.shape[0]), rows)
      np.testing.assert_array_equal(got_m[untouched], m_prev[untouched])
      ref[name] = (w, m, v)
  return params, state


@pytest.mark.parametrize("kinds", [("8bit", "8bit"), ("4bit", "4bit"), ("fp8", "fp8"),
                                   ("8bit", "4bit")])
@pytest.mark.parametrize("block", [None, 32])
def test_lazy_step_against_float64_reference(kinds, block):
  """Table rows of 64: one scale per row (default) or two blocks of 32 per row."""
  _run_against_reference(kinds, block)


@pytest.mark.parametrize("kinds", [("8bit", "8bit"), ("4bit", "4bit")])
def test_lazy_adamw_against_float64_reference(kinds):
  _run_against_reference(kinds, None, adamw=True, eps_mode="corrected")


@pytest.mark.parametrize("kinds", [("8bit", "8bit"), ("4bit", "4bit"), ("fp8", "fp8")])
def test_non_lazy_against_float64_reference(kinds):
  """lazy=False: every row moves (absent rows with a zero gradient) and is requantized."""
  _run_against_reference(kinds, None, lazy=False)


def test_8bit_trajectory_stays_near_float32():
  """20 lazy steps of 8-bit sparse Adam against float32 sparse Adam (rows of 64, one scale
  each), where the rows move about 2 lr on average: measured 0.02 lr mean and 0.15-0.18 lr
  largest difference over three seeds; the bounds leave about 1.5x of that."""
  rng = np.random.default_rng(1)
  params = {"emb": jnp.asarray(rng.normal(size=(40, 64)), jnp.float32)}
  out = []
  for kw in (dict(mu_dtype=fmt("8bit"), nu_dtype=fmt("8bit")), {}):
    tx = ak.sparse_adam(0.01, **kw)
    step, p, s = _step(tx), params, tx.init(params)
    r = np.random.default_rng(2)
    for _ in range(20):
      ids = r.integers(0, 40, size=16)
      p, s = step({"emb": ak.RowSparse(ids, r.normal(size=(16, 64)).astype(np.float32), 40)},
                  s, p)
    out.append(np.asarray(p["emb"]))
  diff = np.abs(out[0] - out[1]) / 0.01
  assert diff.mean() < 0.03 and diff.max() < 0.25, (diff.mean(), diff.max())


# -------------------------------------------------------------------- properties

NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)  # a failure is printed as found
M, W = 10, 16  # a small table: rows of 16, one scale each
ids_st = st.lists(st.integers(0, M - 1), min_size=5, max_size=5)


def _values(ids, seed, width=W):
  return np.random.default_rng(seed).normal(size=(len(ids), width)).astype(np.float32)


@functools.cache
def _tx(kind, lazy=True, **kw):
  return ak.sparse_adam(0.1, weight_decay=0.01, lazy=lazy, mu_dtype=fmt(kind),
                        nu_dtype=fmt(kind), **kw)


@settings(max_examples=12, deadline=None, derandomize=True, phases=NO_SHRINK)
@given(ids1=ids_st, ids2=ids_st, seed=st.integers(0, 2**16), kind=st.sampled_from(KINDS))
def test_lazy_leaves_untouched_rows_codes_and_scales_bit_identical(ids1, ids2, seed, kind):
  w0 = np.random.default_rng(seed).normal(size=(M, W)).astype(np.float32)
  tx = _tx(kind)
  step = _step(tx)
  params = {"emb": jnp.asarray(w0)}
  state = tx.init(params)
  for ids in (ids1, ids2):
    before = (params, state)
    params, state = step({"emb": ak.RowSparse(np.array(ids), _values(ids, seed), M)}, state,
                         params)
  absent = np.setdiff1d(np.arange(M), ids2)
  old, new = _moments(before[1]), _moments(state)
  for q_old, q_new in ((old.mu["emb"], new.mu["emb"]), (old.nu["emb"], new.nu["emb"])):
    np.testing.assert_array_equal(np.asarray(q_new.codes)[absent], np.asarray(q_old.codes)[absent])
    np.testing.assert_array_equal(np.asarray(q_new.scales)[absent],
                                  np.asarray(q_old.scales)[absent])
    assert np.all(np.isfinite(np.asarray(q_new.scales)))
  np.testing.assert_array_equal(np.asarray(params["emb"])[absent],
                                np.asarray(before[0]["emb"])[absent])
  assert np.all(np.asarray(params["emb"])[np.unique(ids2)] != np.asarray(before[0]["emb"])[
      np.unique(ids2)])


@settings(max_examples=10, deadline=None, derandomize=True, phases=NO_SHRINK)
@given(ids=ids_st, seed=st.integers(0, 2**16), lazy=st.booleans(), kind=st.sampled_from(KINDS))
def test_duplicates_equal_their_summed_single_id(ids, seed, lazy, kind):
  """As in the float32 step: repeated ids are merged first (decay once per occurrence)."""
  vals = _values(ids, seed)
  uniq = np.unique(ids)
  summed = np.stack([vals[np.array(ids) == i].sum(0) for i in uniq])
  w0 = {"e": jnp.asarray(np.random.default_rng(seed).normal(size=(M, W)), jnp.float32)}
  tx = ak.sparse_adam(0.1, lazy=lazy, mu_dtype=fmt(kind), nu_dtype=fmt(kind))
  step = _step(tx)
  pa, sa = step({"e": ak.RowSparse(np.array(ids), vals, M)}, tx.init(w0), w0)
  pb, sb = step({"e": ak.RowSparse(uniq, summed, M)}, tx.init(w0), w0)
  np.testing.assert_allclose(np.asarray(pa["e"]), np.asarray(pb["e"]), rtol=0, atol=1e-6)
  for x, y in ((_moments(sa).mu["e"], _moments(sb).mu["e"]),
               (_moments(sa).nu["e"], _moments(sb).nu["e"])):
    np.testing.assert_allclose(np.asarray(x.scales), np.asarray(y.scales), rtol=1e-6)
    # summing in another order may move a value across a rounding boundary: one code
    assert np.mean(np.asarray(x.codes) == np.asarray(y.codes)) > 0.97


def test_unique_ids_fast_path_matches_default():
  w0 = {"e": jnp.asarray(np.random.default_rng(3).normal(size=(M, W)), jnp.float32)}
  g = {"e": ak.RowSparse(np.array([4, 1, 7]), _values([4, 1, 7], 3), M)}
  outs = [_step(tx)(g, tx.init(w0), w0) for tx in (_tx("8bit", unique_ids=True), _tx("8bit"))]
  jax.tree.map(np.testing.assert_array_equal, outs[0], outs[1])


@settings(max_examples=6, deadline=None, derandomize=True, phases=NO_SHRINK)
@given(ids1=ids_st, ids2=ids_st, seed=st.integers(0, 2**16), kind=st.sampled_from(KINDS))
def test_non_lazy_equals_the_dense_quantized_step_on_the_densified_gradient(ids1, ids2, seed,
                                                                            kind):
  """lazy=False on a RowSparse == the same optimizer given the dense gradient (the chain
  form's quantized step on a dense leaf, same layout): bit for bit. (No L2 decay here: on a
  RowSparse it is per occurrence, MindSpore's rule.)"""
  w0 = {"e": jnp.asarray(np.random.default_rng(seed).normal(size=(M, W)), jnp.float32)}
  tx = ak.sparse_adam(0.1, lazy=False, mu_dtype=fmt(kind), nu_dtype=fmt(kind))
  step = _step(tx)
  ps, ss = pd, sd = w0, tx.init(w0)
  for j, ids in enumerate((ids1, ids2)):
    g = ak.RowSparse(np.array(ids), _values(ids, seed + j), M)
    ps, ss = step({"e": g}, ss, ps)
    pd, sd = step({"e": g.todense()}, sd, pd)
  jax.tree.map(np.testing.assert_array_equal, (ps, ss), (pd, sd))


def test_amsgrad_keeps_its_maximum_in_nu_format_on_touched_rows():
  tx = ak.sparse_adam(0.1, b2=0.5, amsgrad=True, mu_dtype=fmt("8bit"), nu_dtype=fmt("4bit"))
  params = {"e": jnp.ones((M, W))}
  state = tx.init(params)
  s = _moments(state)
  assert isinstance(s, ak.ScaleByAmsgradState)
  assert s.nu_max["e"].fmt == s.nu["e"].fmt and s.nu["e"].fmt.kind == "4bit"
  step = _step(tx)
  params, state = step({"e": ak.RowSparse(np.array([1, 2]), 10 * np.ones((2, W), np.float32),
                                          M)}, state, params)
  params, state = step({"e": ak.RowSparse(np.array([2, 3]), 0.1 * np.ones((2, W), np.float32),
                                          M)}, state, params)
  s = _moments(state)
  vmax, v = ref_decode(s.nu_max["e"]), ref_decode(s.nu["e"])
  assert np.all(vmax[2] > 1.9 * v[2])  # row 2: the max of step 1 (50) stays, v halves
  np.testing.assert_array_equal(vmax[3], v[3])
  # row 1 untouched at step 2; rows never touched read back the zero-free map's floor
  assert np.all(vmax[1] > 49) and np.all(vmax[[0, 4]] < 1e-20)


# ---------------------------------------------------------------- cost, backend


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
def test_lazy_step_cost_is_o_of_touched_rows(kind):
  """A 250k x 64 table: the donated jitted step keeps no (N, D) temporary (its scratch is
  under 1/50 of the codes) and updates the table, codes and scales in place."""
  n, d = 250_000, 64
  tx = ak.sparse_adam(0.01, mu_dtype=kind, nu_dtype=kind)
  params = {"emb": jnp.zeros((n, d))}
  state = tx.init(params)
  ids = jnp.array([0, 17, 17, n - 1])
  grads = {"emb": ak.RowSparse(ids, jnp.ones((4, d)), n)}

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates), state

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
  mem = compiled.memory_analysis()
  code_bytes = n * d // (2 if kind == "4bit" else 1)
  if mem is not None:
    assert mem.temp_size_in_bytes < code_bytes // 50, mem.temp_size_in_bytes
    # table, codes and scales of m and v: outputs alias the donated inputs
    assert mem.alias_size_in_bytes >= n * d * 4 + 2 * (code_bytes + n * 4), mem.alias_size_in_bytes
  params, state = jax.jit(step, donate_argnums=(0, 1))(params, state, grads)
  moved = np.flatnonzero(np.any(np.asarray(params["emb"]) != 0, axis=1))
  assert moved.tolist() == [0, 17, n - 1]


def _kernel_and_xla(tx_of, params, grads_seq) -> dict:
  """Per backend ("kernel", "xla"): the params and state after ``grads_seq`` and whether
  the step's program calls the quantized row kernel."""
  out = {}
  for backend in ("kernel", "xla"):
    tx = tx_of(backend)
    step, p, state = _step(tx), params, tx.init(params)
    text = step.lower(grads_seq[0], state, p).as_text()
    for g in grads_seq:
      p, state = step(g, state, p)
    out[backend] = (p, state, "adamkit_cpu_sparse_lazy_quantized" in text)
  return out


@pytest.mark.parametrize("named,kw", [
    ("sparse_adam", {}), ("sparse_adam", dict(eps_mode="corrected", nesterov=True)),
    ("sparse_adam", dict(amsgrad=True)), ("sparse_adamw", dict(weight_decay=0.01))])
def test_8bit_row_kernel_is_the_xla_step_bit_for_bit(kernel, named, kw):
  """8-bit moments of a table whose rows are whole power-of-two blocks take the C++ row
  kernel (backend="kernel"; "auto" on one CPU device), which decodes, steps and encodes
  the touched rows only: the codes and scales of XLA's step to the last bit, over steps of
  unique ids, repeated ids (two occurrences: their sum is the same in any order) and a
  non-finite gradient; the params to float32 rounding (XLA contracts some multiply-adds of
  the direction into FMAs, the kernel does not, as in tests/test_sparse.py)."""
  rng = np.random.default_rng(3)
  params = {"e": jnp.asarray(rng.normal(size=(M, W)), jnp.float32)}
  seq = [[1, 4, 7], [0, 9, 2, 5], [3, 3, 8, 8, 6], [5, 1]]
  grads = [{"e": ak.RowSparse(np.array(ids), _values(ids, t) * 10.0 ** (t - 2), M)}
           for t, ids in enumerate(seq)]
  bad = _values(seq[-1], 9)
  bad[0, 3] = np.nan
  grads.append({"e": ak.RowSparse(np.array(seq[-1]), bad, M)})
  out = _kernel_and_xla(lambda backend: getattr(ak, named)(
      0.1, mu_dtype=fmt("8bit"), nu_dtype=fmt("8bit"), backend=backend, **kw), params, grads)
  assert out["kernel"][2] and not out["xla"][2]
  jax.tree.map(np.testing.assert_array_equal, out["kernel"][1], out["xla"][1])
  np.testing.assert_allclose(out["kernel"][0]["e"], out["xla"][0]["e"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mu,nu,width", [("4bit", "4bit", W), ("fp8", "fp8", W),
                                         ("8bit", None, W), ("8bit", "8bit", 12)])
def test_other_quantized_moments_run_in_xla_even_with_backend_kernel(kernel, mu, nu, width):
  """The row kernels take float32 moments, or 8-bit ones in power-of-two blocks: 4-bit,
  fp8, a float32 moment beside an 8-bit one and rows of 12 (one block of 12 each) go to
  XLA (rule 3 of adamkit._backend), with the same numbers as backend="xla"."""
  params = {"e": jnp.asarray(np.random.default_rng(0).normal(size=(M, width)), jnp.float32)}
  g = {"e": ak.RowSparse(np.array([1, 1, 5]), _values([1, 1, 5], 0, width), M)}
  out = _kernel_and_xla(lambda backend: ak.sparse_adam(
      0.1, mu_dtype=fmt(mu), nu_dtype=nu and fmt(nu), backend=backend), params, [g, g])
  assert not out["kernel"][2]
  jax.tree.map(np.testing.assert_array_equal, out["kernel"][:2], out["xla"][:2])


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_table_sharded_by_rows_keeps_codes_and_scales_sharded(axis_type):
  """A row-sharded table: codes and scales split by rows alike, before and after the
  jitted donated step (lazy and not), and the same numbers as on one device."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip("needs 8 (CPU) devices; tests/conftest.py asks for them")
  if axis_type == "auto":
    mesh = Mesh(np.array(devices[:8]), ("rows",))
  else:
    axis_types = getattr(jax.sharding, "AxisType", None)
    if axis_types is None:
      pytest.skip("this JAX has no explicit sharding")
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(axis_types.Explicit,))
  rows = NamedSharding(mesh, P("rows", None))
  rng = np.random.default_rng(7)
  w0 = rng.normal(size=(64, 32)).astype(np.float32)
  # TODO(issue 19): lazy=False on Explicit axes fails in _quant's decode (a code-book gather
  # indexed by row-sharded codes, which JAX refuses without an out_sharding).
  for lazy in (True, False) if axis_type == "auto" else (True,):
    tx = ak.sparse_adam(0.1, lazy=lazy, weight_decay=0.01, mu_dtype=fmt("8bit"),
                        nu_dtype=fmt("4bit"))

    def step(params, state, ids, vals, tx=tx):
      updates, state = tx.update({"e": ak.RowSparse(ids, vals, 64)}, state, params)
      return ak.apply_updates(params, updates), state

    sharded, plain = {"e": jax.device_put(w0, rows)}, {"e": jnp.asarray(w0)}
    s_state, p_state = tx.init(sharded), tx.init(plain)

    def check(state):
      for q in (_moments(state).mu["e"], _moments(state).nu["e"]):
        assert q.codes.sharding.is_equivalent_to(NamedSharding(mesh, P("rows", None, None)), 3)
        assert q.scales.sharding.is_equivalent_to(NamedSharding(mesh, P("rows", None)), 2)

    check(s_state)
    jstep = jax.jit(step, donate_argnums=(0, 1))
    for _ in range(2):
      ids = jnp.asarray(rng.integers(0, 64, size=12))
      vals = jnp.asarray(rng.normal(size=(12, 32)), jnp.float32)
      sharded, s_state = jstep(sharded, s_state, ids, vals)
      plain, p_state = jax.jit(step)(plain, p_state, ids, vals)
    check(s_state)
    assert sharded["e"].sharding.is_equivalent_to(rows, 2)
    np.testing.assert_allclose(np.asarray(sharded["e"]), np.asarray(plain["e"]), rtol=0,
                               atol=1e-6)


# ----------------------------------------------------------- non-finite gradients


def _nan_grads():
  vals = _values([1, 4], 0)
  vals[0, 3] = np.nan
  vals[1, 0] = np.inf
  return {"e": ak.RowSparse(np.array([1, 4]), vals, M)}


@pytest.mark.parametrize("kind", KINDS)
def test_propagate_nonfinite_leaves_no_nan_scale(kind):
  params = {"e": jnp.ones((M, W))}
  tx = ak.sparse_adam(0.1, mu_dtype=fmt(kind), nu_dtype=fmt(kind))
  p, state = _step(tx)(_nan_grads(), tx.init(params), params)
  assert not np.all(np.isfinite(np.asarray(p["e"])[[1, 4]]))  # the update carries it
  s = _moments(state)
  for q in (s.mu["e"], s.nu["e"]):
    assert np.all(np.isfinite(np.asarray(q.scales)))
    assert np.all(np.isfinite(ref_decode(q)))
  # the next, finite step works from finite moments on the finite elements
  p2, _ = _step(tx)({"e": ak.RowSparse(np.array([1]), _values([1], 1), M)}, state,
                    {"e": jnp.ones((M, W))})
  assert np.all(np.isfinite(np.asarray(p2["e"])))


@pytest.mark.parametrize("kind", KINDS)
def test_skip_nonfinite_keeps_state_and_params(kind):
  params = {"e": jnp.ones((M, W))}
  tx = ak.sparse_adam(0.1, mu_dtype=fmt(kind), nu_dtype=fmt(kind), nonfinite="skip")
  state = tx.init(params)
  p, state2 = _step(tx)(_nan_grads(), state, params)
  np.testing.assert_array_equal(np.asarray(p["e"]), np.asarray(params["e"]))
  jax.tree.map(np.testing.assert_array_equal, _moments(state2), _moments(state))


# --------------------------------------------------------------------- offload


@needs_host
def test_offloaded_state_moves_only_the_touched_rows_codes():
  n, d = 64, 32
  params = jax.device_put({"emb": jnp.linspace(-1, 1, n * d).reshape(n, d)}, jax.devices()[0])

  def make():
    return ak.sparse_adam(0.05, mu_dtype=fmt("8bit"), nu_dtype=fmt("8bit"))

  tx, ref = ak.offload(make(), mode="state"), make()

  def step_with(t):
    def step(params, state, ids):
      grads = {"emb": ak.RowSparse(ids, jnp.cos(ids.astype(jnp.float32))[:, None]
                                   * jnp.ones((1, d)), n)}
      updates, state = t.update(grads, state, params)
      return ak.apply_updates(params, updates), state
    return step

  ids0 = jnp.array([3, 3, 10, 63], jnp.int32)
  moved = transfers(step_with(tx), params, tx.init(params), ids0)
  for direction in ("to_device", "to_host"):
    shapes = [a.shape for a in moved[direction]]
    assert (n, d) not in shapes and (n, 1) not in shapes, shapes
    assert shapes.count((4, d)) == 2 and shapes.count((4, 1)) == 2, shapes  # m, v rows
  rp, rs = params, ref.init(params)
  p = jax.tree.map(jnp.copy, params)
  s = tx.init(p)
  step, ref_step = jax.jit(step_with(tx), donate_argnums=(0, 1)), jax.jit(step_with(ref))
  for ids in ([3, 3, 10, 63], [10, 0, 5, 5], [99, 3, 7, 7]):
    ids = jnp.array(ids, jnp.int32)
    p, s = step(p, s, ids)
    rp, rs = ref_step(rp, rs, ids)
  jax.tree.map(np.testing.assert_array_equal, (p, s), (rp, rs))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(s) if x.ndim} == {"pinned_host"}


# ------------------------------------------------------------------- bad input


def test_bad_input_names_the_argument_or_leaf():
  params = {"emb": jnp.zeros((M, W))}
  with pytest.raises(TypeError, match="mu_dtype"):
    ak.sparse_adam(0.1, mu_dtype="3bit")
  with pytest.raises(TypeError, match="nu_dtype"):
    ak.sparse_adamw(0.1, nu_dtype="9bit")
  with pytest.raises(TypeError, match="mu_dtype"):
    ak.scale_by_sparse_adam(mu_dtype=jnp.int8)
  with pytest.raises(TypeError, match="leaf 'c'"):
    ak.sparse_adam(0.1, mu_dtype=fmt("8bit")).init({"c": jnp.zeros((4, 4), jnp.complex64)})
  g = {"emb": ak.RowSparse(np.array([1]), np.ones((1, W), np.float32), M)}
  # a state quantized with another block size, another format, or not at all
  for made, used in ((fmt("8bit", 8), fmt("8bit")), (fmt("4bit"), fmt("8bit")),
                     (None, fmt("8bit")), (fmt("8bit"), None)):
    state = ak.scale_by_sparse_adam(mu_dtype=made).init(params)
    with pytest.raises(ValueError, match="first moment of 'emb'.*another"):
      ak.scale_by_sparse_adam(mu_dtype=used).update(g, state)
  # a 1-D table's blocks span several rows: no lazy row step on them
  tx = ak.scale_by_sparse_adam(mu_dtype=fmt("8bit", 4), nu_dtype=fmt("8bit", 4))
  state = tx.init({"v": jnp.zeros((16,))})
  with pytest.raises(ValueError, match="spanning several rows"):
    tx.update({"v": ak.RowSparse(np.array([1]), np.ones((1,), np.float32), 16)}, state)


def test_optax_idioms_around_the_quantized_sparse_step():
  """inject_hyperparams and apply_if_finite keep working on a quantized state."""
  params = {"emb": jnp.ones((M, W)), "w": jnp.ones((4, 8))}
  g = {"emb": ak.RowSparse(np.array([1, 2]), _values([1, 2], 0), M), "w": jnp.ones((4, 8))}
  plain = _tx("8bit")
  injected = optax.inject_hyperparams(lambda lr: ak.sparse_adam(
      lr, weight_decay=0.01, mu_dtype=fmt("8bit"), nu_dtype=fmt("8bit")))(lr=0.1)
  a = _step(plain)(g, plain.init(params), params)
  b = _step(injected)(g, injected.init(params), params)
  jax.tree.map(np.testing.assert_array_equal, a[0], b[0])
  jax.tree.map(np.testing.assert_array_equal, a[1], b[1].inner_state)
