"""The fused step: Adam, AdamW, AMSGrad and AdaMax in one pass over memory, params included.

Why a second form. An optax ``GradientTransformation`` returns *updates*, and
``optax.apply_updates`` adds them to the params afterwards; XLA:CPU then emits an Adam step as
three loops (first moment, second moment, params), about 40 bytes of memory traffic per
float32 parameter, while the step's data is 28 bytes (read p, g, m, v; write p, m, v).
Memory bandwidth, not arithmetic, bounds the step on a CPU (the host-compute offload path
runs it there), so the fast path is a *fused step* ``(grads, state, params) -> (params,
state)`` that computes decay, moments, direction, learning rate and the new params together.

The step asks :mod:`adamkit._ops` for a dense step on each run of leaves and a lazy row
step on each row-sparse leaf; whether the C++ kernel or XLA computes it is decided there
(:mod:`adamkit._backend`). In multi-tensor mode (Paddle ``use_multi_tensor``) the moments
of all leaves of a dtype are one flat buffer, so one kernel call updates a run of up to 32
float32 leaves (300 small leaves: 10 launches, not 900 loops); on XLA each leaf's moments
are written back into the flat buffers with ``dynamic_update_slice``.

AdamW (:func:`fused_adamw`) adds its decoupled decay to the direction in the same pass;
AMSGrad (``amsgrad=True``) keeps a third buffer, the running maximum of the second moment,
laid out as the second moment (36 bytes per float32 parameter instead of 28).

With ``param_rounding=`` bf16/fp16 params keep no float32 master copy: each is stepped in
float32 and written back rounded in the same pass (:mod:`adamkit._rounding`'s rules; the
kernel takes bf16 params), over the state of ``ak.param_rounding`` around the fused step.

A :class:`FusedStep` is also a ``GradientTransformation`` over the same state: its
``update`` computes ``-lr * u`` with the XLA operations of :mod:`adamkit._ops` (the
kernel writes params, not updates), for chains, ``nnx.Optimizer`` and master weights.

The reference is the named optimizer: for the options it accepts,
``fused_adam(...).step(p, s, grads=g)[0]`` equals ``optax.apply_updates(p, adam(...).update(g,
s2, p)[0])`` to float32 rounding; the tests check every option on both backends.

The argument order ``step(params, state, *, grads) -> (params, state)`` puts the donated
inputs in the order of the outputs: ``jax.jit`` pairs donated buffers with outputs of the same
shape in order, and a mismatch (say params paired with a first moment) makes XLA copy every
buffer before the kernel runs, a whole extra pass. That order is the reverse of ``update(grads,
state, params)``, so ``grads`` is keyword-only: a swapped positional call cannot run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adamkit import (
  _adam,
  _backend,
  _compat,
  _links,
  _masks,
  _ops,
  _quant,
  _quant_ops,
  _rounding,
  _schedules,
  _validate,
)
from adamkit._sparse_types import RowSparse, _explicit_sharding, gather_rows, safe_ids
from adamkit._tree import leaf_names, place_scalars_like, replicated_like


@jax.tree_util.register_pytree_with_keys_class
class FlatMoments(Mapping):
  """Multi-tensor moments: ``{dtype name: 1-D buffer}``, each buffer holding the moments of
  the leaves of that dtype back to back in the params' tree order, and (static, in the
  tree structure) where each leaf lies, so that a state can be read and written by
  parameter name (:func:`adamkit.state_dict`, the framework importers) without the params.

  Quantized moments (``mu_dtype="8bit"`` etc.) live in one flat quantized buffer keyed by
  the format's kind (a ``QuantizedArray`` of shape ``(n,)``), each leaf from a block's
  start, taking whole blocks; it reads back (dequantized) as a flat float32 buffer with
  the same offsets. Leaves under the format's ``min_size`` keep float32 moments (key
  ``"float32"``).

  ``slots``: ``(leaf name, shape, buffer key, offset)`` per param leaf, in tree order.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> state = ak.fused_adam().init({"b": jnp.zeros(3), "w": jnp.zeros((2, 2))})
    >>> {k: v.shape for k, v in state.mu.items()}, state.mu.slots
    ({'float32': (7,)}, (('b', (3,), 'float32', 0), ('w', (2, 2), 'float32', 3)))
  """

  def __init__(self, buffers: Mapping[str, Any], slots: tuple):
    self._buffers = dict(buffers)
    self.slots = slots

  def __getitem__(self, key):
    return self._buffers[key]

  def __iter__(self):
    return iter(self._buffers)

  def __len__(self):
    return len(self._buffers)

  def __repr__(self):
    return f"FlatMoments({self._buffers!r})"

  def tree_flatten_with_keys(self):
    keys = tuple(self._buffers)
    children = [(jax.tree_util.DictKey(k), self._buffers[k]) for k in keys]
    return children, (keys, self.slots)

  @classmethod
  def tree_unflatten(cls, aux, children):
    keys, slots = aux
    return cls(dict(zip(keys, children)), slots)

  def replace(self, buffers: Mapping[str, Any]) -> FlatMoments:
    """The same layout over new buffers."""
    return FlatMoments(buffers, self.slots)


class FusedAdamState(NamedTuple):
  count: jax.Array  # int32 scalar, steps taken (saturates at int32 max)
  # First and second moment (AdaMax: infinity norm), ``mu_dtype``/``nu_dtype`` or the
  # params' dtype. Per leaf: trees of the params' shapes (a quantized leaf's moment is a
  # QuantizedArray). Multi-tensor: a :class:`FlatMoments` {dtype name or quantized kind:
  # 1-D buffer} holding the leaves of that moment storage back to back, in tree order.
  mu: Any
  nu: Any


class FusedAdamaxState(FusedAdamState):
  """The state of :func:`adamkit.fused_adamax`: :class:`FusedAdamState`'s fields, ``nu``
  holding the infinity norm. A type of its own so that importers of framework state
  (``ak.from_paddle_state``) can tell an AdaMax state from an Adam one."""


class FusedAmsgradState(NamedTuple):
  """The state of a fused step with ``amsgrad=True``: :class:`FusedAdamState`'s, plus the
  running maximum."""

  count: jax.Array  # int32 scalar, steps taken (saturates at int32 max)
  mu: Any  # first moment, as in FusedAdamState
  nu: Any  # second moment, as in FusedAdamState
  nu_max: Any  # max of every nu so far (raw, not bias-corrected), laid out and typed as nu


class FusedStep(optax.GradientTransformationExtraArgs):
  """An optimizer with a one-pass step: an ``optax.GradientTransformation``
  (``init(params) -> state``, ``update(grads, state, params) -> (updates, state)``) with
  ``step(params, state, *, grads) -> (params, state)`` over the same state. The fused
  optimizers (:func:`adamkit.fused_adam`, ...) and every offloaded transform
  (:func:`adamkit.offload`, which adds each streamed piece's update to its param rows) are
  of this type. Jit ``step`` with ``donate_argnums=(0, 1)``: params and state are then
  updated in place.

  ``grads`` is keyword-only: ``step`` puts the params first (the donated inputs in the
  order of its outputs), the reverse of ``update(grads, state, params)``, and with
  positional arguments a swapped call would run without a word and train the gradients.
  A positional third argument raises a ``TypeError`` that says so.

  ``FusedStep(init, step, update)``, with ``step(params, state, grads)`` taking its three
  arguments positionally (the keyword-only form is made here); without ``update`` (a
  step-only wrapper) ``update`` raises a ``TypeError`` that says so.
  """

  step: Callable[..., tuple[optax.Params, Any]]

  def __new__(cls, init, step, update=None):
    if update is None:
      def update(updates, state, params=None, **extra_args):
        del updates, state, params, extra_args
        raise TypeError(
            "This FusedStep has a `step` only: call `step(params, state, grads=grads)`, or "
            "use the optax form of the optimizer (e.g. ak.adam(...)) for `update`.")
    self = super().__new__(cls, init, update)
    self.step = _grads_by_keyword(step)
    return self

  def __getnewargs__(self):
    return (self.init, self.step.positional, self.update)


_NO_GRADS = object()


def _grads_by_keyword(step: Callable) -> Callable:
  """``step(params, state, grads)`` as ``step(params, state, *, grads)``; the positional
  form stays reachable as ``.positional``."""
  positional = getattr(step, "positional", step)

  def step_kw(params, state, *args, grads=_NO_GRADS):
    if args or grads is _NO_GRADS:
      raise TypeError(
          "FusedStep.step takes the gradients by keyword: step(params, state, grads=grads)"
          f"{f', got {len(args)} more positional argument(s)' if args else ''}. Its order "
          "(params first, as it returns them) is the reverse of update(grads, state, "
          "params), and a positional call could swap the two without a word.")
    return positional(params, state, grads)

  step_kw.positional = positional
  step_kw.__name__ = step_kw.__qualname__ = "step"
  step_kw.__doc__ = ("The fused step: ``step(params, state, *, grads) -> (params, state)``; "
                     "jit it with ``donate_argnums=(0, 1)``.")
  return step_kw


class _Leaf(NamedTuple):
  """One param leaf in a step: its arrays, and where its moments live."""
  name: str
  p: jax.Array
  g: Any  # a dense gradient or a RowSparse (its rows already L2-decayed)
  decay: bool  # decay still to add: L2 (dense leaves) or decoupled (every leaf)
  m_key: Any  # the first moment's buffer: a dtype name (multi-tensor) or the leaf's index
  m_at: int | None  # offset in that buffer (None: the buffer is the leaf's own array)
  v_key: Any
  v_at: int | None


def _storage(p, fmt, role: str):
  """How the ``role`` ("mu" or "nu") moment of leaf ``p`` is stored, given ``mu_dtype``
  or ``nu_dtype`` as :func:`adamkit._quant.as_format` made it: a dtype, or a
  :class:`adamkit._quant.Format` (where :meth:`adamkit.Quantized.quantizes` says so; other
  leaves keep float32)."""
  if _quant.is_quantized(fmt):
    if fmt.quantizes(np.shape(p), role):
      return _quant.resolve(fmt, role)
    return jnp.dtype(jnp.float32)
  return jnp.dtype(fmt if fmt is not None else p.dtype)


def _key(store) -> str:
  return store.kind if isinstance(store, _quant.Format) else store.name


def _flat_layout(leaves, store_of) -> tuple[list[tuple[str, int]], dict[str, tuple]]:
  """Multi-tensor layout: leaves of one moment storage back to back, in tree order (a
  quantized leaf from a block's start, in whole blocks). Returns each leaf's ``(buffer
  key, offset)`` and each buffer's ``(size, storage)``."""
  sizes: dict[str, tuple] = {}
  slots = []
  for leaf in leaves:
    store = store_of(leaf)
    key = _key(store)
    at = sizes.get(key, (0,))[0]
    n = int(np.prod(np.shape(leaf)))
    if isinstance(store, _quant.Format):
      n = -(-n // store.block_size) * store.block_size
    slots.append((key, at))
    sizes[key] = (at + n, store)
  return slots, sizes


def _zero_moment(p, store):
  """A zero moment for leaf ``p`` stored as ``store`` (see :func:`_storage`); quantized
  codes and scales are placed as a committed ``p`` is (sharded alike)."""
  if isinstance(store, _quant.Format):
    return _quant_ops.placed_like(_quant.zeros(tuple(np.shape(p)), store), p)
  return jnp.zeros_like(p, dtype=store)


def _flat_buffer(n: int, store):
  return _quant.zeros((n,), store) if isinstance(store, _quant.Format) else jnp.zeros([n], store)


def _flat_zeros(params, store_of) -> FlatMoments:
  """Zero multi-tensor moments for ``params``, stored as ``store_of(leaf)`` says."""
  leaves = jax.tree.leaves(params)
  slots, sizes = _flat_layout(leaves, store_of)
  layout = tuple((name, tuple(np.shape(p)), key, at)
                 for name, p, (key, at) in zip(leaf_names(params), leaves, slots))
  return FlatMoments({k: _flat_buffer(n, store) for k, (n, store) in sizes.items()}, layout)


def _zero_layout(shape: tuple, store) -> Any:
  """:func:`_describe` of the zero moment of a leaf of ``shape`` stored as ``store``
  (what :func:`_zero_moment` and :func:`_flat_buffer` make), without a trace."""
  if isinstance(store, _quant.Format):
    return _describe(_quant.stored_layout(tuple(shape), store))
  # float64 is float32 unless x64 is on, as jnp.zeros makes it
  return _describe(jax.ShapeDtypeStruct(tuple(shape), jax.dtypes.canonicalize_dtype(store)))


def _describe(buf) -> Any:
  """Shapes and dtypes of a moment buffer (and a quantized one's format), to compare."""
  if _quant.is_qarray(buf):  # the role too: a second moment's code book is unsigned
    return _validate.quantized_layout(buf)
  return (tuple(np.shape(buf)), getattr(getattr(buf, "dtype", None), "name", None))


def _slots(leaf: _Leaf, n: int) -> tuple[tuple, tuple]:
  """The leaf's ``n`` moment buffers (keys) and offsets: ``m``, ``v`` and, with AMSGrad,
  ``v``'s running maximum, laid out as ``v``."""
  return ((leaf.m_key, leaf.v_key, leaf.v_key)[:n], (leaf.m_at, leaf.v_at, leaf.v_at)[:n])


def _runs(leaves: list[_Leaf]) -> list[list[_Leaf]]:
  """Consecutive dense leaves sharing buffers, dtypes and decay flag (one kernel call can
  take them); a row-sparse leaf is a run of its own."""
  runs: list[list[_Leaf]] = []
  for leaf in leaves:
    key = (leaf.m_key, leaf.v_key, leaf.decay, leaf.p.dtype, leaf.g.dtype)
    last = runs[-1][-1] if runs else None
    if (last is None or isinstance(leaf.g, RowSparse) or isinstance(last.g, RowSparse)
        or key != (last.m_key, last.v_key, last.decay, last.p.dtype, last.g.dtype)):
      runs.append([leaf])
    else:
      runs[-1].append(leaf)
  return runs


def _check_state(state, params, names, multi_tensor, mu_of, nu_of, amsgrad, want) -> None:
  """The state must be this optimizer's (a ``want``), for these params: errors name the
  leaf."""
  if type(state) is not want:
    raise TypeError(f"A fused step{' with amsgrad=True' if amsgrad else ''} takes the "
                    f"{want.__name__} made by its own `init`, got a {type(state).__name__} (the "
                    "state of ak.adam, another optax chain or a fused step with other options?).")
  leaves = jax.tree.leaves(params)
  fields = [("mu", state.mu, mu_of), ("nu", state.nu, nu_of)]
  if amsgrad:
    fields.append(("nu_max", state.nu_max, nu_of))
  if multi_tensor:
    for name, bufs, store_of in fields:
      sizes = _flat_layout(leaves, store_of)[1]
      got = ({k: _describe(b) for k, b in bufs.items()} if isinstance(bufs, FlatMoments)
             else type(bufs).__name__)
      want = {k: _zero_layout((n,), st) for k, (n, st) in sizes.items()}
      if got != want:
        raise ValueError(f"The multi-tensor state's {name} buffers {got} do not match the "
                         f"params and mu_dtype/nu_dtype (expected {want}): was the state made "
                         "by this optimizer (multi_tensor=True) for these params?")
    return
  treedef = jax.tree.structure(params)
  for name, moments, store_of in fields:
    if jax.tree.structure(moments, is_leaf=_quant.is_qarray) != treedef:
      raise ValueError(f"The state's {name} tree does not match the params tree (a "
                       "multi-tensor state, or one made for other params?).")
    for leaf, p, m in zip(names, leaves, jax.tree.leaves(moments, is_leaf=_quant.is_qarray)):
      store = store_of(p)
      if isinstance(store, _quant.Format) or _quant.is_qarray(m):
        want = _zero_layout(np.shape(p), store)
        if _describe(m) != want:
          raise ValueError(f"state.{name} of '{leaf}' is stored as {_describe(m)}; this "
                           f"optimizer stores it as {want} (kind, role, block size, shape, codes "
                           "shape and dtype, scales shape and dtype): a state quantized with "
                           "another mu_dtype/nu_dtype, or its moments swapped?")
      elif np.shape(m) != np.shape(p) or not jnp.issubdtype(m.dtype, jnp.floating):
        raise ValueError(f"state.{name} of '{leaf}' has shape {np.shape(m)} and dtype "
                         f"{m.dtype}; the param has shape {np.shape(p)}: a moment must be a "
                         "floating-point array of its param's shape.")


def _check_quantized_rows(name: str, p, stores_of, multi_tensor: bool) -> None:
  """A lazy row step on a table with quantized moments reads and writes the touched rows'
  own blocks: each row must be whole blocks (per leaf, or one block per row), else a
  ``ValueError`` names the leaf, the block, the row and the ways out."""
  shape = tuple(np.shape(p))
  row = int(np.prod(shape[1:], dtype=np.int64))
  for store in (of(p) for of in stores_of):
    if not isinstance(store, _quant.Format) or _quant.rows_in_blocks(shape, store.block_size) or (
        not multi_tensor and _quant.rows_apart(shape, store)):
      continue
    raise ValueError(
        f"'{name}' of shape {shape} has a RowSparse gradient and {store.kind} moments in "
        f"blocks of {store.block_size}, which span its rows of {row} elements: a lazy row "
        "step updates the touched rows' own blocks only. Pass a block size that divides the "
        f"row (ak.Quantized({store.kind!r}, block_size=...), a power of two), lazy=False (the "
        "rows densified, every row moves), or use ak.sparse_adam / ak.sparse_adamw (one "
        "scale per row when the block does not divide it).")


def _keep_shardings(new: list, old: list, multi_tensor: bool) -> list:
  """Each new leaf sharded as its input leaf was. A flat moment buffer is laid out by XLA,
  and a slice of it would lend its sharding to the leaf computed from it (a replicated
  bias came back ``P('model')``); per-leaf moments follow their params by themselves.
  Nothing to tie on one device."""
  if not multi_tensor or _backend.placement(*old) in (_backend.ONE_CPU, _backend.TRACED_ONE_CPU):
    return new
  return [n if _is_rs(n) else _compat.tie_sharding(n, o) for n, o in zip(new, old)]


def _is_rs(x) -> bool:
  return isinstance(x, RowSparse)


# --------------------------------------------------------------------- the fused step


def _fused(algo: str, learning_rate, b1, b2, eps, *, eps_mode, nesterov, weight_decay,
           weight_decay_mask, mu_dtype, nu_dtype, multi_tensor, backend, lazy=True,
           unique_ids=False, amsgrad=False, bias_correction=True, decoupled=False,
           param_rounding=None, seed=None) -> FusedStep:
  """The fused step of ``algo`` ("adam" or "adamax"); ``decoupled``: AdamW's decay;
  ``param_rounding``, ``seed``: see :func:`fused_adam`."""
  if param_rounding is not None or seed is not None:
    _check_rounding_args(param_rounding, seed)
  _adam.check_adam_hyper(b1, b2, eps)
  _validate.check_choice("eps_mode", eps_mode, ("hat", "corrected"))
  for name, flag in (("nesterov", nesterov), ("multi_tensor", multi_tensor), ("lazy", lazy),
                     ("unique_ids", unique_ids), ("amsgrad", amsgrad),
                     ("bias_correction", bias_correction)):
    _validate.check_bool(name, flag)
  _validate.check_choice("backend", backend, _backend.BACKENDS)
  if not callable(weight_decay):
    _validate.check_non_negative("weight_decay", weight_decay)
  lr_schedule = _schedules.as_schedule(learning_rate, "learning_rate")
  decays = callable(weight_decay) or weight_decay != 0
  mu_fmt = _quant.as_format("mu_dtype", mu_dtype)
  nu_fmt = _quant.as_format("nu_dtype", nu_dtype)
  kind = "adamax" if algo == "adamax" else eps_mode
  state_cls = (FusedAmsgradState if amsgrad else
               FusedAdamaxState if algo == "adamax" else FusedAdamState)
  # With param_rounding the moments of bf16/fp16 params are built on their float32 view,
  # as ak.param_rounding builds its inner state.
  view = (lambda p: jax.ShapeDtypeStruct(np.shape(p), jnp.float32) if _rounding.is_low(p) else p
          ) if param_rounding is not None else (lambda p: p)
  mu_of = lambda p: _storage(view(p), mu_fmt, "mu")
  nu_of = lambda p: _storage(view(p), nu_fmt, "nu")

  def init_fn(params):
    _validate.check_float_params(params)
    if not multi_tensor:
      # zeros_like: each moment keeps its param's sharding and memory kind
      mu, nu = (jax.tree.map(lambda p, of=of: _zero_moment(p, of(p)), params)
                for of in (mu_of, nu_of))
    else:
      leaves = jax.tree.leaves(params)
      for name, leaf in zip(leaf_names(params), leaves):
        if _explicit_sharding(leaf) is not None and not leaf.sharding.is_fully_replicated:
          raise ValueError(
              f"Param '{name}' is sharded over a mesh with Explicit axes; multi_tensor=True "
              "keeps every leaf's moments in one flat buffer, which cannot follow that "
              "sharding. Use multi_tensor=False (moments sharded like their params).")
      mu, nu = (_flat_zeros(params, store_of) for store_of in (mu_of, nu_of))
      # Placed as the jitted step returns them (committed params: one compilation).
      # (a spec per axis, as jit writes it: 1-D buffers, 2-D codes of a quantized one)
      if replicated_like(params) is not None:
        mu, nu = jax.tree.map(lambda x: jax.device_put(x, replicated_like(params, x.ndim)),
                              (mu, nu))
    count = jnp.zeros([], jnp.int32)
    if amsgrad:
      state = FusedAmsgradState(count=count, mu=mu, nu=nu, nu_max=jax.tree.map(jnp.copy, nu))
    else:
      state = state_cls(count=count, mu=mu, nu=nu)
    return place_scalars_like(state, params)

  def leaf_records(params, grads, wd) -> list[_Leaf]:
    """Each leaf with its gradient, decay flag and moment slots; a row-sparse gradient's
    rows take their L2 decay here, once per occurrence (MindSpore's rule), or it is
    densified. Decoupled decay stays a flag: the step adds it once per touched row."""
    flat_p, treedef = jax.tree.flatten(params)
    names = leaf_names(params)
    if multi_tensor:
      m_slots, v_slots = _flat_layout(flat_p, mu_of)[0], _flat_layout(flat_p, nu_of)[0]
    else:
      m_slots = v_slots = [(i, None) for i in range(len(flat_p))]
    keep = _masks.resolve_mask(weight_decay_mask, params) if decays else None
    flags = [bool(k) for k in treedef.flatten_up_to(keep)] if decays else [False] * len(flat_p)
    out = []
    for name, p, g, decay, m_slot, v_slot in zip(names, flat_p, treedef.flatten_up_to(grads),
                                                flags, m_slots, v_slots):
      if isinstance(g, RowSparse):
        if algo == "adamax":
          raise TypeError("fused_adamax takes dense gradients, not a RowSparse (AdaMax has no "
                          f"row-sparse form in MindSpore or Paddle): pass `g.todense()` for '{name}'.")
        _ops.check_rows(g, np.shape(p), what=f"gradient of '{name}'")
        if decay and not decoupled:
          rows = gather_rows(p, safe_ids(g.indices, g.num_rows))
          g = g.with_values(g.values + (wd * rows.astype(jnp.float32)).astype(g.dtype))
          decay = False
        if not lazy:
          g = g.todense(like=p)
        else:
          _check_quantized_rows(name, p, (mu_of, nu_of), multi_tensor)
      out.append(_Leaf(name, p, g, decay, *m_slot, *v_slot))
    return out

  def start(params, state, grads):
    """This step's scalars and the moment buffers by key (a dtype name in multi-tensor
    mode, else the leaf's index)."""
    _validate.check_row_ids_untouched(grads)
    _validate.check_matching_trees(grads, params)
    _check_state(state, params, leaf_names(params), multi_tensor, mu_of, nu_of, amsgrad,
                 state_cls)
    lr = _schedules.scalar_or_schedule(lr_schedule, state.count)
    wd = _schedules.scalar_or_schedule(weight_decay, state.count)
    count = optax.safe_increment(state.count)
    hyper = _ops.Hyper.of(kind, nesterov, b1, b2, eps, count, bias_correction=bias_correction,
                          lr=lr, wd=wd, amsgrad=amsgrad, decoupled=decoupled)
    # The moment buffers by key (a dtype name in multi-tensor mode, else the leaf's index):
    # m, v and, with AMSGrad, v's running maximum, which is laid out as v.
    trees = (state.mu, state.nu) + ((state.nu_max,) if amsgrad else ())
    if multi_tensor:
      bufs = [dict(t) for t in trees]
    else:
      bufs = [dict(enumerate(jax.tree.leaves(t, is_leaf=_quant.is_qarray))) for t in trees]
    return hyper, wd, count, bufs

  def finish(params, state, count, bufs):
    """The new state: the buffers by key back in the state's layout."""
    trees = (state.mu, state.nu) + ((state.nu_max,) if amsgrad else ())
    if multi_tensor:
      trees = [t.replace(b) for t, b in zip(trees, bufs)]
    else:
      treedef = jax.tree.structure(params)
      trees = [treedef.unflatten(list(b.values())) for b in bufs]
    return state_cls(count, *trees)

  def update_fn(updates, state, params=None, **extra_args):
    """The optax protocol: ``-lr * u`` per leaf (a :class:`RowSparse` of the touched rows
    for a lazy row-sparse leaf), as :func:`adam` / :func:`sparse_adam` compute it."""
    del extra_args
    grads = updates
    if params is None:
      if decays:
        raise ValueError("Weight decay needs `params`: call `update(grads, state, params)`.")
      params = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape, g.dtype), grads,
                            is_leaf=_is_rs)
    hyper, wd, count, bufs = start(params, state, grads)
    grads = _validate.float_grads(grads, params)
    out = []
    for leaf in leaf_records(params, grads, wd):
      keys, at = _slots(leaf, len(bufs))
      moments = tuple(b[k] for b, k in zip(bufs, keys))
      if isinstance(leaf.g, RowSparse):
        ids, rows, moments = _ops.lazy_row_update(hyper, leaf.p, leaf.g, moments, at=at,
                                                  merge=not unique_ids, decay=leaf.decay,
                                                  backend=backend)
        u = RowSparse.of(ids, rows, leaf.g.num_rows)
      else:
        (u,), moments = _ops.dense_update(
            hyper, [leaf.p], [leaf.g], moments,
            at=None if leaf.m_at is None else [[a] for a in at], decay=leaf.decay)
      for b, k, x in zip(bufs, keys, moments):
        b[k] = x
      out.append(u)
    like = [g if isinstance(p, jax.ShapeDtypeStruct) else p
            for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads, is_leaf=_is_rs))]
    out = _keep_shardings(out, like, multi_tensor)
    return jax.tree.structure(params).unflatten(out), finish(params, state, count, bufs)

  def step_fn(params, state, grads):
    rounding = None
    if param_rounding is not None:  # the state is ak.param_rounding's around the fused one
      _rounding.check_state(param_rounding, state, "A fused step with param_rounding={!r}")
      _rounding.check_leaves(param_rounding, state, params,
                             f"A fused step with param_rounding={param_rounding!r}")
      rounding, state = _StepRounding.of(param_rounding, state, params), state.inner
    hyper, wd, count, bufs = start(params, state, grads)
    grads = _validate.float_grads(grads, params)
    if rounding is not None:
      grads = rounding.widen_rows(params, grads)
    new_params, new_comps = [], []
    # The step, in the order of its equations: this step's scalars (learning rate, decay,
    # bias corrections), then each run of leaves: decay, moments, direction, new params
    # (rounded, for the low-precision leaves of a step with param_rounding).
    for run in _runs(leaf_records(params, grads, wd)):
      keys, at = _slots(run[0], len(bufs))
      moments = tuple(b[k] for b, k in zip(bufs, keys))
      r = rounding.of_run(len(new_params), run) if rounding is not None else None
      ps, moments, cs = _run_step(hyper, run, moments, at, r, merge=not unique_ids,
                                  backend=backend)
      for b, k, x in zip(bufs, keys, moments):
        b[k] = x
      new_params += ps
      new_comps += cs

    new_params = _keep_shardings(new_params, jax.tree.leaves(params), multi_tensor)
    state = finish(params, state, count, bufs)
    if rounding is not None:
      state = rounding.finish(state, new_comps)
    return jax.tree.structure(params).unflatten(new_params), state

  if param_rounding is None:
    return FusedStep(init_fn, step_fn, update_fn)
  # init and update (the optax form) are ak.param_rounding's around the fused transform:
  # the same state, and the same numbers as the one-pass step.
  wrapped = _rounding.param_rounding(FusedStep(init_fn, step_fn, update_fn), param_rounding,
                                     seed=0 if seed is None else seed)
  return FusedStep(wrapped.init, step_fn, wrapped.update)


def _run_step(hyper: _ops.Hyper, run: list[_Leaf], moments: tuple, at: tuple,
              r: _ops.Rounding | None, *, merge: bool, backend: str):
  """One run of leaves stepped (rounded by ``r`` when given): ``(params, moments,
  comps)``, ``comps`` the new Kahan buffers (``None`` per leaf without)."""
  first = run[0]
  if isinstance(first.g, RowSparse):
    if r is None:
      p, moments = _ops.lazy_row_step(hyper, first.p, first.g, moments, at=at, merge=merge,
                                      decay=first.decay, backend=backend)
      return [p], moments, [None]
    p, moments, comps = _ops.rounded_lazy_row_step(hyper, r, first.p, first.g, moments, at=at,
                                                   merge=merge, decay=first.decay,
                                                   backend=backend)
    return [p], moments, list(comps) or [None]
  at = None
  if first.m_at is not None:
    m_at, v_at = [x.m_at for x in run], [x.v_at for x in run]
    at = (m_at, v_at, v_at)[:len(moments)]
  ps, gs = [x.p for x in run], [x.g for x in run]
  if r is None:
    ps, moments = _ops.dense_step(hyper, ps, gs, moments, at=at, decay=first.decay,
                                  backend=backend)
    return ps, moments, [None] * len(run)
  ps, moments, comps = _ops.rounded_dense_step(hyper, r, ps, gs, moments, at=at,
                                               decay=first.decay, backend=backend)
  return ps, moments, list(comps) or [None] * len(run)


class _StepRounding(NamedTuple):
  """The rounding of one fused step with ``param_rounding``: the method, its state
  (:mod:`adamkit._rounding`'s) and the params' leaves."""
  method: str
  state: Any  # NearestRoundingState, StochasticRoundingState or KahanState
  low: list[bool]  # per leaf: bf16/fp16 (rounded) or wider (stepped as without rounding)
  comps: list  # per leaf: its Kahan buffer (None for a wider leaf, or another method)
  treedef: Any

  @classmethod
  def of(cls, method: str, state, params) -> _StepRounding:
    leaves, treedef = jax.tree.flatten(params)
    comps = (treedef.flatten_up_to(state.compensation) if method == "kahan"
             else [None] * len(leaves))
    return cls(method, state, [_rounding.is_low(p) for p in leaves], comps, treedef)

  def widen_rows(self, params, grads):
    """A row-sparse gradient of a low-precision leaf in float32, as ``ak.param_rounding``'s
    inner transform sees it (an L2 decay is added to its rows in float32); dense ones are
    widened in the step's own pass."""
    flat = self.treedef.flatten_up_to(grads)
    return self.treedef.unflatten([
        g.with_values(g.values.astype(jnp.float32)) if _is_rs(g) and lo else g
        for g, lo in zip(flat, self.low)])

  def of_run(self, start: int, run: list) -> _ops.Rounding | None:
    """The rounding of leaves ``start, start + 1, ...`` (``None`` for wider leaves): the
    key of each leaf (its index in the tree) at this step, or its Kahan buffer."""
    if not self.low[start]:
      return None
    leaves = range(start, start + len(run))
    keys = (tuple(_rounding.leaf_key(self.state.key, self.state.step, i) for i in leaves)
            if self.method == "stochastic" else ())
    comps = tuple(self.comps[i] for i in leaves) if self.method == "kahan" else ()
    return _ops.Rounding(self.method, keys, comps)

  def finish(self, inner, comps: list):
    """The new rounding state around the fused step's new ``inner`` state."""
    if self.method == "kahan":
      return self.state._replace(compensation=self.treedef.unflatten(comps), inner=inner)
    if self.method == "stochastic":
      return self.state._replace(step=optax.safe_int32_increment(self.state.step), inner=inner)
    return self.state._replace(inner=inner)


def _check_rounding_args(param_rounding, seed) -> None:
  """``param_rounding`` a method of :func:`adamkit.param_rounding`; ``seed`` only with
  ``"stochastic"`` (its type is checked where the key is made)."""
  if param_rounding is None:
    raise ValueError("`seed` selects the random bits of param_rounding='stochastic'; this "
                     "fused step has no param_rounding.")
  _validate.check_choice("param_rounding", param_rounding, _rounding.METHODS)
  if seed is not None and param_rounding != "stochastic":
    raise ValueError(f"`seed` selects the random bits of param_rounding='stochastic'; "
                     f"param_rounding={param_rounding!r} draws none.")


@_validate.foreign_keywords
def fused_adam(learning_rate: _schedules.ScalarOrSchedule = 1e-3, b1: float = 0.9,
               b2: float = 0.999, eps: float = 1e-8, *, eps_mode: str = "hat",
               nesterov: bool = False, amsgrad: bool = False, weight_decay: Any = 0.0,
               weight_decay_mask: _masks.MaskSpec = _masks.MINDSPORE_DEFAULT,
               mu_dtype: Any = None, nu_dtype: Any = None, multi_tensor: bool = True,
               backend: str = "auto", lazy: bool = True, unique_ids: bool = False,
               param_rounding: str | None = None, seed: Any = None) -> FusedStep:
  r"""Adam as one fused step that returns the new params (the fast path of :func:`adam`
  and, for row-sparse gradients, of :func:`sparse_adam`).

  .. math::

    g &\leftarrow g + \lambda_t w \quad \text{(L2 decay, masked)} \\
    m_t &= \beta_1 m_{t-1} + (1-\beta_1) g \\
    v_t &= \beta_2 v_{t-1} + (1-\beta_2) g^2 \\
    \bar v_t &= \max(\bar v_{t-1}, v_t) \text{ if amsgrad else } v_t \\
    w &\leftarrow w - \alpha_t\, u_t(m_t, \bar v_t) \quad \text{(} u_t \text{ of }
        \mathtt{scale\_by\_adam}\text{)}

  The same numbers as ``optax.apply_updates(params, adam(...).update(...)[0])`` with the
  same options, computed in one pass: on CPU by a C++ kernel through ``jax.ffi`` when it is
  built (:func:`build_cpu_kernel`), else by plain JAX. Jit ``step(params, state, grads=grads)``
  with ``donate_argnums=(0, 1)`` so the kernel works in place.

  A gradient leaf may be a :class:`adamkit.RowSparse` (an embedding table's rows). With
  ``lazy=True`` only its rows move, as in ``ak.sparse_adam(...)`` + ``ak.apply_updates``
  (MindSpore ``FusedSparseLazyAdam``; decay per occurrence of a touched row): on one CPU
  device one kernel call merges the ids and reads and writes each touched row of the table
  and of both moments once, in place, so the step costs ``O(k)`` for ``k`` ids whatever the
  table size (quantized moments: XLA gathers and scatters the touched rows' codes and
  scales, see ``nu_dtype``). ``lazy=False`` densifies it (``FusedSparseAdam``: every row
  moves).

  Also an ``optax.GradientTransformation`` over the same state: ``update(grads, state,
  params)`` returns :math:`-\alpha_t u_t` computed as :func:`adam` computes it (plain JAX;
  ``update`` + ``optax.apply_updates`` is :func:`adam`'s result bit for bit op by op), for
  ``optax.chain``, ``nnx.Optimizer`` and :func:`master_weights`; ``step`` is the one-pass
  path that saves ``optax.apply_updates``' extra pass (about 40 bytes of traffic per
  parameter instead of 28).

  .. warning::
    Only the options listed here are fused; clipping, loss scale, groups and gradient
    centralization need :func:`adam` (or ``optax.chain`` before the fused transform). The
    state keeps no learning-rate record: :func:`get_lr` raises on it.

  Args:
    learning_rate: :math:`\alpha_t` (default 1e-3): a number >= 0, an array of per-step
      rates or a schedule, as in :func:`adamkit.adam`.
    b1: decay :math:`\beta_1` of the first moment, in [0, 1) (default 0.9).
    b2: decay :math:`\beta_2` of the second moment, in [0, 1) (default 0.999).
    eps: :math:`\epsilon`, added to the denominator (default 1e-8), finite and at least
      1.18e-38.
    eps_mode: where :math:`\epsilon` enters (default ``"hat"``, MindSpore ``nn.Adam``;
      ``"corrected"``: optax, PyTorch, Paddle), as in :func:`adamkit.scale_by_adam`.
    nesterov: MindSpore's ``use_nesterov`` numerator (default ``False``).
    amsgrad: divide by the running maximum of the raw :math:`v_t` (default ``False``):
      a third buffer (8 more bytes of traffic per float32 parameter), and the state is a
      :class:`FusedAmsgradState`.
    weight_decay: L2 coefficient :math:`\lambda_t` (default 0.0: no decay), a number >= 0
      or a schedule, added to the gradient (``ak.L1Decay`` / ``ak.L2Decay`` need
      :func:`adamkit.adam`).
    weight_decay_mask: which leaves decay (default: MindSpore's rule, no ``"beta"`` or
      ``"gamma"`` in the path; ``None``: every leaf), as in :func:`adamkit.adam`.
    mu_dtype: storage of the first moment (default: the params' dtype): a float dtype
      (e.g. ``jnp.bfloat16`` to halve its memory) or a quantized format,
      :class:`adamkit.Quantized` or its kind alone (``"8bit"``: bitsandbytes'/torchao's
      block-wise format, 1 byte per parameter plus a scale per block; ``"4bit"``: half a
      byte; ``"fp8"``). The arithmetic is always float32 or wider.
    nu_dtype: dtype of the second moment (default: the params' dtype). Either moment may
      be quantized, ``ak.Quantized(kind, ...)`` or the kind alone (``"8bit"``, ``"4bit"``,
      ``"fp8"``; AMSGrad's running maximum takes ``nu_dtype``'s format): the step
      dequantizes, updates in float32 and requantizes. ``"8bit"`` runs on the C++ kernel,
      one pass per block of 256 (read p, g and the 1-byte codes; write p and the codes: 16
      bytes per parameter instead of 28) with the codes of the XLA path bit for bit;
      ``"4bit"`` and ``"fp8"`` run on XLA. XLA steps a leaf over chunks of blocks, each
      chunk's params, codes and scales read once and overwritten in place (strided rows
      where the codes keep the leaf's rows, so a sharded param steps shard by shard), so
      no float32 moment of the whole leaf is made and nothing is copied when the state is
      donated (float32 params; bf16 and fp16 params keep a one-pass form, whose
      temporaries are leaf-sized). In multi-tensor mode the quantized leaves share
      one flat buffer of codes (each leaf from a block's start) keyed by the kind; leaves
      under ``min_size`` keep float32 moments. A lazy row-sparse table takes quantized
      moments when each of its rows is whole blocks (a block size dividing the row, per
      leaf or in the flat buffer; per leaf also one block per row): the step gathers the
      touched rows' codes and scales, dequantizes, steps and requantizes them (the 4-bit
      dither at the table's positions ``row * D + column``) and scatters them back, in XLA,
      ``O(k)``; untouched rows keep their codes and scales bit for bit, and the numbers are
      :func:`sparse_adam`'s with the same format. A block spanning rows is a
      ``ValueError`` naming the leaf (a smaller block, ``lazy=False`` or
      :func:`sparse_adam`, which takes one block per row then).
    multi_tensor: keep the moments of all leaves of a dtype in one flat buffer and update
      runs of up to 32 float32 leaves per kernel call (default ``True``; Paddle
      ``use_multi_tensor``); ``False``: state shaped like the params (and sharded like
      them), one kernel call per leaf of at least 32K elements (smaller leaves: XLA).
      Params sharded on a mesh with Explicit axes need ``False``. On TPUs pass
      ``False``: the flat buffer is another layout than the params' tiles, and each step
      copies between them (8-bit moments of a 4096x4096 leaf, compiled for one v5e chip:
      4.28 bytes per parameter of temporaries against 0; docs/accelerators.md).
    backend: ``"auto"`` (default: the kernel, when built, for float32 leaves computed on
      one CPU device; XLA otherwise, e.g. for params sharded over several devices, whose
      shardings XLA keeps), ``"kernel"`` (error if not built; still XLA for arrays it
      cannot take or known to span several devices) or ``"xla"`` (pure JAX). The rule:
      ``docs/backend.md``.
    lazy: a ``RowSparse`` gradient moves its rows only (default ``True``) or is
      densified (``False``: every row moves).
    unique_ids: the caller guarantees no repeated id in a ``RowSparse`` gradient: skip the
      merge (default ``False``; as in :func:`sparse_adam`).
    param_rounding: bf16/fp16 params without a float32 master copy: ``"nearest"``,
      ``"stochastic"`` or ``"kahan"``, the rule of :func:`adamkit.param_rounding` applied
      in the step's own pass. Each low-precision leaf is stepped in float32 (float32
      moments, unless quantized) and written back rounded: ``step`` writes what
      ``optax.apply_updates`` writes from ``ak.param_rounding(ak.fused_adam(...),
      method).update``, bit for bit on XLA; the C++ kernel reads and writes bf16 params
      (and Kahan buffers) itself, rounding as XLA does (for fp16 params, quantized moments
      and row-sparse tables: XLA). The state and ``update`` are the wrapper's
      (:class:`KahanState`, :class:`StochasticRoundingState`, :class:`NearestRoundingState`
      around this step's own). float32 leaves pass straight through. ``None`` (default):
      low-precision params are stepped in their own dtype, moments too.
    seed: with ``param_rounding="stochastic"``: an int (``seed=s`` is the key
      ``jax.random.key(s)``, the default 0), a JAX key or a raw ``uint32[2]`` key; an
      error with any other ``param_rounding``.

  Returns:
    A :class:`FusedStep` (``init``, ``update``, ``step``), state :class:`FusedAdamState`
    (with ``amsgrad``: :class:`FusedAmsgradState`; with ``param_rounding``: the
    wrapper's, around it).

  Raises:
    ValueError: an unknown ``param_rounding``, a ``seed`` without
      ``param_rounding="stochastic"`` or outside ``[0, 2**64)``; at ``step`` / ``update``,
      a lazy ``RowSparse`` leaf whose quantized moments' blocks span its rows.
    TypeError: a ``seed`` that is not an int or a key; at ``step``, a state of another
      ``param_rounding`` or of none.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, adamkit as ak
    >>> opt = ak.fused_adam(0.1, eps_mode="corrected")  # the optax form
    >>> params = {"w": jnp.array([1.0, -2.0])}
    >>> updates, state = opt.update({"w": jnp.array([2.0, -4.0])}, opt.init(params), params)
    >>> optax.apply_updates(params, updates)["w"]
    Array([ 0.9, -1.9], dtype=float32)

    >>> opt = ak.fused_adam(0.1)
    >>> params = {"emb": jnp.zeros((1_000_000, 4))}
    >>> step = jax.jit(opt.step, donate_argnums=(0, 1))
    >>> grads = {"emb": ak.RowSparse(jnp.array([7, 7, 42]), jnp.ones((3, 4)), 1_000_000)}
    >>> params, state = step(params, opt.init(params), grads=grads)  # 2 rows of 1M move
    >>> jnp.flatnonzero(params["emb"][:, 0]).tolist()  # each moved by about -lr * sign(g)
    [7, 42]

    >>> opt = ak.fused_adam(0.1, eps_mode="corrected")
    >>> params = {"w": jnp.array([1.0, -2.0])}
    >>> step = jax.jit(opt.step, donate_argnums=(0, 1))
    >>> params, state = step(params, opt.init(params), grads={"w": jnp.array([2.0, -4.0])})
    >>> params["w"]
    Array([ 0.9, -1.9], dtype=float32)

    >>> opt = ak.fused_adam(0.1, eps_mode="corrected", amsgrad=True)  # one more buffer
    >>> state = opt.init(params)
    >>> type(state).__name__, state.nu_max["float32"].shape
    ('FusedAmsgradState', (2,))

    >>> opt = ak.fused_adam(0.1, mu_dtype="8bit", nu_dtype="8bit")  # 2.03 bytes per param
    >>> state = opt.init({"w": jnp.zeros((64, 256)), "b": jnp.zeros(256)})
    >>> state.mu["8bit"].codes.dtype, state.mu["8bit"].codes.shape, state.mu["float32"].shape
    (dtype('uint8'), (64, 256), (256,))

  References:
    DeepSpeed ``DeepSpeedCPUAdam`` (a one-pass CPU Adam for offloading) and
    ``torch.optim.Adam(fused=True)``, for the idea; the numbers are :func:`adamkit.adam`'s.
  """
  return _fused("adam", learning_rate, b1, b2, eps, eps_mode=eps_mode, nesterov=nesterov,
                weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
                mu_dtype=mu_dtype, nu_dtype=nu_dtype, multi_tensor=multi_tensor,
                backend=backend, lazy=lazy, unique_ids=unique_ids, amsgrad=amsgrad,
                param_rounding=param_rounding, seed=seed)


@_validate.foreign_keywords
def fused_adamw(learning_rate: _schedules.ScalarOrSchedule = 1e-3, b1: float = 0.9,
                b2: float = 0.999, eps: float = 1e-8, *, weight_decay: Any = 0.01,
                weight_decay_mask: _masks.MaskSpec = _masks.MINDSPORE_DEFAULT,
                bias_correction: bool = True, eps_mode: str = "corrected",
                amsgrad: bool = False, mu_dtype: Any = None, nu_dtype: Any = None,
                multi_tensor: bool = True, backend: str = "auto", lazy: bool = True,
                unique_ids: bool = False, param_rounding: str | None = None,
                seed: Any = None) -> FusedStep:
  r"""AdamW (decoupled weight decay) as one fused step that returns the new params (the
  fast path of :func:`adamw`).

  .. math::

    m_t &= \beta_1 m_{t-1} + (1-\beta_1) g \\
    v_t &= \beta_2 v_{t-1} + (1-\beta_2) g^2 \\
    \bar v_t &= \max(\bar v_{t-1}, v_t) \text{ if amsgrad else } v_t \\
    u_t &= u_t(m_t, \bar v_t) + \lambda_t w \quad \text{(} u_t \text{ of }
        \mathtt{scale\_by\_adam}\text{; decay masked)} \\
    w &\leftarrow w - \alpha_t\, u_t

  The same numbers as ``optax.apply_updates(params, adamw(...).update(...)[0])`` with the
  same options, in one pass over memory (28 bytes per float32 parameter; 36 with
  ``amsgrad``): on CPU by the C++ kernel when it is built, else by plain JAX. The decay is
  computed as :func:`adamw` computes it, :math:`w - \alpha_t (u_t + \lambda_t w)`, for
  both framework forms: MindSpore ``nn.AdamWeightDecay`` is
  ``fused_adamw(lr, b1, b2, 1e-6, weight_decay=wd, bias_correction=False,
  eps_mode="hat")``; Paddle ``AdamW`` and ``torch.optim.AdamW`` (which scale
  :math:`w \leftarrow w(1-\alpha_t\lambda)` first) are ``fused_adamw(lr, b1, b2, eps,
  weight_decay=coeff, weight_decay_mask=None)``, equal to float32 rounding.

  A gradient leaf may be a :class:`adamkit.RowSparse`: with ``lazy=True`` only its rows
  move, as in :func:`sparse_adamw` + :func:`apply_updates` (each touched row decays once
  per step, rows not looked up do not decay), in one kernel call on one CPU device (with
  quantized moments: in XLA, the touched rows' codes and scales only, when the block
  divides the row; see :func:`fused_adam`'s ``nu_dtype``); ``lazy=False`` densifies it
  (every row moves and decays).

  Also an ``optax.GradientTransformation`` (``update``, :func:`adamw`'s numbers; see
  :func:`fused_adam`).

  .. warning::
    Clipping, loss scale, groups and ``nonfinite`` need :func:`adamw`. The defaults are :func:`adamw`'s
    (``eps_mode="corrected"``, ``weight_decay=0.01``, MindSpore's decay mask: pass
    ``weight_decay_mask=None`` for Paddle, PyTorch and optax).

  Args:
    learning_rate: :math:`\alpha_t` (default 1e-3), as in :func:`adamkit.adamw`; it
      multiplies the decay too.
    b1: decay :math:`\beta_1` of the first moment, in [0, 1) (default 0.9).
    b2: decay :math:`\beta_2` of the second moment, in [0, 1) (default 0.999).
    eps: :math:`\epsilon`, added to the denominator (default 1e-8; MindSpore
      ``AdamWeightDecay``: 1e-6), finite and at least 1.18e-38.
    weight_decay: the decoupled coefficient :math:`\lambda_t` (default 0.01, as Paddle and
      PyTorch), a number >= 0 or a schedule.
    weight_decay_mask: which leaves decay (default: MindSpore's rule, no ``"beta"`` or
      ``"gamma"`` in the path; ``None``: every leaf, as Paddle, PyTorch and optax).
    bias_correction: divide by :math:`1-\beta^t` (default ``True``); ``False`` is
      MindSpore ``nn.AdamWeightDecay``.
    eps_mode: where :math:`\epsilon` enters (default ``"corrected"``, Paddle's, PyTorch's
      and optax's; ``"hat"``: MindSpore's), as in :func:`adamkit.scale_by_adam`.
    amsgrad: divide by the running maximum of the raw :math:`v_t` (default ``False``);
      the state is then a :class:`FusedAmsgradState`.
    mu_dtype: storage of the first moment (default: the params' dtype): a float dtype or
      a quantized format (:class:`adamkit.Quantized`, ``"8bit"``, ``"4bit"``, ``"fp8"``;
      see :func:`adamkit.scale_by_adam`).
    nu_dtype: storage of the second moment and of the AMSGrad maximum (default: the
      params' dtype), as ``mu_dtype`` (a lazy row-sparse table's quantized moments: see
      :func:`fused_adam`).
    multi_tensor, backend, lazy, unique_ids: as in :func:`fused_adam` (one flat buffer per
      moment storage, default ``True``; ``"auto"``, ``"kernel"`` or ``"xla"``; a
      ``RowSparse`` gradient moves its rows only, default ``True``; skip merging repeated
      ids, default ``False``).
    param_rounding: bf16/fp16 params without a float32 master copy (default ``None``), and
      ``seed``: as in :func:`fused_adam`.

  Returns:
    A :class:`FusedStep` (``init``, ``update``, ``step``), state :class:`FusedAdamState`
    (with ``amsgrad``: :class:`FusedAmsgradState`).

  Examples:
    >>> import jax, jax.numpy as jnp, adamkit as ak
    >>> opt = ak.fused_adamw(0.1, weight_decay=0.5, weight_decay_mask=None)
    >>> params = {"w": jnp.array([1.0, -2.0])}
    >>> step = jax.jit(opt.step, donate_argnums=(0, 1))
    >>> params, state = step(params, opt.init(params), grads={"w": jnp.array([0.5, 0.5])})
    >>> params["w"]  # w - lr (sign(g) + wd w)
    Array([ 0.85, -2.  ], dtype=float32)

  References:
    Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019;
    ``torch.optim.AdamW(fused=True)`` for the idea; the numbers are :func:`adamkit.adamw`'s.
  """
  if isinstance(weight_decay, (_links.L1Decay, _links.L2Decay)):
    raise TypeError(
        f"ak.fused_adamw's `weight_decay` is the decoupled coefficient (a number >= 0 or a "
        f"schedule), got {type(weight_decay).__name__}: an L2 penalty is ak.fused_adam's.")
  return _fused("adam", learning_rate, b1, b2, eps, eps_mode=eps_mode, nesterov=False,
                weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
                mu_dtype=mu_dtype, nu_dtype=nu_dtype, multi_tensor=multi_tensor,
                backend=backend, lazy=lazy, unique_ids=unique_ids, amsgrad=amsgrad,
                bias_correction=bias_correction, decoupled=True,
                param_rounding=param_rounding, seed=seed)


@_validate.foreign_keywords
def fused_adamax(learning_rate: _schedules.ScalarOrSchedule = 1e-3, b1: float = 0.9,
                 b2: float = 0.999, eps: float = 1e-8, *, weight_decay: Any = 0.0,
                 weight_decay_mask: _masks.MaskSpec = _masks.MINDSPORE_DEFAULT,
                 mu_dtype: Any = None, nu_dtype: Any = None, multi_tensor: bool = True,
                 backend: str = "auto", param_rounding: str | None = None,
                 seed: Any = None) -> FusedStep:
  r"""AdaMax as one fused step that returns the new params (the fast path of :func:`adamax`).

  .. math::

    g &\leftarrow g + \lambda_t w \quad \text{(L2 decay, masked)} \\
    m_t &= \beta_1 m_{t-1} + (1-\beta_1) g \\
    v_t &= \max(\beta_2 v_{t-1}, |g|) \\
    w &\leftarrow w - \frac{\alpha_t}{1-\beta_1^t}\,\frac{m_t}{v_t + \epsilon}

  Every argument means what it means in :func:`fused_adam` (``param_rounding`` and
  ``seed`` included); the numbers are :func:`adamkit.adamax`'s (MindSpore's
  :math:`\epsilon` placement).

  Also an ``optax.GradientTransformation`` (``update``, :func:`adamax`'s numbers; see
  :func:`fused_adam`).

  .. warning::
    The :math:`\epsilon` placement differs from optax's and PyTorch's AdaMax (see
    :func:`scale_by_adamax`).

  Args:
    learning_rate: :math:`\alpha_t` (default 1e-3), as in :func:`adamkit.adam`.
    b1: decay :math:`\beta_1` of the first moment, in [0, 1) (default 0.9).
    b2: decay :math:`\beta_2` of the infinity norm, in [0, 1) (default 0.999).
    eps: :math:`\epsilon`, added to :math:`v_t` (default 1e-8), finite and at least
      1.18e-38.
    weight_decay: L2 coefficient (default 0.0: no decay), a number >= 0 or a schedule.
    weight_decay_mask: which leaves decay (default: MindSpore's rule; ``None``: every
      leaf), as in :func:`adamkit.adam`.
    mu_dtype: storage of the first moment (default: the params' dtype): a float dtype or
      a quantized format (:class:`adamkit.Quantized`, ``"8bit"``, ``"4bit"``, ``"fp8"``;
      see :func:`adamkit.scale_by_adam`).
    nu_dtype: storage of the infinity norm (default: the params' dtype), as ``mu_dtype``.
    multi_tensor, backend: as in :func:`fused_adam` (one flat buffer per moment storage,
      default ``True``; ``"auto"``, ``"kernel"`` or ``"xla"``).

  Returns:
    A :class:`FusedStep` (``init``, ``update``, ``step``), state :class:`FusedAdamaxState`.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> opt = ak.fused_adamax(0.1)
    >>> params = {"w": jnp.array([1.0, -2.0])}
    >>> params, state = opt.step(params, opt.init(params), grads={"w": jnp.array([3.0, -1.0])})
    >>> params["w"]
    Array([ 0.9, -1.9], dtype=float32)
  """
  return _fused("adamax", learning_rate, b1, b2, eps, eps_mode="hat", nesterov=False,
                weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
                mu_dtype=mu_dtype, nu_dtype=nu_dtype, multi_tensor=multi_tensor,
                backend=backend, param_rounding=param_rounding, seed=seed)
