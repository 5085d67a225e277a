"""Parameter groups (MindSpore / Paddle ``params=[{...}, ...]``) and the named-optimizer
builder every ``ak.<algo>(learning_rate, ...)`` shares.

A named optimizer is::

  chain(check_inputs, unscale, clip,                          # global, over every leaf
        chain_on_step(decay, centralize, direction, -lr))     # per group settings

Loss scale and clipping are global (Paddle's global-norm clip sees every leaf at once).
With parameter groups each link of the second chain is :func:`grouped`: every group's
leaves go through that group's link, and the links' states are merged into one state
shaped as without groups (one ``count``, one moment tree over every parameter, a
``{group: rate}`` learning-rate record). That is MindSpore's and Paddle's model too: one
optimizer with one step counter and per-parameter group settings.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from adamkit import _links, _masks, _quant_ops, _schedules, _validate
from adamkit._sparse_types import is_row_sparse
from adamkit._tree import place_scalars_like

_UNSET = None


@dataclasses.dataclass(frozen=True)
class Group:
  """One parameter group: which leaves, and what they override.

  Attributes:
    params: which leaves belong to the group: a glob pattern or tuple of patterns matched
      against the dotted leaf path (``'conv*'``, ``'*.bias'``), a :class:`adamkit.masks`
      rule, or a callable ``(name, leaf) -> bool``. A leaf goes to the first group that
      claims it; unclaimed leaves use the optimizer's own settings.
    lr: absolute learning rate for the group, any form ``learning_rate`` takes
      (MindSpore group ``'lr'``).
    lr_scale: multiplier of the optimizer's learning rate (Paddle group
      ``'learning_rate'``). At most one of ``lr`` and ``lr_scale``.
    weight_decay: the group's decay coefficient or schedule (default: the optimizer's).
      Inside an explicit group decay applies to every leaf of the group, whatever
      ``weight_decay_mask`` says (MindSpore: grouping replaces the name rule).
    b1, b2, eps: the group's Adam hyperparameters (Paddle groups accept ``beta1``...).
    grad_centralization: centralize the gradients of this group's leaves with ndim > 1.
    name: a label for the group (state and ``get_lr`` use it); defaults to
      ``'group<i>'``.
  """

  params: Any
  lr: Any = _UNSET
  lr_scale: Any = _UNSET
  weight_decay: Any = _UNSET
  b1: Any = _UNSET
  b2: Any = _UNSET
  eps: Any = _UNSET
  grad_centralization: bool = False
  name: str | None = None

  def claims(self, name: str, leaf: Any) -> bool:
    sel = self.params
    if isinstance(sel, str):
      return fnmatch.fnmatchcase(name, sel)
    if isinstance(sel, (tuple, list)):
      return any(fnmatch.fnmatchcase(name, p) for p in sel)
    if isinstance(sel, _masks.MaskRule):
      return bool(sel.keep(name, leaf))
    if callable(sel):
      return bool(sel(name, leaf))
    raise TypeError(
        "Group `params` must be a glob pattern, a tuple of patterns, an adamkit mask rule "
        f"or a callable (name, leaf) -> bool; got {type(sel).__name__}.")


_DICT_KEYS = {
    # MindSpore keys
    "params": "params", "lr": "lr", "weight_decay": "weight_decay",
    "grad_centralization": "grad_centralization",
    # Paddle keys: a group's 'learning_rate' multiplies the base rate
    "learning_rate": "lr_scale", "beta1": "b1", "beta2": "b2", "epsilon": "eps",
    # adamkit spellings
    "lr_scale": "lr_scale", "b1": "b1", "b2": "b2", "eps": "eps", "name": "name",
}


def as_group(spec: Group | Mapping[str, Any], index: int) -> Group:
  """Accepts a :class:`Group` or a MindSpore/Paddle-style dict."""
  if isinstance(spec, Group):
    group = spec
  elif isinstance(spec, Mapping):
    unknown = set(spec) - set(_DICT_KEYS)
    if unknown:
      raise ValueError(f"Unknown group key(s) {sorted(unknown)}; accepted: {sorted(_DICT_KEYS)}.")
    if "params" not in spec:
      raise ValueError(f"Group {index} has no 'params' key.")
    group = Group(**{_DICT_KEYS[k]: v for k, v in spec.items()})
  else:
    raise TypeError(f"`groups[{index}]` must be an ak.Group or a dict, got {type(spec).__name__}.")
  if group.lr is not None and group.lr_scale is not None:
    raise ValueError(f"Group {index}: give at most one of `lr` (absolute) and `lr_scale`.")
  if group.lr_scale is not None:
    _validate.check_non_negative(f"groups[{index}].lr_scale", group.lr_scale)
  _validate.check_bool(f"groups[{index}].grad_centralization", group.grad_centralization)
  if group.name is None:
    group = dataclasses.replace(group, name=f"group{index}")
  return group


DEFAULT_LABEL = "default"


def _labeller(groups: Sequence[Group]) -> Callable[[Any], Any]:
  def labels(params):
    def label(path, leaf):
      name = _validate.path_name(path)
      for g in groups:
        if g.claims(name, leaf):
          return g.name
      return DEFAULT_LABEL
    # optax.partition labels the gradients too: a RowSparse stands for its table, one label.
    # A Flax NNX variable gets one label too (not its value inside): the labels are then a
    # prefix of every per-parameter tree, a quantized moment (codes and scales, no
    # variable around them) included.
    return jax.tree_util.tree_map_with_path(
        label, params, is_leaf=lambda x: is_row_sparse(x) or _quant_ops.is_nnx_variable(x))
  return labels


def _scaled(schedule, factor):
  return lambda count: factor * schedule(count)


# Fields of a grouped link's state that are not per-parameter trees: the step counter
# is the optimizer's (every group's link counts the same steps), the learning-rate record
# is one rate per group.
_SHARED_FIELDS = ("count",)
_PER_GROUP_FIELDS = ("next_lr",)
# The row splits sparse Adam records at init (adamkit._row_sharded.RowSplits, keyed by
# leaf name, no arrays): every group's link reads the whole record, the merged state
# holds the union of the groups' records.
_RECORD_FIELDS = ("row_splits",)


def _select(labels, tree, name):
  """``tree`` (shaped as the params) with the leaves of the other groups masked out."""
  return jax.tree.map(lambda label, x: x if label == name else optax.MaskedNode(),
                      labels, tree)


def _merge(labels, trees: Mapping[str, Any]):
  """One tree from the groups' masked trees: each leaf from the group that owns it."""
  order = {name: i for i, name in enumerate(trees)}
  return jax.tree.map(lambda label, *xs: xs[order[label]], labels, *trees.values())


def _split_state(state, labels, name):
  if not getattr(state, "_fields", ()):
    return state
  return type(state)(**{
      f: (v if f in _SHARED_FIELDS + _RECORD_FIELDS else v[name] if f in _PER_GROUP_FIELDS
          else _select(labels, v, name))
      for f, v in zip(state._fields, state)})


def _merge_states(labels, states: Mapping[str, Any]):
  first = next(iter(states.values()))
  kinds = {type(s) for s in states.values()}
  if len(kinds) != 1:  # pragma: no cover - build_named gives every group the same links
    raise TypeError(f"grouped: the groups' links keep different states {sorted(map(str, kinds))}.")
  if not getattr(first, "_fields", ()):
    return first
  merged = {}
  for i, f in enumerate(first._fields):
    values = {name: s[i] for name, s in states.items()}
    if f in _SHARED_FIELDS:
      merged[f] = values[next(iter(values))]
    elif f in _PER_GROUP_FIELDS:
      merged[f] = values
    elif f in _RECORD_FIELDS:
      record = values[next(iter(values))]
      merged[f] = record.union(values.values()) if hasattr(record, "union") else record
    else:
      merged[f] = _merge(labels, values)
  return type(first)(**merged)


def grouped(links: Mapping[str, optax.GradientTransformation],
            labeller: Callable[[Any], Any]) -> optax.GradientTransformationExtraArgs:
  """``links[label]`` applied to the leaves labelled ``label``, with one merged state.

  Unlike ``optax.partition`` (one state per group), the state is the links' common state
  type over the whole parameter tree: per-parameter fields hold every group's leaves,
  ``count`` is stored once (the groups count the same steps), ``next_lr`` becomes
  ``{label: rate}``. Each link keeps its own state type in every group (``build_named``
  gives the groups the same links); extra arguments such as ``count=`` reach every link.
  """
  links = {name: optax.with_extra_args_support(link) for name, link in links.items()}

  def init_fn(params):
    labels = labeller(params)
    return _merge_states(labels, {name: link.init(_select(labels, params, name))
                                  for name, link in links.items()})

  def update_fn(updates, state, params=None, **extra):
    labels = labeller(updates)
    outs, states = {}, {}
    for name, link in links.items():
      outs[name], states[name] = link.update(
          _select(labels, updates, name), _split_state(state, labels, name),
          None if params is None else _select(labels, params, name), **extra)
    return _merge(labels, outs), _merge_states(labels, states)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# The direction factory is called with the resolved per-group hyperparameters; it
# returns the ``scale_by_*`` primitive of the algorithm.
DirectionFactory = Callable[..., optax.GradientTransformation]


def build_named(direction: DirectionFactory, *, learning_rate, hyper: Mapping[str, Any],
                weight_decay, weight_decay_mask, loss_scale, grad_clip, groups,
                grad_centralization=False, nonfinite="propagate",
                lr_link=None, dense_only: str | None = None,
                decoupled: bool = False, complex_ok: bool = False,
                name: str | None = None) -> optax.GradientTransformation:
  """Assembles ``check -> unscale -> clip -> [per group: decay -> gc -> direction -> -lr]``.

  ``hyper`` holds the per-group-overridable hyperparameters (``b1``, ``b2``, ``eps``),
  already validated. ``lr_link`` builds the learning-rate link (default
  :func:`adamkit._links.scale_by_learning_rate`). ``dense_only``: the optimizer's name, to
  refuse row-sparse gradients up front with a clear error. ``decoupled``: the decay link
  goes after the direction instead (AdamW: ``[gc -> direction -> decay -> -lr]``).
  ``complex_ok``: the direction trains complex parameters. ``name``: the optimizer's name
  in errors (default ``dense_only``).

  The chain's structure depends on no hyperparameter's value (a loss-scale and a decay
  link are always there, stateless when constant), so ``optax.inject_hyperparams`` of a
  named optimizer has the plain optimizer's state structure. Everything is validated here
  once; the links and primitives are built inside :func:`adamkit._validate.trusted`.
  """
  _validate.check_choice("nonfinite", nonfinite, ("propagate", "skip"))
  lr_link = lr_link or _links.scale_by_learning_rate
  decay_kind, decay_value = _decay_form(weight_decay)
  base_lr = _schedules.as_schedule(learning_rate, "learning_rate")

  def inner(lr, wd, mask, gc, hp, gc_slot=None):
    """The links ``[decay, centralize, direction, -lr]`` (decay after the direction when
    decoupled). ``gc_slot``: keep the centralization slot (an identity when ``gc`` is
    off) so that every group has the same links; default: only when ``gc``."""
    with _validate.trusted():
      if decoupled:
        decay = _links.add_decoupled_decay(wd, mask)
      else:
        decay = _links.add_decay(wd, mask, kind=decay_kind)
      links = [] if decoupled else [decay]
      if gc:
        links.append(_links.centralize_gradients())
      elif gc_slot:
        links.append(optax.identity())
      links.append(direction(**hp))
      if decoupled:
        links.append(decay)
      links.append(lr_link(lr))
    return links

  if groups is None:
    body = _links.chain_on_step(
        *inner(base_lr, decay_value, weight_decay_mask, grad_centralization, dict(hyper)))
  else:
    if isinstance(groups, (Group, Mapping)) or not isinstance(groups, Sequence):
      raise TypeError("`groups` must be a list of ak.Group or dicts.")
    resolved = [as_group(g, i) for i, g in enumerate(groups)]
    names = [g.name for g in resolved]
    if len(set(names)) != len(names) or DEFAULT_LABEL in names:
      raise ValueError(f"Group names must be unique and not {DEFAULT_LABEL!r}: {names}.")
    gc_slot = grad_centralization or any(g.grad_centralization for g in resolved)
    per_group = {DEFAULT_LABEL: inner(base_lr, decay_value, weight_decay_mask,
                                      grad_centralization, dict(hyper), gc_slot)}
    for i, g in enumerate(resolved):
      if g.lr is not None:
        lr = _schedules.as_schedule(g.lr, f"groups[{i}].lr")
      elif g.lr_scale is not None:
        lr = _scaled(base_lr, g.lr_scale)
      else:
        lr = base_lr
      wd = decay_value
      if g.weight_decay is not None:
        if decoupled and isinstance(g.weight_decay, (_links.L1Decay, _links.L2Decay)):
          raise TypeError(f"groups[{i}].weight_decay: decoupled decay takes a number or a "
                          f"schedule, not {type(g.weight_decay).__name__}.")
        g_kind, wd = _decay_form(g.weight_decay)
        if g_kind != decay_kind and not _links._is_literal(wd, 0):
          raise ValueError(f"groups[{i}].weight_decay is {g_kind} but the optimizer's is {decay_kind}.")
      hp = dict(hyper)
      for key in ("b1", "b2", "eps"):
        value = getattr(g, key)
        if value is not None:
          if key == "eps":
            _validate.check_eps(f"groups[{i}].eps", value)
          else:
            _validate.check_beta(f"groups[{i}].{key}", value)
          hp[key] = value
      # MindSpore: inside an explicit group, decay applies to every leaf (no name rule).
      per_group[g.name] = inner(lr, wd, None, g.grad_centralization, hp, gc_slot)
    labeller = _labeller(resolved)
    body = _links.chain_on_step(*(
        grouped({name: links[i] for name, links in per_group.items()}, labeller)
        for i in range(len(per_group[DEFAULT_LABEL]))))

  links = [_links.check_inputs(dense_only, complex_ok=complex_ok),
           _links.scale_by_loss_scale(loss_scale)]
  clip = _links.as_clip(grad_clip)
  if clip is not None:
    links.append(clip)
  links.append(body)
  tx = optax.chain(*links)
  if nonfinite == "skip":
    tx = skip_nonfinite(tx)
  return _scalars_placed_like_params(_checks_its_state(tx, name or dense_only or "this optimizer"))


def _checks_its_state(tx: optax.GradientTransformation, name: str) -> optax.GradientTransformation:
  """``tx`` whose ``update`` refuses a state that its ``init`` does not make, naming both.

  The check compares the outline of state types (:func:`adamkit._validate.state_outline`),
  which does not depend on the params: it is read once from an abstract ``init`` of no
  params, and costs nothing in the compiled step. Without it, another optimizer's state
  (``ak.adam``'s given to ``ak.adamw``) fails deep inside a link, naming a field.
  """
  expected: list[list[str]] = []

  def update_fn(updates, state, params=None, **extra):
    if not expected:
      expected.append(_validate.state_outline(jax.eval_shape(tx.init, {})))
    got = _validate.state_outline(state)
    if got != expected[0]:
      raise TypeError(
          f"{name}'s `update` got a state that its `init` does not make: {name} keeps "
          f"({', '.join(expected[0])}), the state given holds ({', '.join(got) or 'no state'}). "
          "Is it another optimizer's state (ak.adam's given to ak.adamw, say), or this "
          "optimizer's with other options (amsgrad, grad_clip, nonfinite, groups)? Make the "
          "state with the optimizer that updates it: state = tx.init(params); to carry "
          "another optimizer's moments over: "
          "ak.load_state_dict(ak.state_dict(old_state), tx.init(params)).")
    return tx.update(updates, state, params, **extra)

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


def _scalars_placed_like_params(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` whose ``init`` places the state's scalars (counters, learning-rate records) as
  the jitted step will return them, so committed or sharded params compile the step once
  (see :func:`adamkit._tree.place_scalars_like`)."""
  return tx._replace(init=lambda params: place_scalars_like(tx.init(params), params))


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``optax.apply_if_finite(inner, max_consecutive_errors=inf)`` (same state), whose
  skipped step returns zeros shaped like ``inner``'s updates rather than like the
  gradient: a non-lazy sparse optimizer turns a RowSparse gradient into a dense update."""

  def init_fn(params):
    return optax.ApplyIfFiniteState(
        notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True, jnp.bool_),
        total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra):
    leaves = jax.tree.leaves(updates)
    isfinite = jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in leaves], jnp.bool_))

    def apply():
      return inner.update(updates, state.inner_state, params, **extra)

    def skip():
      shapes = jax.eval_shape(apply)[0]
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), state.inner_state

    new_updates, inner_state = jax.lax.cond(isfinite, apply, skip)
    bump = lambda c: jnp.where(isfinite, c, optax.safe_increment(c))  # noqa: E731
    return new_updates, optax.ApplyIfFiniteState(
        notfinite_count=jnp.where(isfinite, 0, optax.safe_increment(state.notfinite_count)),
        last_finite=isfinite, total_notfinite=bump(state.total_notfinite),
        inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _decay_form(weight_decay):
  if isinstance(weight_decay, _links.L1Decay):
    value, kind = weight_decay.coeff, "l1"
  elif isinstance(weight_decay, _links.L2Decay):
    value, kind = weight_decay.coeff, "l2"
  else:
    value, kind = weight_decay, "l2"
  if callable(value):
    return kind, value
  _validate.check_non_negative("weight_decay", value)
  return kind, value
