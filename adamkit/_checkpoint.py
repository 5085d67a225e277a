"""Named views of an optimizer state: save/restore as flat dicts, and the next learning rate."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from adamkit import _quant, _quant_ops
from adamkit._adam import ScaleByAdamState, ScaleByAmsgradState
from adamkit._adamax import ScaleByAdamaxState
from adamkit._fused import FlatMoments, FusedAdamState, FusedAmsgradState
from adamkit._links import ScaleByLearningRateState
from adamkit._sparse import ScaleBySparseAdamState
from adamkit._validate import check_non_negative, path_name

_MOMENT_STATES = (ScaleByAdamState, ScaleByAmsgradState, ScaleByAdamaxState,
                  ScaleBySparseAdamState, FusedAdamState, FusedAmsgradState)
# Per-parameter fields of a moment state and their names in a state dict.
MOMENT_FIELDS = (("mu", "moment1"), ("nu", "moment2"), ("nu_max", "moment2_max"))
# The Kahan buffer of ak.param_rounding(..., "kahan") (and the fused steps' param_rounding),
# per low-precision parameter: "<param>.compensation".
COMPENSATION = "compensation"


def _compensated_param(path) -> str | None:
  """The parameter a leaf of a ``KahanState.compensation`` tree belongs to, or ``None``
  for a leaf of any other state (the field is named only there)."""
  for i in range(len(path) - 1, -1, -1):
    key = path[i]
    if isinstance(key, jax.tree_util.GetAttrKey) and key.name == COMPENSATION:
      return path_name(path[i + 1:]) or "param"
  return None


def is_moment_state(x) -> bool:
  """A per-parameter ``(count, mu, nu[, nu_max])`` state node: Adam, AMSGrad, AdaMax,
  sparse Adam or a fused step (per leaf or multi-tensor)."""
  return isinstance(x, _MOMENT_STATES)


def _group_of(path) -> str:
  """The parameter-group label in a path through ``optax.partition``'s state, or ''."""
  for prev, key in zip(path, path[1:]):
    if isinstance(prev, jax.tree_util.GetAttrKey) and prev.name == "inner_states" and \
        isinstance(key, jax.tree_util.DictKey):
      return str(key.key)
  return ""


def _named_leaves(state: Any) -> list[tuple[str, int, Any, Any, str | None]]:
  """``(name, index, leaf, part, count)`` for every named array of ``state``: ``leaf`` is
  the ``index``-th of :func:`_units` (a quantized moment is one leaf, named as the float32
  moment it stands for); ``part`` is ``None`` (the whole leaf) or ``(offset, shape)``,
  one param's moment in a multi-tensor flat buffer (several names then share a leaf);
  ``count`` names the step count of a moment's state (``None`` for other leaves)."""
  nodes, _ = jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: is_moment_state(x) or _quant.is_qarray(x))
  n_moment = sum(1 for _, n in nodes if is_moment_state(n))
  out = []
  index = 0

  def add(name, leaf, part=None, count=None):
    out.append((name, index, leaf, part, count))

  for path, node in nodes:
    if not is_moment_state(node):
      param = _compensated_param(path)
      add("state." + (path_name(path) or "root") if param is None else f"{param}.{COMPENSATION}",
          node)
      index += 1
      continue
    group = _group_of(path)
    prefix = ""
    if n_moment > 1:
      prefix = (group or path_name(path)) + "."
    count = prefix + "step"
    add(count, node.count)
    index += 1
    for field, suffix in MOMENT_FIELDS:
      if field not in node._fields:
        continue
      moments = getattr(node, field)
      if isinstance(moments, FlatMoments):
        for key, buf in moments.items():
          for name, shape, buf_key, at in moments.slots:
            if buf_key == key:
              add(f"{name}.{suffix}", buf, (at, shape), count)
          index += 1
        continue
      for p, leaf in jax.tree_util.tree_flatten_with_path(moments, is_leaf=_quant.is_qarray)[0]:
        add(f"{path_name(p) or 'param'}.{suffix}", leaf, count=count)
        index += 1
  return out


def _units(state: Any) -> Any:
  """The tree structure of ``state`` whose leaves :func:`_named_leaves` counts: arrays,
  and each quantized moment whole."""
  return jax.tree.structure(state, is_leaf=_quant.is_qarray)


def _part(whole: np.ndarray, part) -> np.ndarray:
  if part is None:
    return whole
  at, shape = part
  return whole[at:at + int(np.prod(shape, dtype=np.int64))].reshape(shape)


def _to_numpy(leaf: Any) -> np.ndarray:
  """The whole of ``leaf`` as a NumPy array; a ``jax.Array`` spread over several processes
  is all-gathered first (a collective: every process must get here). A quantized moment
  comes out as the float32 values it stands for."""
  if _quant.is_qarray(leaf):
    return _quant_ops.to_numpy(leaf, _to_numpy)
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    if leaf.sharding.memory_kind not in (None, "device"):  # gather in device memory
      leaf = jax.device_put(leaf, leaf.sharding.with_memory_kind("device"))
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
  return np.asarray(leaf)


def state_dict(state: Any, params: Any = None) -> dict[str, np.ndarray]:
  """A flat dict of named NumPy arrays for ``state``: MindSpore/Paddle-style names.

  Moments are named after the parameter they belong to: ``"<param>.moment1"`` (first
  moment, Paddle ``moment1`` / MindSpore ``moment1.<param>``), ``"<param>.moment2"`` and,
  with AMSGrad, ``"<param>.moment2_max"`` (Paddle ``moment2_max``, MindSpore ``vhat``);
  a quantized moment (:class:`adamkit.Quantized`) appears as the float32 values it
  stands for, so a state dict moves between quantized and float optimizers (exact resume
  of a quantized state goes through orbax, which saves its codes and scales);
  the step count is ``"step"`` (parameter groups share it; ``"<label>.step"`` for each
  adamkit optimizer inside an ``optax.partition`` of several); the Kahan buffer of
  ``ak.param_rounding(..., "kahan")`` (or a fused step's ``param_rounding="kahan"``) is
  ``"<param>.compensation"``, in the param's dtype. Every other
  state leaf (schedule counters, ...) is kept under ``"state.<path>"`` so that
  :func:`load_state_dict` restores the whole state exactly.

  Under ``jax.distributed`` a state leaf sharded over several processes is gathered whole
  into every process (``multihost_utils.process_allgather``): a collective, so every
  process must call ``state_dict`` at the same point, and each holds the full state in
  host memory. For large states save the sharded state with orbax instead, which writes
  each process's shards only.

  Args:
    state: an optimizer state from ``tx.init`` / ``tx.update``.
    params: optional; when given, every ``"<param>.moment*"`` entry is checked to name a
      leaf of ``params`` with the same shape.

  Returns:
    ``dict[str, numpy.ndarray]``.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> params = {"fc": {"weight": jnp.ones((2, 3))}}
    >>> sd = ak.state_dict(ak.adam().init(params), params)
    >>> sorted(k for k in sd if not k.startswith("state."))
    ['fc.weight.moment1', 'fc.weight.moment2', 'step']
  """
  named = _named_leaves(state)
  names = [n for n, *_ in named]
  dupes = {n for n in names if names.count(n) > 1}
  if dupes:
    raise ValueError(f"state_dict: names {sorted(dupes)} are ambiguous in this state.")
  wholes = {}  # a flat buffer is gathered once for all the params it holds
  out = {}
  for name, index, leaf, part, _ in named:
    if index not in wholes:
      wholes[index] = _to_numpy(leaf)
    out[name] = _part(wholes[index], part)
  if params is not None:
    shapes = {path_name(p): np.shape(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    for name, arr in out.items():
      if name.endswith((".moment1", ".moment2", ".moment2_max", f".{COMPENSATION}")):
        pname = name.rsplit(".", 1)[0]
        if pname in shapes and shapes[pname] != arr.shape:
          raise ValueError(f"state_dict: '{name}' has shape {arr.shape}, param has {shapes[pname]}.")
  return out


def load_state_dict(flat: dict[str, Any], like_state: Any, *, strict: bool = True) -> Any:
  """The inverse of :func:`state_dict`: a state shaped like ``like_state``.

  Each array is cast to the dtype of the matching leaf of ``like_state`` (quantized, where
  that leaf is a quantized moment: a multi-tensor fused buffer is filled with its params'
  float32 values and quantized whole) and, where that leaf is a ``jax.Array``, placed with
  the same sharding (device and memory kind: an offloaded state comes back in host
  memory). Under ``jax.distributed`` each process
  places only the shards its own devices hold (no collective); every process passes the
  same whole ``flat``, e.g. from :func:`state_dict`.

  Args:
    flat: the dict from :func:`state_dict` (NumPy or JAX arrays).
    like_state: a template, typically ``tx.init(params)``.
    strict: if True, keys in ``flat`` that the template does not have raise an error.

  Raises:
    KeyError: a name the template needs is missing from ``flat``.
    ValueError: a shape differs from the template, or (``strict``) unknown keys.
  """
  named = _named_leaves(like_state)
  missing = [n for n, *_ in named if n not in flat]
  if missing:
    raise KeyError(f"load_state_dict: missing entries {missing[:8]}{'...' if len(missing) > 8 else ''}.")
  if strict:
    extra = set(flat) - {n for n, *_ in named}
    if extra:
      raise ValueError(f"load_state_dict: unexpected entries {sorted(extra)[:8]}.")
  values, likes, steps, names = {}, {}, {}, {}
  for name, index, like, part, count in named:
    value = np.asarray(flat[name])
    want = tuple(like.shape) if part is None else tuple(part[1])
    if value.shape != want:
      raise ValueError(f"load_state_dict: '{name}' has shape {value.shape}, expected {want}.")
    likes[index] = like
    # a quantized moment is filled with the float32 values it stands for, quantized whole
    # below (a multi-tensor buffer once all its params' parts are in)
    value = value.astype(np.float32 if _quant.is_qarray(like) else like.dtype)
    if _quant.is_qarray(like):
      # the 4-bit dither of the loaded state's step (quantize(m_t) at count t)
      steps[index] = 0 if count is None else flat[count]
      names.setdefault(index, name)
    if part is None:
      values[index] = value
    else:  # one param's moment in a flat buffer: the buffer is filled part by part
      buf = values.setdefault(index, np.zeros(np.shape(like), value.dtype))
      buf[part[0]:part[0] + value.size] = value.ravel()
  for index, step in steps.items():
    values[index] = _quant_ops.quantized_like(values[index], likes[index], step,
                                              name=f"load_state_dict: '{names[index]}'")
  leaves = []
  for index in sorted(values):
    value, like = values[index], likes[index]
    if _quant.is_qarray(like):
      leaves.append(value)
    elif isinstance(like, jax.Array) and not like.is_fully_addressable:
      leaves.append(jax.make_array_from_callback(value.shape, like.sharding,
                                                 lambda idx, v=value: v[idx]))
    elif isinstance(like, jax.Array):
      leaves.append(jax.device_put(value, like.sharding))
    else:
      leaves.append(jnp.asarray(value))
  return jax.tree.unflatten(_units(like_state), leaves)


def _unwrap(x):
  """The array inside a Flax NNX variable (``nnx.Optimizer`` wraps every state leaf)."""
  if isinstance(x, (jax.Array, np.ndarray)):
    return x
  return x.get_value() if hasattr(x, "get_value") else x


def _field(node, name):
  """``node.name`` for a NamedTuple, ``node[name]`` for its pure-dict form
  (``nnx.to_pure_dict``), else ``None``."""
  if isinstance(node, Mapping):
    return node.get(name)
  return getattr(node, name, None) if isinstance(node, tuple) else None


def _injected(state):
  """The ``hyperparams`` dict of an ``inject_hyperparams`` state (or its pure-dict form)
  that holds ``learning_rate``, or ``None``."""
  hyper = _field(state, "hyperparams")
  if isinstance(hyper, Mapping) and "learning_rate" in hyper:
    return hyper
  return None


def _is_fused_state(x) -> bool:
  return isinstance(x, (FusedAdamState, FusedAmsgradState))


def _is_lr_record(x) -> bool:
  return isinstance(x, ScaleByLearningRateState) or (
      isinstance(x, Mapping) and set(x) == set(ScaleByLearningRateState._fields))


def get_lr(state: Any):
  """The learning rate the next ``update`` will use (Paddle ``Optimizer.get_lr``).

  Returns a float32 scalar, or ``{group: scalar}`` when the optimizer has parameter
  groups (the ungrouped leaves are ``"default"``). ``state`` may be an optimizer state,
  an ``optax.inject_hyperparams`` / ``ak.inject_hyperparams`` state (the injected
  ``learning_rate`` is the one returned, so a rate changed with :func:`set_lr` or by hand
  is followed), a Flax ``nnx.Optimizer`` (or its ``opt_state``), or the
  ``nnx.to_pure_dict`` form of one.

  .. warning::
    With parameter groups inside ``inject_hyperparams``, the per-group rates returned are
    those recorded at the last ``update``; a rate injected since shows from the next one.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> tx = ak.adam([0.1, 0.05, 0.01])
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> ak.get_lr(state)
    Array(0.1, dtype=float32)
    >>> _, state = tx.update({"w": jnp.ones(2)}, state, params)
    >>> ak.get_lr(state)
    Array(0.05, dtype=float32)
  """
  state = getattr(state, "opt_state", state)  # an nnx.Optimizer
  found = [(p, n) for p, n in
           jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_lr_record)[0]
           if _is_lr_record(n)]
  hyper = None
  for node in jax.tree.leaves(state, is_leaf=lambda x: _injected(x) is not None):
    if _injected(node) is not None:
      hyper = _injected(node)
      break
  records = [_field(n, "next_lr") for _, n in found]
  if hyper is not None and len(found) <= 1 and not any(isinstance(r, Mapping) for r in records):
    return jnp.asarray(_unwrap(hyper["learning_rate"]), jnp.float32)
  if not found:
    fused = [n for n in jax.tree.leaves(state, is_leaf=_is_fused_state) if _is_fused_state(n)]
    if fused:
      raise ValueError(
          f"get_lr: a fused step's state ({type(fused[0]).__name__}) has no adamkit "
          "learning-rate link (it keeps no record of the rate). The rate of its next step "
          "is your `learning_rate` at the steps taken: "
          "ak.as_schedule(learning_rate)(state.count) (a constant rate is the number itself). "
          "To read (and set) it from the state, inject it: "
          "ak.inject_hyperparams(ak.fused_adam)(learning_rate=...) is the optax form (its "
          "`update`, no `step`), whose state ak.get_lr / ak.set_lr read; or use ak.adam / "
          "ak.adamw, whose state records the rate.")
    raise ValueError(
        "get_lr: this state has no adamkit learning-rate link: pass the state of an adamkit "
        "optimizer (ak.adam, ak.adamw, ...), of ak.inject_hyperparams(...) or of an "
        "nnx.Optimizer holding one.")
  if len(found) == 1:
    record = records[0]
    if isinstance(record, Mapping):  # parameter groups: {group: rate}
      return {group: _unwrap(rate) for group, rate in record.items()}
    return _unwrap(record)
  return {(_group_of(p) or path_name(p)): _unwrap(r) for (p, _), r in zip(found, records)}


def set_lr(state: Any, learning_rate: Any) -> Any:
  """A copy of an ``inject_hyperparams`` state whose next ``update`` uses ``learning_rate``
  (Paddle ``Optimizer.set_lr``); :func:`get_lr` then returns it.

  Only an injected learning rate can be set: a plain optimizer's rate comes from its
  schedule at every step, so wrap the optimizer with ``ak.inject_hyperparams`` (or
  ``optax.inject_hyperparams``) to change it while training.

  Args:
    state: the state of ``ak.inject_hyperparams(ak.adam)(learning_rate=...)`` (or of any
      optimizer injected with a ``learning_rate``).
    learning_rate: a number >= 0 (or a 0-d array), stored in the injected dtype.

  Returns:
    The new state (the input is not modified).

  Raises:
    ValueError: ``state`` has no injected learning rate, or a negative rate.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> tx = ak.inject_hyperparams(ak.adam)(learning_rate=0.1)
    >>> state = ak.set_lr(tx.init({"w": jnp.zeros(2)}), 0.01)
    >>> ak.get_lr(state)
    Array(0.01, dtype=float32)
  """
  hyper = _injected(state)
  if hyper is None:
    raise ValueError(
        "set_lr: `state` has no injected learning rate; build the optimizer with "
        "ak.inject_hyperparams(ak.adam)(learning_rate=...) to change the rate while "
        "training (a plain optimizer's rate comes from its schedule).")
  check_non_negative("learning_rate", learning_rate)
  old = hyper["learning_rate"]
  new_hyper = dict(hyper, learning_rate=jnp.asarray(learning_rate, jnp.asarray(old).dtype))
  if isinstance(state, Mapping):
    return {**state, "hyperparams": new_hyper}
  return state._replace(hyperparams=new_hyper)
