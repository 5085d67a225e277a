"""Issue 32's findings on the low-memory release: quantized states that enter from outside,
bad scales in the step, the chain form's and the fused steps' state checks,
``ak.param_rounding``'s own state, bfloat16 stochastic rounding of tiny values, the
messages for misspelt formats and the documented temporaries of the chain step.

Each test failed on the code before the fix (the issue's reproductions, reduced)."""

import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adamkit as ak
from adamkit import _backend, _quant, _validate

KINDS = ("8bit", "4bit", "fp8")
SHAPE = (8, 256)


def q(kind: str, **kw) -> ak.Quantized:
  return ak.Quantized(kind, min_size=0, **kw)


def params_grads(shape=SHAPE):
  params = {"w": jax.random.normal(jax.random.key(1), shape), "b": jnp.zeros(3)}
  grads = {"w": jax.random.normal(jax.random.key(2), shape), "b": jnp.ones(3)}
  return params, grads


def stepped(tx, steps: int = 2):
  """params, grads and ``tx``'s state after ``steps`` updates (non-zero moments)."""
  params, grads = params_grads()
  state = tx.init(params)
  for _ in range(steps):
    _, state = tx.update(grads, state, params)
  return params, grads, state


def edit(state, role: str, codes=None, scales=None):
  """``state`` with the quantized moments of ``role`` rebuilt: ``codes(np codes)`` and
  ``scales(np scales)`` give the new arrays (NumPy, copied)."""
  def f(x):
    if not (_quant.is_qarray(x) and x.fmt.role == role and x.shape != (3,)):  # 'w' (or a buffer)
      return x
    c = np.array(x.codes) if codes is None else codes(np.array(x.codes))
    s = np.array(x.scales) if scales is None else scales(np.array(x.scales))
    return _quant.QuantizedArray(jnp.asarray(c), jnp.asarray(s), x.shape, x.fmt)
  return jax.tree.map(f, state, is_leaf=_quant.is_qarray)


def set_first_scale(value):
  def f(s):
    s.reshape(-1)[0] = value
    return s
  return f


BAD_SCALES = {"negative": None, "nan": np.nan, "inf": np.inf}


def bad_scale(name: str):
  """A setter of the first block's scale: minus itself, NaN or Inf."""
  if name == "negative":
    def f(s):
      s.reshape(-1)[0] = -s.reshape(-1)[0]
      return s
    return f
  return set_first_scale(BAD_SCALES[name])


# ------------------------------------------------------------ states entering from outside


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("role", ["mu", "nu"])
@pytest.mark.parametrize("bad", list(BAD_SCALES))
def test_offload_state_refuses_a_bad_scale_naming_the_leaf(kind, role, bad):
  params, _, state = stepped(ak.adam(1e-2, mu_dtype=q(kind), nu_dtype=q(kind)))
  broken = edit(state, role, scales=bad_scale(bad))
  with pytest.raises(ValueError, match=rf"offload_state: .*'[^']*{role}\.w'.* scale .*block 0"):
    ak.offload_state(jax.tree.map(np.asarray, broken), params)
  ak.offload_state(jax.tree.map(np.asarray, state), params)  # the intact state goes through


def test_offload_state_names_the_param_of_a_bad_block_in_a_multi_tensor_buffer():
  params, _ = params_grads()  # "b" takes block 0 of the flat buffer, "w" blocks 1..8
  tx = ak.fused_adamw(1e-2, mu_dtype=q("8bit"), nu_dtype=q("8bit"))
  state = tx.init(params)
  broken = edit(state, "nu", scales=lambda s: np.where(np.arange(s.size) == 3, np.float32(np.nan), s))
  with pytest.raises(ValueError, match=r"'nu\.8bit' has scale nan in block 3 \(param 'w'\)"):
    ak.offload_state(jax.tree.map(np.asarray, broken), params)


# Codes each format's encoder never writes, and what they read back as before the check.
BAD_CODES = {("4bit", "mu"): 0x0F, ("fp8", "mu"): 0x7F, ("fp8", "nu"): 0x81}


@pytest.mark.parametrize("kind,role", list(BAD_CODES))
def test_offload_state_refuses_codes_off_the_code_book(kind, role):
  params, _, state = stepped(ak.adam(1e-2, mu_dtype=q(kind), nu_dtype=q(kind)))

  def corrupt(c):
    c.reshape(-1)[5] = BAD_CODES[(kind, role)]
    return c

  with pytest.raises(ValueError, match=rf"'[^']*{role}\.w' \('{kind}', role '{role}'\) has code "
                                       r"0x[0-9a-f]+ at byte 5"):
    ak.offload_state(jax.tree.map(np.asarray, edit(state, role, codes=corrupt)), params)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("role", ["mu", "nu"])
def test_a_code_is_accepted_exactly_when_it_reads_back_inside_its_range(kind, role):
  """Every byte value, as a whole block of codes: the check accepts it exactly when the
  decoder reads it back within [-1, 1] (first moment) or [0, 1] (second moment)."""
  fmt = _quant.Format(kind, role, 2)
  for byte in range(256):
    codes = jnp.full((1, 1), byte, jnp.uint8) if fmt.packed else jnp.full((1, 2), byte, jnp.uint8)
    arr = _quant.QuantizedArray(codes, jnp.ones(1, jnp.float32), (2,), fmt)
    r = np.asarray(_quant._decode(_quant._unpack4(codes, 2) if fmt.packed else codes, fmt))
    if role == "nu" and kind != "8bit":
      r = np.sign(r) * r * r  # sqrt(v) codes: the value is the square, of the sign's code
    inside = bool(np.all((r >= (-1 if role == "mu" else 0)) & (r <= 1)))
    try:
      _validate.check_quantized_values(arr, "w")
      accepted = True
    except ValueError:
      accepted = False
    assert accepted == inside, (kind, role, byte, r)


@pytest.mark.parametrize("field,change", [
    ("codes", lambda c: c.astype(np.int32)), ("codes", lambda c: c.reshape(-1)),
    ("scales", lambda s: s.astype(np.float16)), ("scales", lambda s: s[..., :0])])
def test_offload_state_refuses_codes_and_scales_of_another_layout(field, change):
  params, _, state = stepped(ak.adam(1e-2, mu_dtype=q("8bit"), nu_dtype=q("8bit")))
  broken = edit(state, "nu", **{field: change})
  with pytest.raises(ValueError, match=rf"'[^']*nu\.w'.* has {field} of dtype"):
    ak.offload_state(jax.tree.map(np.asarray, broken), params)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("entry,value", [("moment1", np.nan), ("moment2", np.inf),
                                         ("moment2", -1e-3)])
def test_load_state_dict_refuses_values_the_format_cannot_store(kind, entry, value):
  """Before: NaN, Inf and a negative second moment were stored as 0 without a word."""
  tx = ak.adam(1e-2, mu_dtype=q(kind), nu_dtype=q(kind))
  params, _, state = stepped(tx)
  flat = ak.state_dict(state)
  flat[f"w.{entry}"] = flat[f"w.{entry}"].copy()
  flat[f"w.{entry}"][3, 7] = value
  with pytest.raises(ValueError, match=rf"load_state_dict: 'w\.{entry}' holds .* at index "
                                       r"\(3, 7\)"):
    ak.load_state_dict(flat, tx.init(params))
  ak.load_state_dict(ak.state_dict(state), tx.init(params))  # the intact dict loads


def test_from_paddle_state_refuses_a_nan_moment_for_a_quantized_state():
  params, _ = params_grads()
  tx = ak.adam(1e-2, mu_dtype=q("8bit"), nu_dtype=q("8bit"))
  m = np.zeros(SHAPE, np.float32)
  m[0, 0] = np.nan
  pdopt = {"w_moment1_0": m, "w_moment2_0": np.ones(SHAPE, np.float32),
           "b_moment1_0": np.zeros(3), "b_moment2_0": np.zeros(3)}
  with pytest.raises(ValueError, match=r"'w_moment1_0': the moment holds nan at index \(0, 0\)"):
    ak.from_paddle_state(pdopt, params, tx, step=3)


# ------------------------------------------------------------------ bad scales in the step


def zeroed_first_block(state, role):
  return edit(state, role, scales=set_first_scale(0.0))


def assert_same_step(tx, params, grads, broken, reference):
  """One jitted step from ``broken`` equals the step from ``reference`` (the documented
  reading of a bad scale: its block as zeros), params finite."""
  def step(state):
    u, new = tx.update(grads, state, params)
    return optax.apply_updates(params, u), new

  got, want = jax.jit(step)(broken), jax.jit(step)(reference)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got[0]))
  # XLA may contract a product and a sum differently in the two runs: params within a
  # float32 rounding or two, the stored codes the same but where that flips a rounding
  for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=5e-7, atol=0)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    assert np.mean(np.asarray(a) != np.asarray(b)) <= 0.01


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("role", ["mu", "nu"])
@pytest.mark.parametrize("form,bad", [("chain", "negative"), ("chain", "nan"), ("chain", "inf"),
                                      ("fused", "nan"), ("fused_multi_tensor", "negative")])
def test_a_bad_scale_reads_as_a_zero_block_in_the_step(kind, role, bad, form):
  """Before: a NaN/Inf scale made the block's params NaN, a negative one flipped m (or made
  sqrt(v) NaN). docs/low_memory.md: such a block reads back as zeros."""
  kw = dict(mu_dtype=q(kind), nu_dtype=q(kind))
  tx = {"chain": lambda: ak.adamw(1e-2, **kw),
        "fused": lambda: ak.fused_adamw(1e-2, multi_tensor=False, backend="xla", **kw),
        "fused_multi_tensor": lambda: ak.fused_adamw(1e-2, backend="xla", **kw)}[form]()
  params, grads, state = stepped(tx)
  assert_same_step(tx, params, grads, edit(state, role, scales=bad_scale(bad)),
                   zeroed_first_block(state, role))


@pytest.mark.parametrize("role", ["mu", "nu"])
@pytest.mark.parametrize("form", ["chain", "fused"])
def test_a_bad_scale_reads_as_a_zero_block_on_the_kernel(kernel, role, form):
  """The C++ kernel's 8-bit paths (chain: the new codes; fused: the whole step) get the
  scales read as the XLA decoder reads them."""
  kw = dict(mu_dtype=q("8bit"), nu_dtype=q("8bit"))
  tx = (ak.adamw(1e-2, **kw) if form == "chain"
        else ak.fused_adamw(1e-2, backend="kernel", **kw))
  shape = (128, 256)  # the chain's kernel takes leaves of at least 2**15 elements
  params = {"w": jax.random.normal(jax.random.key(1), shape)}
  grads = {"w": jax.random.normal(jax.random.key(2), shape)}
  state = tx.init(params)
  _, state = tx.update(grads, state, params)
  assert_same_step(tx, params, grads, edit(state, role, scales=set_first_scale(np.nan)),
                   zeroed_first_block(state, role))


# --------------------------------------------------------- the chain form's state checks


CHAINS = {"adam": ak.adam, "adamw": ak.adamw, "adamax": ak.adamax, "sparse_adam": ak.sparse_adam}


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("field,change", [
    ("codes", lambda c: c.astype(np.int32)), ("scales", lambda s: s.reshape(-1)),
    ("scales", lambda s: s.astype(np.float16))])
def test_chain_form_names_the_field_and_leaf_of_a_bad_codes_or_scales_array(name, field, change):
  """Before: int32 codes stepped on silently; other shapes failed inside XLA naming
  neither the field nor the leaf."""
  tx = CHAINS[name](1e-2, mu_dtype=q("8bit"), nu_dtype=q("8bit"))
  params, grads, state = stepped(tx)
  broken = edit(state, "nu", **{field: change})
  with pytest.raises(ValueError, match=rf"the quantized moment of 'w'.* has {field} of dtype"):
    tx.update(grads, broken, params)
  with pytest.raises(ValueError, match=rf"the quantized moment of 'w'.* has {field} of dtype"):
    jax.jit(tx.update)(grads, broken, params)


def test_codes_of_the_old_blocked_layout_are_refused_with_the_reshape_that_converts_them():
  """adamkit 0.2 stored the codes of a leaf whose last axis is whole blocks as ``(...,
  blocks, block)``; now in the leaf's shape (the same bytes). An old state is refused, the
  message giving the reshape, which steps exactly as the new state does."""
  tx = ak.adamw(1e-2, mu_dtype=q("8bit"), nu_dtype=q("8bit"))
  params, grads, state = stepped(tx)
  w = params["w"].shape
  old = edit(state, "nu", codes=lambda c: c.reshape(w[:-1] + (w[-1] // 256, 256)))
  with pytest.raises(ValueError, match=re.escape(f"`codes.reshape({tuple(w)})` converts")):
    tx.update(grads, old, params)
  fixed = edit(old, "nu", codes=lambda c: c.reshape(w))
  assert_same_step(tx, params, grads, fixed, state)


def swap_moments(state):
  """``state`` with its first and second moments swapped (an importer's mix-up)."""
  if hasattr(state, "_fields"):
    return state._replace(mu=state.nu, nu=state.mu) if "mu" in state._fields else state
  if isinstance(state, tuple):
    return tuple(swap_moments(s) for s in state)
  return state


@pytest.mark.parametrize("multi_tensor", [False, True])
def test_fused_step_refuses_a_first_moment_in_the_second_moments_format(multi_tensor):
  """Before: kind, block and shape matched, so the signed code book was read unsigned."""
  q8 = q("8bit")
  tx = ak.fused_adamw(1e-2, mu_dtype=q8, nu_dtype=q8, multi_tensor=multi_tensor)
  params, grads, state = stepped(tx)
  swapped = swap_moments(state)
  where = r"multi-tensor state's mu buffers" if multi_tensor else r"state\.mu of '[bw]'"
  with pytest.raises(ValueError, match=rf"{where}.*'nu'"):
    tx.update(grads, swapped, params)
  with pytest.raises(ValueError, match=rf"{where}.*'nu'"):
    tx.step(params, swapped, grads=grads)


def test_chain_form_refuses_swapped_moments():
  tx = ak.adamw(1e-2, mu_dtype=q("8bit"), nu_dtype=q("8bit"))
  params, grads, state = stepped(tx)
  with pytest.raises(ValueError, match="first moment of '[bw]' is stored as '8bit' codes of a "
                                      r"second moment's \(unsigned\) code book"):
    tx.update(grads, swap_moments(state), params)


# ------------------------------------------------------------ param_rounding's own state


def bf16_setup():
  params = {"w": jnp.ones((4, 8), jnp.bfloat16), "f": jnp.ones(3)}
  grads = {"w": jnp.full((4, 8), 0.1, jnp.bfloat16), "f": jnp.ones(3)}
  return params, grads


@pytest.mark.parametrize("form", ["wrapper", "fused"])
@pytest.mark.parametrize("comp", [lambda c: c[:1, :1], lambda c: c.astype(jnp.float32)])
def test_param_rounding_refuses_a_kahan_buffer_of_another_shape_or_dtype(form, comp):
  """Before: the wrapper broadcast a (1, 1) buffer and used a float32 one as it was."""
  params, grads = bf16_setup()
  tx = (ak.param_rounding(ak.adam(1e-2), "kahan") if form == "wrapper"
        else ak.fused_adamw(1e-2, param_rounding="kahan"))
  state = tx.init(params)
  state = state._replace(compensation={**state.compensation, "w": comp(state.compensation["w"])})
  with pytest.raises(ValueError, match="Kahan buffer of 'w' is"):
    tx.update(grads, state, params)
  if form == "fused":
    with pytest.raises(ValueError, match="Kahan buffer of 'w' is"):
      tx.step(params, state, grads=grads)


@pytest.mark.parametrize("form", ["wrapper", "fused"])
@pytest.mark.parametrize("key", [lambda w: w.astype(jnp.int32), lambda w: w.astype(jnp.float32),
                                 lambda w: jnp.stack([w, w])])
def test_param_rounding_refuses_a_stochastic_key_of_another_dtype(form, key):
  params, grads = bf16_setup()
  tx = (ak.param_rounding(ak.adam(1e-2), "stochastic") if form == "wrapper"
        else ak.fused_adamw(1e-2, param_rounding="stochastic"))
  state = tx.init(params)
  state = state._replace(key=tuple(key(w) for w in state.key))
  with pytest.raises(TypeError, match="state.key must be two uint32 scalars"):
    tx.update(grads, state, params)
  if form == "fused":
    with pytest.raises(TypeError, match="state.key must be two uint32 scalars"):
      tx.step(params, state, grads=grads)


def test_param_rounding_accepts_its_own_states():
  params, grads = bf16_setup()
  for method in ("kahan", "stochastic", "nearest"):
    for tx in (ak.param_rounding(ak.adam(1e-2), method),
               ak.fused_adamw(1e-2, param_rounding=method)):
      state = tx.init(params)
      for _ in range(2):
        _, state = jax.jit(tx.update)(grads, state, params)


# ------------------------------------------------------------- stochastic rounding, tiny x


def bf16_neighbours(x: np.float32) -> tuple[float, float]:
  """The bfloat16 values around float32 ``x > 0``, in float64 (NumPy, from the bits)."""
  bits = np.array([x], np.float32).view(np.uint32)[0]
  lo = np.array([bits & 0xFFFF0000], np.uint32).view(np.float32)[0]
  hi = np.array([(bits & 0xFFFF0000) + 0x10000], np.uint32).view(np.float32)[0]
  return float(lo), float(hi)


@pytest.mark.parametrize("value", [1e-39, 1e-37, 1e-30, 1.0 + 2.0**-10, 3.3e-3])
def test_stochastic_round_to_bf16_is_unbiased_down_to_the_subnormals(value):
  """Before: mean SR(x)/x = 1.0102 at 1e-39 (the gap between x's neighbours, a float32
  subnormal, was flushed on CPU and every draw took the same neighbour)."""
  x = np.float32(value)
  lo, hi = bf16_neighbours(x)
  p = (float(x) - lo) / (hi - lo)  # float64: the exact probability of rounding up
  n_keys, per_key = 8, 4000
  draws = np.concatenate([
      np.asarray(ak.stochastic_round(jnp.full(per_key, x), jnp.bfloat16, jax.random.key(k)),
                 np.float64) for k in range(n_keys)])
  assert set(np.unique(draws)) <= {lo, hi}
  n = draws.size
  sd = (hi - lo) * math.sqrt(p * (1 - p) / n)
  assert abs(draws.mean() - float(x)) <= 5 * sd + 1e-12 * float(x), (draws.mean(), float(x), sd)
  assert abs(draws.mean() / float(x) - 1) < 0.002


def test_stochastic_round_decision_is_on_the_bit_patterns():
  """The C++ kernel's rule: up exactly when ``bits >> 16 < (bits(|x|) & 0xFFFF)``, for
  every sign, with the threefry bits of :func:`adamkit.stochastic_round`."""
  from adamkit import _rounding
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.standard_normal(2000) * 10.0 ** rng.integers(-44, 30, 2000),
                      [0.0, -0.0, 1e-45, -1e-45]]).astype(np.float32)
  key = jax.random.key(3)
  k0, k1 = _rounding._key_words(key, "key")
  rand = np.asarray(_rounding.element_bits((k0, k1), x.shape))
  bits = x.view(np.uint32)
  mag = bits & 0x7FFFFFFF
  want = (((mag >> 16) + ((rand >> 16) < (mag & 0xFFFF))) << 16) | (bits & 0x80000000)
  got = np.asarray(ak.stochastic_round(jnp.asarray(x), jnp.bfloat16, key)).view(np.uint16)
  np.testing.assert_array_equal(got.astype(np.uint32) << 16, want.astype(np.uint32))


# ------------------------------------------------------------------------------ messages


MU_DTYPE_TAKERS = {
    "adam": ak.adam, "adamw": ak.adamw, "adamax": ak.adamax, "sparse_adam": ak.sparse_adam,
    "sparse_adamw": ak.sparse_adamw, "fused_adam": ak.fused_adam, "fused_adamw": ak.fused_adamw,
    "fused_adamax": ak.fused_adamax, "adam_offload": ak.adam_offload,
    "scale_by_adam": ak.scale_by_adam, "scale_by_adamax": ak.scale_by_adamax,
    "scale_by_sparse_adam": ak.scale_by_sparse_adam}


@pytest.mark.parametrize("name", list(MU_DTYPE_TAKERS))
@pytest.mark.parametrize("value,hint", [("8-bit", "'8bit'"), ("int8", "'8bit'"),
                                        ("4_bit", "'4bit'"), ("float8", "'fp8'")])
def test_a_misspelt_moment_format_names_the_argument_and_the_kinds(name, value, hint):
  """Before: "8-bit" gave numpy's 'format number 1 of "8-bit" is not recognized'; "int8"
  a floating-point dtype required, without "8bit"."""
  with pytest.raises(TypeError, match=rf"`mu_dtype`={value!r}.*{hint}.*'8bit', '4bit', "
                                      r"'fp8', an ak\.Quantized"):
    MU_DTYPE_TAKERS[name](mu_dtype=value)


@pytest.mark.parametrize("value", [jnp.int8, "uint16", "bogus"])
def test_other_bad_moment_formats_list_the_accepted_ones(value):
  with pytest.raises(TypeError, match=r"nu_dtype.*'8bit', '4bit', 'fp8', an ak\.Quantized"):
    ak.adamw(nu_dtype=value)


@pytest.mark.parametrize("name", list(MU_DTYPE_TAKERS))
def test_bitsandbytes_min_8bit_size_points_to_quantized_min_size(name):
  with pytest.raises(TypeError, match=r"'min_8bit_size'; adamkit's is `mu_dtype=ak\.Quantized"
                                      r"\('8bit', min_size=n\)`"):
    MU_DTYPE_TAKERS[name](min_8bit_size=4096)


# --------------------------------------------------- the documented temporaries of a step


DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "low_memory.md"
TABLE_HEAD = "| leaf shape | `\"8bit\"` | `\"4bit\"` | `\"fp8\"` |"


def documented_temporaries() -> dict[tuple, dict[str, float]]:
  """The table under ``TABLE_HEAD`` in docs/low_memory.md: ``{shape: {kind: bytes}}``."""
  lines = DOC.read_text().splitlines()
  start = lines.index(TABLE_HEAD) + 2
  table = {}
  for line in lines[start:]:
    if not line.startswith("|"):
      break
    cells = [c.strip() for c in line.strip("|").split("|")]
    shape = tuple(int(d) for d in re.findall(r"\d+", cells[0].split("(")[1]))
    table[shape] = {k: float(c) for k, c in zip(KINDS, cells[1:])}
  return table


def chain_temporaries(kind: str, shape: tuple) -> float:
  """XLA's temporaries per parameter of a jitted chain step (``ak.adamw`` with ``kind``
  moments, then ``optax.apply_updates``), params donated, state not: compiled, not run."""
  params = {"w": jnp.zeros(shape, jnp.float32)}
  tx = ak.adamw(1e-3, mu_dtype=q(kind), nu_dtype=q(kind))

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  abstract = jax.eval_shape(lambda: (params, tx.init(params), params))
  compiled = jax.jit(step, donate_argnums=(0,)).lower(*abstract).compile()
  return compiled.memory_analysis().temp_size_in_bytes / math.prod(shape)


def test_documented_temporaries_of_the_chain_step_are_todays(monkeypatch):
  """docs/low_memory.md's table, recomputed (XLA's loop, the CPU kernel off). Before: the
  guide said "under 0.2 bytes per parameter" for every leaf; small leaves keep 2-16."""
  monkeypatch.setattr(_backend, "kernel_built", lambda: False)
  table = documented_temporaries()
  assert {(1000,), (64, 256), (1024, 1024), (4096, 4096)} <= set(table)
  for shape, row in table.items():
    for kind, documented in row.items():
      measured = chain_temporaries(kind, shape)
      assert round(measured, 2) == pytest.approx(documented, abs=0.011), (shape, kind, measured)
