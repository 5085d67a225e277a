r"""Import optimizer state saved by Paddle or MindSpore into an adamkit state.

Both frameworks keep Adam's moments per parameter under predictable names:

- Paddle (``Adam`` and ``AdamW``): ``<param>_moment1_0``, ``<param>_moment2_0``, with
  ``amsgrad=True`` also ``<param>_moment2_max_0``, and the step in
  ``<param>_beta1_pow_acc_0`` :math:`=\beta_1^{t+1}` (it starts at :math:`\beta_1`);
- MindSpore: ``moment1.<param>``, ``moment2.<param>`` (``nn.Adam``, ``nn.AdaMax``), with
  ``use_amsgrad=True`` also ``vhat.<param>``, or ``adam_m.<param>``, ``adam_v.<param>``
  (``nn.AdamWeightDecay``), and the step in ``beta1_power`` :math:`=\beta_1^t`.

The functions here take such a dict of arrays (``paddle.load(path, return_numpy=True)``
of a ``.pdopt`` file, or ``{k: v.asnumpy() for k, v in mindspore.load_checkpoint(path)
.items()}``), start from ``tx.init(params)`` and fill every Adam / AdaMax state node with
the framework's moments and step, so that training continues on the same trajectory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adamkit import _quant, _quant_ops
from adamkit._adamax import ScaleByAdamaxState
from adamkit._checkpoint import MOMENT_FIELDS, is_moment_state
from adamkit._fused import FlatMoments, FusedAdamaxState
from adamkit._links import ScaleByLearningRateState
from adamkit._validate import path_name

Names = Union[None, Mapping[str, str], Callable[[str], str]]


def from_paddle_state(pdopt: Mapping[str, Any], params: optax.Params,
                      tx: optax.GradientTransformation, *, names: Names = None,
                      step: int | None = None, b1: float = 0.9, b2: float = 0.999,
                      strict: bool = True) -> optax.OptState:
  r"""An adamkit state holding the moments and step of a Paddle ``Adam`` state dict.

  For a parameter named ``p`` Paddle stores :math:`m_t` as ``p_moment1_0``, :math:`v_t` as
  ``p_moment2_0``, AMSGrad's running maximum as ``p_moment2_max_0`` (``Adam`` /
  ``AdamW(amsgrad=True)``; it fills :class:`~adamkit.ScaleByAmsgradState`'s ``nu_max``) and
  the accumulators ``p_beta1_pow_acc_0`` :math:`=\beta_1^{t+1}` and
  ``p_beta2_pow_acc_0`` :math:`=\beta_2^{t+1}` (they start at :math:`\beta` and are
  multiplied by it after each step). The step is

  .. math::

    t = \mathrm{round}\left(\frac{\log(\texttt{beta1\_pow\_acc})}{\log \beta_1}\right) - 1

  (from ``beta2_pow_acc`` once :math:`\beta_1^{t+1}` has underflowed).

  Args:
    pdopt: the optimizer's state dict as arrays (``paddle.load(..., return_numpy=True)``
      of a ``.pdopt`` file). Entries that are not per-parameter accumulators
      (``LR_Scheduler``, ``master_weights``) are ignored.
    params: the adamkit params, e.g. a dict keyed by Paddle's parameter names.
    tx: the adamkit optimizer that will continue training; use
      ``ak.adam(..., eps_mode="corrected", weight_decay_mask=None)`` for Paddle's ``Adam``,
      ``ak.adamw(..., eps_mode="corrected", weight_decay_mask=None)`` for ``AdamW`` (the
      same accumulators), with ``amsgrad=True`` where Paddle had it.
    names: how a leaf's dotted path becomes a Paddle name: ``None`` (the path itself),
      a dict ``{path: paddle_name}`` or a callable ``path -> paddle_name``.
    step: the number of steps taken, if known; otherwise read from the accumulators.
    b1, b2: the betas Paddle ran with (only used to read the step).
    strict: raise if a leaf has no moments in ``pdopt`` (otherwise it keeps zeros).

  Returns:
    ``tx.init(params)`` with every :class:`~adamkit.ScaleByAdamState` filled in and every
    step counter set to the step.

  Examples:
    >>> import numpy as np, jax.numpy as jnp, adamkit as ak
    >>> params = {"linear_0.w_0": jnp.zeros(2)}
    >>> pdopt = {"linear_0.w_0_moment1_0": np.array([0.1, 0.2], np.float32),
    ...          "linear_0.w_0_moment2_0": np.array([1e-3, 4e-3], np.float32),
    ...          "linear_0.w_0_beta1_pow_acc_0": np.array([0.9 ** 4], np.float32),
    ...          "linear_0.w_0_beta2_pow_acc_0": np.array([0.999 ** 4], np.float32)}
    >>> tx = ak.adam(0.01, eps_mode="corrected", weight_decay_mask=None)
    >>> sd = ak.state_dict(ak.from_paddle_state(pdopt, params, tx))
    >>> int(sd["step"]), sd["linear_0.w_0.moment1"]
    (3, array([0.1, 0.2], dtype=float32))
  """

  def lookup(name, what):
    return _find_suffixed(pdopt, name, what)

  return _import(
      lookup, params, tx, names=names, step=step, strict=strict, framework="Paddle",
      powers=lambda: _paddle_powers(pdopt), b1=b1, b2=b2, power_offset=1,
      allow_adamax=False)


def from_mindspore_state(ckpt: Mapping[str, Any], params: optax.Params,
                         tx: optax.GradientTransformation, *, names: Names = None,
                         step: int | None = None, b1: float = 0.9, b2: float = 0.999,
                         strict: bool = True) -> optax.OptState:
  r"""An adamkit state holding the moments and step of a MindSpore checkpoint.

  ``nn.Adam`` and ``nn.AdaMax`` save :math:`m_t` as ``moment1.<param>`` and the second
  moment (:math:`v_t`, or AdaMax's infinity norm) as ``moment2.<param>``, next to the
  scalars ``beta1_power`` :math:`=\beta_1^t` and (Adam) ``beta2_power``
  :math:`=\beta_2^t`; ``nn.Adam(use_amsgrad=True)`` keeps the running maximum of
  :math:`v_t` as ``vhat.<param>`` (it fills :class:`~adamkit.ScaleByAmsgradState`'s
  ``nu_max``). ``nn.AdamWeightDecay`` names its moments ``adam_m.<param>`` and
  ``adam_v.<param>`` and keeps no beta powers. The step is
  :math:`t = \mathrm{round}(\log(\texttt{beta1\_power}) / \log\beta_1)`. (``global_step``
  is only advanced with a dynamic learning rate or weight decay, so it is a last resort;
  for ``AdamWeightDecay`` with a constant rate pass ``step=``: without bias correction
  any step continues the same trajectory.)

  Args:
    ckpt: the checkpoint as arrays, e.g. ``{k: v.asnumpy() for k, v in
      mindspore.load_checkpoint(path).items()}``; the network's own weights may be in it.
    params: the adamkit params, e.g. a dict keyed by MindSpore's parameter names.
    tx: the adamkit optimizer that will continue (``ak.adam`` or ``ak.adamax`` with
      MindSpore's defaults, ``ak.adam(amsgrad=True)`` for ``use_amsgrad``, or
      ``ak.adamw(..., bias_correction=False, eps_mode="hat")`` for ``AdamWeightDecay``).
    names: how a leaf's dotted path becomes a MindSpore name: ``None`` (the path itself),
      a dict ``{path: mindspore_name}`` or a callable ``path -> mindspore_name``.
    step: the number of steps taken, if known; otherwise read from ``beta1_power``.
    b1, b2: the betas MindSpore ran with (only used to read the step).
    strict: raise if a leaf has no moments in ``ckpt`` (otherwise it keeps zeros).

  Returns:
    ``tx.init(params)`` with every :class:`~adamkit.ScaleByAdamState` /
    :class:`~adamkit.ScaleByAdamaxState` filled in and every step counter set.

  Examples:
    >>> import numpy as np, jax.numpy as jnp, adamkit as ak
    >>> params = {"fc": {"weight": jnp.zeros(2)}}
    >>> ckpt = {"moment1.fc.weight": np.array([0.1, 0.2], np.float32),
    ...         "moment2.fc.weight": np.array([1e-3, 4e-3], np.float32),
    ...         "beta1_power": np.array([0.9 ** 5], np.float32)}
    >>> sd = ak.state_dict(ak.from_mindspore_state(ckpt, params, ak.adam(0.01)))
    >>> int(sd["step"]), sd["fc.weight.moment2"]
    (5, array([0.001, 0.004], dtype=float32))
  """

  def lookup(name, what):
    hits = [f"{prefix}.{name}" for prefix in _MINDSPORE_PREFIXES[what]
            if f"{prefix}.{name}" in ckpt]
    if len(hits) > 1:
      raise ValueError(f"Several MindSpore moments match {name!r}/{what}: {hits}.")
    return (hits[0], ckpt[hits[0]]) if hits else None

  def powers():
    return {k: ckpt[k] for k in ("beta1_power", "beta2_power", "global_step") if k in ckpt}

  return _import(
      lookup, params, tx, names=names, step=step, strict=strict, framework="MindSpore",
      powers=powers, b1=b1, b2=b2, power_offset=0, allow_adamax=True)


# --------------------------------------------------------------------------- helpers

# adamkit's state-dict suffix -> MindSpore's parameter prefixes: nn.Adam / nn.AdaMax
# (``moment1``, ``moment2``, ``vhat`` with use_amsgrad) and nn.AdamWeightDecay
# (``adam_m``, ``adam_v``).
_MINDSPORE_PREFIXES = {"moment1": ("moment1", "adam_m"), "moment2": ("moment2", "adam_v"),
                       "moment2_max": ("vhat",)}


def _find_suffixed(pdopt, name, what):
  """Paddle's ``<name>_<what>_<k>``; ``k`` is a unique-name counter, usually 0."""
  pattern = re.compile(re.escape(f"{name}_{what}_") + r"\d+")
  keys = [k for k in pdopt if isinstance(k, str) and pattern.fullmatch(k)]
  if len(keys) > 1:
    raise ValueError(f"Several Paddle accumulators match {name!r}/{what}: {sorted(keys)}.")
  return (keys[0], pdopt[keys[0]]) if keys else None


def _paddle_powers(pdopt):
  """Paddle keeps one beta-power pair per parameter; they must all agree."""
  found = {}
  for what in ("beta1_pow_acc", "beta2_pow_acc"):
    pattern = re.compile(r".+_" + what + r"_\d+")
    values = {float(np.asarray(v).reshape(-1)[0]) for k, v in pdopt.items()
              if isinstance(k, str) and pattern.fullmatch(k)}
    if len(values) > 1:
      raise ValueError(
          f"Paddle's {what} differs between parameters ({sorted(values)}): groups with "
          "different betas or parameters added mid-training; pass `step=` explicitly.")
    if values:
      found[what.replace("_pow_acc", "_power")] = values.pop()
  return found


def _steps_from_powers(powers, b1, b2, offset, framework):
  """The step count from ``beta**(t + offset)``; checks the two betas agree."""
  estimates = []
  for key, beta in (("beta1_power", b1), ("beta2_power", b2)):
    if key not in powers:
      continue
    acc = float(np.asarray(powers[key], np.float64).reshape(-1)[0])
    if not 0.0 < acc <= 1.0:  # underflowed (or never written): says nothing
      continue
    exact = math.log(acc) / math.log(beta) - offset
    estimates.append((key, exact))
  if not estimates:
    if "global_step" in powers and int(np.asarray(powers["global_step"]).reshape(-1)[0]) > 0:
      return int(np.asarray(powers["global_step"]).reshape(-1)[0])
    raise ValueError(f"Cannot read the step from the {framework} state; pass `step=`.")
  key, exact = estimates[0]
  t = round(exact)
  # float32 powers lose about 6e-8 relative per multiplication: allow that, no more.
  for other, value in estimates:
    if abs(value - t) > 0.05 + 1e-6 * abs(value) / abs(math.log(b2 if "2" in other else b1)):
      raise ValueError(
          f"{framework}'s {other} does not match b1={b1}, b2={b2} at a whole step "
          f"(reads {value:.3f}); pass the betas it ran with, or `step=`.")
  if t < 0:
    raise ValueError(f"{framework}'s {key} gives a negative step ({t}).")
  return t


def _leaf_names(tree, names: Names):
  def rename(path):
    name = path if isinstance(path, str) else path_name(path)
    if names is None:
      return name
    if callable(names):
      return names(name)
    return names.get(name, name)
  return rename


def _map_states(state, fn):
  """Applies ``fn`` to every NamedTuple node of ``state`` (innermost first)."""
  if isinstance(state, tuple) and hasattr(state, "_fields"):
    children = [_map_states(c, fn) for c in state]
    return fn(type(state)(*children))
  if isinstance(state, (tuple, list)):
    return type(state)(_map_states(c, fn) for c in state)
  if isinstance(state, dict):
    return {k: _map_states(v, fn) for k, v in state.items()}
  return state


def _like(value, old, step=0):
  """``value`` as an array with the dtype, shape and placement of ``old`` (quantized in
  ``old``'s format where ``old`` is a quantized moment, at step count ``step``)."""
  if _quant.is_qarray(old):
    return _quant_ops.quantized_like(value, old, step)
  arr = np.asarray(value).astype(old.dtype)
  if arr.shape != old.shape:
    raise ValueError(f"shape {arr.shape} does not match the parameter's {old.shape}")
  # Keep the placement init chose (committed like the params, sharded, host memory): the
  # jitted step then compiles once; an uncommitted leaf stays uncommitted.
  if isinstance(old, jax.Array) and old.committed:
    return jax.device_put(arr, old.sharding)
  return jnp.asarray(arr)


def _set_count(count, t):
  return _like(np.asarray(t, np.int64), count) if isinstance(count, jax.Array) else count


def _import(lookup, params, tx, *, names, step, strict, framework, powers, b1, b2,
            power_offset, allow_adamax):
  t = step if step is not None else _steps_from_powers(powers(), b1, b2, power_offset,
                                                       framework)
  if t < 0:
    raise ValueError(f"`step` must be >= 0, got {t}.")
  rename = _leaf_names(params, names)
  missing = []

  def framework_value(path, like, what):
    """The framework's ``what`` for the leaf at ``path`` (or named so), shaped and typed
    as ``like``; ``None`` if it has none."""
    name = rename(path)
    hit = lookup(name, what)
    if hit is None:
      missing.append(f"{name} ({what})")
      return None
    key, value = hit
    try:
      return _like(value, like, t)
    except ValueError as e:
      raise ValueError(f"{framework} entry {key!r}: {e}") from None

  def fill_tree(tree, what):
    if isinstance(tree, FlatMoments):  # multi-tensor: each param's moment in its buffer
      bufs = {k: np.array(b) for k, b in tree.items()}
      for name, shape, key, at in tree.slots:
        value = framework_value(name, jax.ShapeDtypeStruct(shape, bufs[key].dtype), what)
        if value is not None:
          bufs[key][at:at + value.size] = np.asarray(value).ravel()
      return tree.replace({k: _like(b, tree[k], t) for k, b in bufs.items()})
    def leaf(path, old):
      new = framework_value(path, old, what)
      return old if new is None else new
    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=_quant.is_qarray)

  def fill(node):
    if is_moment_state(node):
      if isinstance(node, (ScaleByAdamaxState, FusedAdamaxState)) and not allow_adamax:
        raise ValueError(
            f"{framework}'s Adamax keeps eps inside its infinity norm; ak.adamax follows "
            "MindSpore, so this state would not continue the same trajectory.")
      moments = {field: fill_tree(getattr(node, field), what)
                 for field, what in MOMENT_FIELDS if field in node._fields}
      return node._replace(count=_set_count(node.count, t), **moments)
    if "count" in node._fields:
      return node._replace(count=_set_count(node.count, t))
    return node

  state = tx.init(params)
  found = []
  _map_states(state, lambda n: found.append(n) or n if is_moment_state(n) else n)
  if not found:
    raise ValueError("`tx`'s state has no Adam or AdaMax moments to fill.")
  state = _map_states(state, fill)
  if strict and missing:
    raise KeyError(f"No {framework} moments for: {', '.join(missing)}.")
  if t > 0:
    state = _refresh_learning_rates(state, params, tx, t)
  return state


def _refresh_learning_rates(state, params, tx, t):
  """``ScaleByLearningRateState.next_lr`` records the rate of the next step, which only
  the schedule inside ``tx`` knows: take it from one update from step ``t - 1``."""
  lr_nodes = []
  _map_states(state, lambda n: lr_nodes.append(n) or n
              if isinstance(n, ScaleByLearningRateState) else n)
  if not lr_nodes:
    return state
  before = _map_states(state, lambda n: n._replace(count=_set_count(n.count, t - 1))
                       if "count" in n._fields else n)
  zeros = jax.tree.map(jnp.zeros_like, params)
  _, after = tx.update(zeros, before, params)
  fresh = []
  _map_states(after, lambda n: fresh.append(n) or n
              if isinstance(n, ScaleByLearningRateState) else n)
  it = iter(fresh)
  return _map_states(state, lambda n: jax.tree.map(_like, next(it), n)
                     if isinstance(n, ScaleByLearningRateState) else n)
