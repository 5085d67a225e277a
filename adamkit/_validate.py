"""Argument checks shared by every adamkit transform.

All checks run when an optimizer is *built* (or, for tree checks, when ``init`` /
``update`` are traced), never inside the compiled step. Values that are JAX tracers
(for example hyperparameters injected by ``optax.inject_hyperparams`` inside ``jit``)
cannot be inspected and are let through; their concrete value was checked when the
optimizer was first built outside the trace (``inject_hyperparams`` builds it at ``init``
with concrete arrays).

Validate once, at the outer door: a named optimizer checks its options, then builds its
primitives inside :func:`trusted`, where the value checks are skipped (the values handed
down are the ones just checked). A primitive called directly checks its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adamkit import _quant
from adamkit._sparse_types import is_row_sparse
from adamkit._tree import is_tracer as _is_tracer
from adamkit._tree import path_name

_TRUSTED = contextvars.ContextVar("adamkit_trusted", default=False)


@contextlib.contextmanager
def trusted():
  """Within this block the hyperparameter checks below return at once: the caller (a
  named optimizer) has already checked the values it hands down."""
  token = _TRUSTED.set(True)
  try:
    yield
  finally:
    _TRUSTED.reset(token)


def _skip() -> bool:
  return _TRUSTED.get()


def _concrete_scalar(name: str, value: Any) -> float | None:
  """Returns ``value`` as a Python float, ``None`` for a tracer; rejects non-numbers."""
  if isinstance(value, bool) or value is None:
    raise TypeError(f"`{name}` must be a real number, got {value!r} ({type(value).__name__}).")
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    if np.ndim(value) != 0:
      raise ValueError(f"`{name}` must be a scalar, got an array of shape {np.shape(value)}.")
    if not jnp.issubdtype(value.dtype, jnp.floating) and not jnp.issubdtype(
        value.dtype, jnp.integer):
      raise TypeError(f"`{name}` must be a real number, got dtype {value.dtype}.")
    if _is_tracer(value):
      return None
    return float(value)
  raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}.")


def check_beta(name: str, value: Any) -> None:
  """``value`` must lie in [0, 1) (a moment's decay; 0 keeps no memory, as optax, PyTorch
  and Paddle allow)."""
  if _skip():
    return
  v = _concrete_scalar(name, value)
  if v is not None and not 0.0 <= v < 1.0:
    raise ValueError(f"`{name}` must be in the range [0.0, 1.0), got {v}.")


# float32's smallest normal number: XLA flushes smaller (subnormal) float32 values to zero,
# so an ``eps`` below it becomes 0 inside the step and a zero gradient gives 0 / 0 = NaN.
EPS_MIN = float(np.finfo(np.float32).tiny)


def check_eps(name: str, value: Any) -> None:
  """``value`` must be finite and at least float32's smallest normal number."""
  if _skip():
    return
  v = _concrete_scalar(name, value)
  if v is not None and not (EPS_MIN <= v and np.isfinite(v)):
    raise ValueError(
        f"`{name}` must be a finite number in [{EPS_MIN:.4g}, inf) (float32's smallest normal "
        f"number; smaller values flush to zero in the float32 step), got {v}.")


QUANTIZED_KINDS = ("8bit", "4bit", "fp8")  # adamkit._quant.KINDS (that module imports this one)


def check_dtype(name: str, value: Any, *, complex_ok: bool = True) -> Any:
  """``None`` or a floating (or, with ``complex_ok``, complex) dtype; returns it as a
  ``jnp.dtype`` (or ``None``). TypeError naming ``name`` for anything else."""
  if value is None:
    return None
  if type(value).__name__ == "Quantized" or (isinstance(value, str) and value in QUANTIZED_KINDS):
    raise TypeError(
        f"`{name}` must be a floating-point dtype such as jnp.float32 or jnp.bfloat16, got "
        f"{value!r}: quantized storage ('8bit', '4bit', 'fp8', ak.Quantized) is for optimizer "
        "moments only (mu_dtype / nu_dtype).")
  try:
    dtype = jnp.dtype(value)
  except (TypeError, ValueError) as err:  # numpy: ValueError for some strings ("8-bit")
    raise TypeError(f"`{name}` must be a floating-point dtype such as jnp.float32 or "
                    f"jnp.bfloat16 (or None), got {value!r}: {err}.") from None
  ok = jnp.issubdtype(dtype, jnp.floating) or (
      complex_ok and jnp.issubdtype(dtype, jnp.complexfloating))
  if not ok:
    raise TypeError(f"`{name}` must be a floating-point dtype such as jnp.float32 or "
                    f"jnp.bfloat16 (or None), got {dtype}: an integer moment would truncate.")
  return dtype


def check_positive(name: str, value: Any) -> None:
  """``value`` must be a finite number > 0 (loss_scale, clip norms)."""
  if _skip():
    return
  v = _concrete_scalar(name, value)
  if v is not None and not (v > 0.0 and np.isfinite(v)):
    raise ValueError(f"`{name}` must be a finite number > 0, got {v}.")


def check_non_negative(name: str, value: Any) -> None:
  """``value`` must be a finite number >= 0 (learning rate, weight decay)."""
  if _skip():
    return
  v = _concrete_scalar(name, value)
  if v is not None and not (v >= 0.0 and np.isfinite(v)):
    raise ValueError(f"`{name}` must be a finite number >= 0, got {v}.")


def check_bool(name: str, value: Any) -> None:
  if _skip():
    return
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"`{name}` must be a bool, got {value!r} ({type(value).__name__}).")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
  if _skip():
    return
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")


def check_float_params(params: Any, what: str = "params", *, complex_ok: bool = False) -> None:
  """Rejects integer and boolean parameter leaves (and complex ones unless ``complex_ok``)
  with the leaf's name. Python floats are accepted, as optax does (they become float32
  arrays); anything that is not a number names its leaf too."""
  quantized = lambda x: type(x).__name__ == "QuantizedArray"  # noqa: E731 - no import cycle
  for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=quantized)[0]:
    name = path_name(path) or "<root>"
    if quantized(leaf):
      raise TypeError(f"{what} leaf '{name}' is a QuantizedArray: quantized storage is for "
                      "optimizer moments only (mu_dtype / nu_dtype); pass floating-point "
                      "parameters.")
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
      if isinstance(leaf, (bool, np.bool_)) or not isinstance(leaf, numbers.Number):
        raise TypeError(f"{what} leaf '{name}' is a {type(leaf).__name__}, not an array or "
                        "a number.")
      dtype = np.result_type(leaf)
    ok = jnp.issubdtype(dtype, jnp.floating) or (
        complex_ok and jnp.issubdtype(dtype, jnp.complexfloating))
    if not ok:
      kinds = "floating-point or complex" if complex_ok else "floating-point"
      raise TypeError(
          f"this optimizer takes {kinds} parameters only; {what} leaf '{name}' has dtype "
          f"{dtype}. Keep integer or boolean arrays out of the optimized tree (e.g. with "
          "optax.masked or optax.partition and optax.set_to_zero).")


def check_matching_trees(updates: Any, reference: Any, *, what: str = "params") -> None:
  """Raises a ValueError if ``updates`` and ``reference`` differ in structure or shapes."""
  if reference is None:
    return
  # A RowSparse gradient stands for its whole table: one leaf of shape (num_rows, ...).
  u_def = jax.tree.structure(updates, is_leaf=is_row_sparse)
  r_def = jax.tree.structure(reference)
  if u_def != r_def:
    raise ValueError(
        f"The gradient tree does not match the {what} tree.\n"
        f"  gradients: {u_def}\n  {what}: {r_def}")
  flat = jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_row_sparse)[0]
  for (path, u), r in zip(flat, jax.tree.leaves(reference)):
    if np.shape(u) != np.shape(r):
      raise ValueError(
          f"Gradient '{path_name(path) or '<root>'}' has shape {np.shape(u)} but the "
          f"matching {what} leaf has shape {np.shape(r)}.")


def check_dense_grads(updates: Any, optimizer: str) -> None:
  """Raises a TypeError naming the first :class:`adamkit.RowSparse` leaf: ``optimizer``
  takes dense gradients only."""
  flat = jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_row_sparse)[0]
  for path, leaf in flat:
    if is_row_sparse(leaf):
      raise TypeError(
          f"{optimizer} takes dense gradients, but '{path_name(path) or '<root>'}' is a "
          "RowSparse. Use ak.sparse_adam (lazy=False is MindSpore nn.Adam's FusedSparseAdam, "
          "lazy=True its FusedSparseLazyAdam) or ak.fused_adam (for AdamW: ak.sparse_adamw or "
          "ak.fused_adamw), or densify with `g.todense()`.")


def check_row_ids_untouched(updates: Any) -> None:
  """Raises a TypeError naming the first :class:`adamkit.RowSparse` leaf whose row ids are
  not integers. A ``RowSparse`` built with ``ak.RowSparse(...)`` or ``RowSparse.of`` holds
  its ids in a dtype on which JAX refuses every map that would change them; one rebuilt by
  hand with ``RowSparse.tree_unflatten`` from a float array is caught here, while tracing
  (free at run time), before such ids can index a table.
  """
  flat = jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_row_sparse)[0]
  for path, leaf in flat:
    if is_row_sparse(leaf) and not jnp.issubdtype(leaf.indices.dtype, jnp.integer):
      raise TypeError(
          f"RowSparse gradient '{path_name(path) or '<root>'}' reached the optimizer with "
          f"{leaf.indices.dtype} row ids (a RowSparse rebuilt with RowSparse.tree_unflatten "
          "from a non-integer array?). Build it with ak.RowSparse(ids, values, num_rows) or "
          "RowSparse.of, whose ids no tree map can change; to scale or clip, ask the sparse "
          "optimizer: ak.sparse_adam(grad_clip=ak.ClipGradByGlobalNorm(c) | "
          "ak.ClipGradByNorm(c) | ak.ClipGradByValue(c), loss_scale=s, nonfinite='skip'), or "
          "transform the values with g.with_values(...).")


# ------------------------------------------------------------------ gradients and state


def _is_integral(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and not is_row_sparse(x) and (
      jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_))


def float_grads(updates: Any, params: Any = None) -> Any:
  """``updates`` with each integer or boolean dense leaf cast to its param's dtype (JAX's
  default float dtype where no floating param is given), as optax's arithmetic promotes
  them: an update is never computed, and truncated, in an integer dtype. Other leaves are
  returned as they are; call after :func:`check_matching_trees`."""
  leaves, treedef = jax.tree.flatten(updates, is_leaf=is_row_sparse)
  if not any(_is_integral(g) for g in leaves):
    return updates
  default = jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))
  like = [None] * len(leaves) if params is None else treedef.flatten_up_to(params)

  def dtype_of(p):
    dtype = getattr(p, "dtype", None)
    if dtype is not None and (jnp.issubdtype(dtype, jnp.floating)
                              or jnp.issubdtype(dtype, jnp.complexfloating)):
      return dtype
    return default

  return treedef.unflatten([g.astype(dtype_of(p)) if _is_integral(g) else g
                            for g, p in zip(leaves, like)])


def check_state(state: Any, want: type, optimizer: str, updates: Any) -> None:
  """``state`` must be a ``want`` (the state type made by ``optimizer``'s ``init``) whose
  moment fields (all but ``count`` and ``row_splits``) are trees of the gradients'
  structure with a floating-point (or complex) leaf of each gradient's shape. Errors name
  the field and the leaf; a moment of shape ``(1,)`` would otherwise broadcast, and an
  integer one truncate, without a word."""
  if not isinstance(state, want):
    raise TypeError(
        f"{optimizer} takes the {want.__name__} made by its own `init`, got "
        f"{_state_names(state)} (the state of another optimizer, or of this one with other "
        "options, e.g. amsgrad?). Make the state with the transform that updates it: "
        "state = tx.init(params).")
  u_def = jax.tree.structure(updates, is_leaf=is_row_sparse)
  flat = jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_row_sparse)[0]
  for field in want._fields:
    if field in ("count", "row_splits"):  # no arrays: see adamkit._row_sharded.RowSplit
      continue
    moments = getattr(state, field)  # a quantized moment (codes, scales) is one leaf here
    if jax.tree.structure(moments, is_leaf=_quant.is_qarray) != u_def:
      raise ValueError(
          f"{optimizer}: state.{field} does not match the gradient tree (a state made for "
          f"other params?).\n  gradients: {u_def}\n  state.{field}: "
          f"{jax.tree.structure(moments, is_leaf=_quant.is_qarray)}")
    for (path, g), m in zip(flat, jax.tree.leaves(moments, is_leaf=_quant.is_qarray)):
      dtype = getattr(m, "dtype", None)
      ok = dtype is not None and (jnp.issubdtype(dtype, jnp.floating)
                                  or jnp.issubdtype(dtype, jnp.complexfloating))
      if np.shape(m) != np.shape(g) or not ok:
        raise ValueError(
            f"{optimizer}: state.{field} of '{path_name(path) or '<root>'}' has shape "
            f"{np.shape(m)} and dtype {dtype}, but the parameter (and its gradient) has "
            f"shape {np.shape(g)}: a moment must be a floating-point array of its "
            "parameter's shape. Make the state with this optimizer's `init` for these "
            "params.")


def _state_names(state: Any) -> str:
  """``state``'s type name, or its outline for a chain state (see :func:`state_outline`)."""
  if isinstance(state, tuple) and not hasattr(state, "_fields"):
    return "a chain state (" + ", ".join(state_outline(state)) + ")"
  return f"a {type(state).__name__}"


def state_outline(state: Any) -> list[str]:
  """The state types of a chain's state, in order: the name of each NamedTuple met while
  walking plain tuples (``optax.chain``) and ``inner_state`` fields (wrappers such as
  ``optax.apply_if_finite``). Per-parameter trees are not entered and arrays not listed,
  so the outline of a named optimizer's state does not depend on the params."""
  out: list[str] = []

  def walk(node):
    fields = getattr(node, "_fields", None)
    if fields is not None:
      out.append(type(node).__name__)
      if "inner_state" in fields:
        walk(node.inner_state)
    elif isinstance(node, (tuple, list)):
      for x in node:
        walk(x)

  walk(state)
  return out


# Keywords that optax, PyTorch, Paddle or MindSpore spell otherwise: (adamkit's argument,
# what to pass). Suggested only where the optimizer has that argument.
_FOREIGN_KEYWORDS = {
    "mask": ("weight_decay_mask", "`weight_decay_mask` (optax's `mask`: a bool tree, or a "
             "callable params -> bool tree)"),
    "lr": ("learning_rate", "`learning_rate`"),
    "betas": ("b1", "`b1` and `b2` (PyTorch's `betas=(b1, b2)`)"),
    "beta1": ("b1", "`b1`"),
    "beta2": ("b2", "`b2`"),
    "epsilon": ("eps", "`eps`"),
    "apply_decay_param_fun": ("weight_decay_mask", "`weight_decay_mask=ak.masks.name_rule(fn)` "
                              "(Paddle's `apply_decay_param_fun=fn`)"),
    "use_amsgrad": ("amsgrad", "`amsgrad`"),
    "use_nesterov": ("nesterov", "`nesterov`"),
    "lazy_mode": ("lazy", "`lazy`"),
    "min_8bit_size": ("mu_dtype", "`mu_dtype=ak.Quantized('8bit', min_size=n)` and "
                      "`nu_dtype=ak.Quantized('8bit', min_size=n)` (bitsandbytes' "
                      "`min_8bit_size=n`: leaves of fewer elements keep float32 moments)"),
    "bf16_stochastic_round": ("param_rounding", "`param_rounding='stochastic'` (torchao's "
                              "`bf16_stochastic_round=True`)"),
}


def foreign_keywords(fn):
  """Decorator for a named optimizer: a keyword that optax, PyTorch, Paddle or MindSpore
  spell otherwise (optax's ``mask``, PyTorch's ``lr`` and ``betas``, Paddle's ``epsilon``...)
  raises a TypeError that names adamkit's argument, instead of Python's bare "unexpected
  keyword argument". Other calls go straight through."""
  accepted = set(inspect.signature(fn).parameters)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    for key in kwargs:
      if key not in accepted and _FOREIGN_KEYWORDS.get(key, ("",))[0] in accepted:
        raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {key!r}; "
                        f"adamkit's is {_FOREIGN_KEYWORDS[key][1]}.")
    return fn(*args, **kwargs)

  return wrapper


# ------------------------------------------------------------------ moment formats


def _moment_kind_hint(value: str) -> str | None:
  """The quantized kind a misspelt ``mu_dtype`` string stands for (``"8-bit"``, ``"INT8"``,
  ``"4_bit"``...), or ``None``."""
  key = value.lower().replace("-", "").replace("_", "").replace(" ", "")
  for kind, spellings in (("8bit", ("8bit", "int8", "uint8", "8bits", "bnb8bit")),
                          ("4bit", ("4bit", "int4", "uint4", "4bits")),
                          ("fp8", ("fp8", "float8", "e4m3", "fp8e4m3"))):
    if key in spellings:
      return kind
  return None


_ACCEPTED_MOMENT_FORMATS = ("'8bit', '4bit', 'fp8', an ak.Quantized(kind, block_size=..., "
                            "min_size=..., pad=...), or a floating-point dtype such as "
                            "jnp.float32 or jnp.bfloat16 (or None: the param's dtype)")


def check_moment_format(name: str, value: Any) -> Any:
  """A ``mu_dtype`` / ``nu_dtype`` that is neither a quantized kind nor an
  :class:`adamkit.Quantized`: ``None`` or a floating dtype, returned as
  :func:`check_dtype` returns it. A misspelt kind (``"8-bit"``), an integer dtype
  (``"int8"``) or an unknown string gets a TypeError naming ``name`` and the accepted
  formats."""
  if isinstance(value, str) and value not in QUANTIZED_KINDS:
    hint = _moment_kind_hint(value)
    if hint is not None:
      raise TypeError(f"`{name}`={value!r} is not a moment format; for {hint} quantized "
                      f"moments pass `{name}={hint!r}` (or ak.Quantized({hint!r}, ...)). "
                      f"`{name}` takes {_ACCEPTED_MOMENT_FORMATS}.")
    try:
      jnp.dtype(value)
    except (TypeError, ValueError):
      raise TypeError(f"`{name}`={value!r} is not a moment format: `{name}` takes "
                      f"{_ACCEPTED_MOMENT_FORMATS}.") from None
  try:
    return check_dtype(name, value)
  except TypeError as err:
    raise TypeError(f"{err} For quantized moments pass '8bit', '4bit' or 'fp8' (or "
                    f"ak.Quantized(kind, ...)): `{name}` takes {_ACCEPTED_MOMENT_FORMATS}.") from None


# ------------------------------------------------------------------ quantized moments


def quantized_layout(q: Any) -> tuple:
  """What a quantized moment's arrays must agree on: format (kind, role, block size), the
  leaf's shape, and its codes' and scales' shapes and dtypes."""
  return (q.fmt.kind, q.fmt.role, q.fmt.block_size, tuple(q.shape),
          tuple(np.shape(q.codes)), _dtype_name(q.codes), tuple(np.shape(q.scales)),
          _dtype_name(q.scales))


def _dtype_name(x: Any) -> str | None:
  dtype = getattr(x, "dtype", None)
  return None if dtype is None else jnp.dtype(dtype).name


def check_quantized_layout(q: Any, name: str, what: str = "state") -> None:
  """``q``'s codes and scales must be the arrays its format lays out for its shape (uint8
  codes, float32 scales, of the blocked shapes): a ValueError names the field, the leaf and
  both layouts. Shapes and dtypes only: free inside ``jit``."""
  want = _quant.stored_layout(tuple(q.shape), q.fmt)
  for field in ("codes", "scales"):
    have, need = getattr(q, field), getattr(want, field)
    got = (tuple(np.shape(have)), _dtype_name(have))
    if got != (tuple(need.shape), jnp.dtype(need.dtype).name):
      raise ValueError(
          f"{what}: the quantized moment of '{name}' ({q.fmt.kind!r}, role {q.fmt.role!r}, "
          f"blocks of {q.fmt.block_size}, shape {tuple(q.shape)}) has {field} of dtype "
          f"{got[1]} and shape {got[0]}; its format stores {field} as {need.dtype}"
          f"{tuple(need.shape)}. Make the state with the optimizer's `init`, or load it with "
          "ak.load_state_dict(flat, tx.init(params))."
          + (" (adamkit 0.2 stored these codes as (..., blocks, block): the same bytes in C "
             f"order, so `codes.reshape({tuple(need.shape)})` converts them.)"
             if field == "codes" and _quant.leaf_layout(tuple(q.shape), q.fmt.block_size)
             and int(np.prod(got[0])) == int(np.prod(need.shape)) else ""))


def _bad_codes(codes: np.ndarray, fmt: Any) -> np.ndarray:
  """A mask of the codes that ``fmt``'s encoder never writes (each decodes to a value off
  its code book): the 4-bit first moment's nibble 15 (its levels are 0..14), float8's NaN
  codes (0x7F, 0xFF; e4m3fn has no infinities) and, in a second moment, a float8 code of a
  negative number (other than -0). Every byte is a code of the 8-bit maps (256 values
  each), and every nibble of the 4-bit second moment's (16)."""
  if fmt.kind == "4bit" and fmt.role == "mu":
    return ((codes & 0xF) == 0xF) | ((codes >> 4) == 0xF)
  if fmt.kind == "fp8":
    nan = (codes & 0x7F) == 0x7F
    return nan | (codes > 0x80) if fmt.role == "nu" else nan
  return np.zeros(codes.shape, bool)


def check_quantized_values(q: Any, name: str, what: str = "state", slots: tuple = ()) -> None:
  """A quantized moment entering from outside (a restored checkpoint, a state handed to
  :func:`adamkit.offload_state`) must hold what its format writes: the layout of
  :func:`check_quantized_layout`, every scale finite and >= 0, every code one its encoder
  writes (see :func:`_bad_codes`). A ValueError names the leaf, the block and the value;
  for a multi-tensor buffer ``slots`` (``(leaf name, element offset)`` of each leaf in it)
  name the param whose block it is. Traced arrays: layout only (their values are not
  known)."""
  check_quantized_layout(q, name, what)
  if _is_tracer(q.codes) or _is_tracer(q.scales):
    return
  scales = _local_values(q.scales)
  bad = ~(np.isfinite(scales) & (scales >= 0))
  if bad.any():
    block = int(np.argmax(bad))
    raise ValueError(
        f"{what}: the quantized moment of '{name}' has scale {float(scales[block])} in block "
        f"{block}{_slot_of(slots, block * q.fmt.block_size)} ({int(bad.sum())} bad of "
        f"{scales.size}): a block's scale is its largest "
        "magnitude, finite and >= 0. The state is corrupted; restore another checkpoint.")
  codes = _local_values(q.codes)
  wrong = _bad_codes(codes, q.fmt).reshape(-1)
  if wrong.any():
    at = int(np.argmax(wrong))
    valid = {("4bit", "mu"): "nibbles 0..14 (levels -7/7..7/7)",
             ("fp8", "mu"): "float8 e4m3fn codes other than NaN (0x7F, 0xFF)",
             ("fp8", "nu"): "float8 e4m3fn codes of numbers >= 0 (0x00..0x7E, 0x80)"}
    raise ValueError(
        f"{what}: the quantized moment of '{name}' ({q.fmt.kind!r}, role {q.fmt.role!r}) "
        f"has code {int(codes.reshape(-1)[at]):#04x} at byte {at}"
        f"{_slot_of(slots, at * (2 if q.fmt.packed else 1))} ({int(wrong.sum())} bad "
        f"bytes); its format writes {valid[(q.fmt.kind, q.fmt.role)]}. The state is "
        "corrupted; restore another checkpoint.")


def _local_values(a: Any) -> np.ndarray:
  """``a``'s values, flat; of an array spread over processes, this process's shards (each
  process checks what it holds: fetching the rest would need a collective)."""
  if isinstance(a, jax.Array) and not a.is_fully_addressable:
    return np.concatenate([np.asarray(s.data).reshape(-1) for s in a.addressable_shards])
  return np.asarray(a).reshape(-1)


def _slot_of(slots: tuple, element: int) -> str:
  """`` (param 'name')``: the leaf of a multi-tensor buffer holding ``element``."""
  owner = [name for name, at in slots if at <= element]
  return f" (param '{owner[-1]}')" if owner else ""


def _is_flat_moments(x: Any) -> bool:  # adamkit._fused.FlatMoments (which imports this module)
  return type(x).__name__ == "FlatMoments" and hasattr(x, "slots")


def check_quantized_state(tree: Any, what: str = "state") -> None:
  """:func:`check_quantized_values` on every quantized moment of ``tree`` (a whole
  optimizer state, or part of one), named by its path in ``tree`` (and, in a multi-tensor
  buffer, by the param whose block is bad)."""
  flat = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: _quant.is_qarray(x) or _is_flat_moments(x))[0]
  for path, leaf in flat:
    name = path_name(path) or "<root>"
    if _is_flat_moments(leaf):
      for key, buf in leaf.items():
        if _quant.is_qarray(buf):
          slots = tuple((p, at) for p, _, k, at in leaf.slots if k == key)
          check_quantized_values(buf, f"{name}.{key}", what, slots)
    elif _quant.is_qarray(leaf):
      check_quantized_values(leaf, name, what)


def check_moment_values(value: Any, fmt: Any, name: str) -> None:
  """Float values about to be stored in quantized format ``fmt`` (loaded from a state dict
  or another framework's state) must be finite, and a second moment's >= 0: the formats
  store neither NaN nor Inf (the encoder would write them as 0) nor, for ``"nu"``, a
  negative value (written as 0). A ValueError names ``name``."""
  value = np.asarray(value)
  bad = ~np.isfinite(value)
  if fmt.role == "nu":
    bad |= value < 0
  if bad.any():
    at = np.unravel_index(int(np.argmax(bad)), value.shape) if value.ndim else ()
    rule = "finite and >= 0 (a second moment)" if fmt.role == "nu" else "finite"
    raise ValueError(
        f"{name} holds {float(value[at])} at index {tuple(int(i) for i in at)} "
        f"({int(bad.sum())} such values): the {fmt.kind!r} moment format stores {rule} "
        "values only.")
