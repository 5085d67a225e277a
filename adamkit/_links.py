"""Chain links that the named optimizers are made of.

Each is a small optax ``GradientTransformation``. The named optimizers
(``adam``, ``adamax``, ``sparse_adam``) are nothing but a chain of these around their
``scale_by_*`` primitive, in MindSpore's order:

  check -> unscale (loss scale) -> clip -> weight decay -> centralize -> direction -> -lr
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from adamkit import _masks, _schedules, _validate
from adamkit._dtypes import compute_dtype
from adamkit._sparse_types import RowSparse, gather_rows, is_row_sparse, map_values, safe_ids

# ---------------------------------------------------------------------------- checks


def check_inputs(dense_only: str | None = None, *,
                 complex_ok: bool = False) -> optax.GradientTransformation:
  """Rejects integer params at ``init`` (complex ones too unless ``complex_ok``) and
  gradients that do not match the params (and, with ``dense_only`` naming the optimizer,
  row-sparse gradients); casts integer gradients to their params' dtype, as optax's
  arithmetic promotes them.

  Stateless; every check happens while tracing, so it costs nothing in the compiled step.
  """

  def init_fn(params):
    _validate.check_float_params(params, complex_ok=complex_ok)
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    if dense_only:
      _validate.check_dense_grads(updates, dense_only)
    else:
      _validate.check_row_ids_untouched(updates)
    _validate.check_matching_trees(updates, params)
    # Python-number gradients (optax accepts them) become arrays for the links after this,
    # and integer ones take their param's dtype (optax promotes them; never an int update).
    as_array = lambda g: g if hasattr(g, "dtype") else jnp.asarray(g)  # noqa: E731
    updates = jax.tree.map(as_array, updates, is_leaf=is_row_sparse)
    return _validate.float_grads(updates, params), state

  return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------- loss scale


def scale_by_loss_scale(loss_scale: float) -> optax.GradientTransformation:
  r"""Divides the gradient by a fixed loss scale: :math:`g \leftarrow g / s`.

  MindSpore's ``loss_scale`` argument (used with ``FixedLossScaleManager(drop_overflow_
  update=False)``): the gradients arrive multiplied by ``s`` and are restored here, before
  clipping and weight decay, so the decay term is ``wd * w`` whatever ``s`` is. Stateless;
  a literal ``1.0`` leaves the gradients untouched.
  """
  _validate.check_positive("loss_scale", loss_scale)

  def update_fn(updates, state, params=None):
    del params
    if _is_literal(loss_scale, 1):
      return updates, state
    inv = 1.0 / jnp.asarray(loss_scale, jnp.float32)
    unscale = lambda g: map_values(lambda x: x * inv.astype(x.dtype), g)  # noqa: E731
    return jax.tree.map(unscale, updates, is_leaf=is_row_sparse), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


# ------------------------------------------------------------------------- clipping


@dataclasses.dataclass(frozen=True)
class ClipGradByGlobalNorm:
  r"""Paddle ``ClipGradByGlobalNorm``: :math:`g \leftarrow g \cdot c / \max(\|g\|_2, c)`,
  the norm taken over every leaf together."""

  clip_norm: float


@dataclasses.dataclass(frozen=True)
class ClipGradByNorm:
  r"""Paddle ``ClipGradByNorm``: each leaf on its own,
  :math:`g \leftarrow g \cdot c / \max(\|g\|_2, c)`."""

  clip_norm: float


@dataclasses.dataclass(frozen=True)
class ClipGradByValue:
  r"""Paddle ``ClipGradByValue``: :math:`g \leftarrow \mathrm{clip}(g, min, max)`;
  ``min`` defaults to ``-max``."""

  max: float
  min: float | None = None


GradClip = Union[None, ClipGradByGlobalNorm, ClipGradByNorm, ClipGradByValue,
                 optax.GradientTransformation]


def _sq_norm(g) -> jax.Array:
  r""":math:`\|g\|_2^2` in float32 (or wider); for a :class:`RowSparse` the norm of its
  dense equivalent, duplicate ids summed first."""
  if isinstance(g, RowSparse):
    g = g.coalesce().values
  g = g.astype(compute_dtype(g))
  return jnp.sum(jnp.abs(g) ** 2 if jnp.iscomplexobj(g) else g * g).astype(jnp.float32)


def _scaled_by(g, factor):
  def scale(x):
    dt = compute_dtype(x)
    return (x.astype(dt) * factor.astype(dt)).astype(x.dtype)
  return map_values(scale, g)


def clip_by_global_norm(clip_norm: float) -> optax.GradientTransformation:
  r"""Global L2-norm clipping (Paddle ``ClipGradByGlobalNorm``):
  :math:`g \leftarrow g \cdot c / \max(\|g\|_2, c)`, the norm over every leaf together.

  As ``optax.clip_by_global_norm`` for dense leaves; a :class:`RowSparse` leaf counts
  with the norm of its dense equivalent (duplicate ids summed) and keeps its ids.
  """
  _validate.check_positive("clip_norm", clip_norm)

  def update_fn(updates, state, params=None):
    del params
    leaves = [g for g in jax.tree.leaves(updates, is_leaf=is_row_sparse) if g is not None]
    norm = jnp.sqrt(sum((_sq_norm(g) for g in leaves), jnp.zeros([], jnp.float32)))
    factor = clip_norm / jnp.maximum(norm, clip_norm)
    return jax.tree.map(lambda g: _scaled_by(g, factor), updates, is_leaf=is_row_sparse), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


def clip_by_norm(clip_norm: float) -> optax.GradientTransformation:
  """Per-leaf L2-norm clipping (Paddle ``ClipGradByNorm``); a :class:`RowSparse` leaf
  counts with the norm of its dense equivalent."""
  _validate.check_positive("clip_norm", clip_norm)

  def update_fn(updates, state, params=None):
    del params

    def clip(g):
      factor = clip_norm / jnp.maximum(jnp.sqrt(_sq_norm(g)), clip_norm)
      return _scaled_by(g, factor)

    return jax.tree.map(clip, updates, is_leaf=is_row_sparse), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


def clip_by_value(max_value: float, min_value: float | None = None):
  """Element-wise clipping to ``[min_value, max_value]`` (Paddle ``ClipGradByValue``).

  A :class:`RowSparse` leaf is coalesced first (duplicate ids summed), so what is clipped
  is its dense equivalent; its zero rows stay zero when ``min <= 0 <= max``.
  """
  lo = -max_value if min_value is None else min_value
  if not lo < max_value:
    raise ValueError(f"`min` must be < `max` for ClipGradByValue, got min={lo}, max={max_value}.")

  def clip(g):
    if isinstance(g, RowSparse):
      if not lo <= 0 <= max_value:
        raise ValueError(
            f"ClipGradByValue(min={lo}, max={max_value}) moves the zero rows a RowSparse "
            "gradient leaves out; only a range that holds 0 keeps the gradient sparse.")
      g = g.coalesce()
      return g.with_values(jnp.clip(g.values, lo, max_value).astype(g.dtype))
    return jnp.clip(g, lo, max_value).astype(g.dtype)

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(clip, updates, is_leaf=is_row_sparse), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


def as_clip(grad_clip: GradClip) -> optax.GradientTransformation | None:
  """The optax transform for one of Paddle's clip strategies (or a transform itself)."""
  if grad_clip is None:
    return None
  if isinstance(grad_clip, ClipGradByGlobalNorm):
    return clip_by_global_norm(grad_clip.clip_norm)
  if isinstance(grad_clip, ClipGradByNorm):
    return clip_by_norm(grad_clip.clip_norm)
  if isinstance(grad_clip, ClipGradByValue):
    return clip_by_value(grad_clip.max, grad_clip.min)
  if isinstance(grad_clip, optax.GradientTransformation):
    return grad_clip
  raise TypeError(
      "`grad_clip` must be None, ak.ClipGradByGlobalNorm, ak.ClipGradByNorm, "
      f"ak.ClipGradByValue or an optax GradientTransformation; got {type(grad_clip).__name__}.")


# ---------------------------------------------------------------------- weight decay


@dataclasses.dataclass(frozen=True)
class L2Decay:
  r"""L2 regularisation added to the gradient: :math:`g \leftarrow g + c\,w`.

  A plain number given as ``weight_decay`` means the same (MindSpore and Paddle).
  """

  coeff: Any = 0.0


@dataclasses.dataclass(frozen=True)
class L1Decay:
  r"""Paddle's ``L1Decay``: :math:`g \leftarrow g + c\,\mathrm{sign}(w)`."""

  coeff: Any = 0.0


def _is_literal(value, number) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and value == number


def add_decay(weight_decay: Any = 0.0, mask: _masks.MaskSpec = None, *,
              kind: str = "l2") -> optax.GradientTransformationExtraArgs:
  r"""Adds an L2 (:math:`g + \lambda_t w`) or L1 (:math:`g + \lambda_t\,\mathrm{sign}(w)`)
  penalty's gradient to the leaves chosen by ``mask``.

  ``weight_decay`` is a number ``>= 0`` or a schedule ``count -> value`` (MindSpore's
  dynamic weight decay). This is coupled L2 decay, as in MindSpore ``nn.Adam`` and Paddle
  ``Adam(weight_decay=float)``, not AdamW's decoupled decay. The state is always
  ``optax.EmptyState``: a schedule reads the step from ``update(..., count=t)``, which a
  named optimizer's chain passes down from its direction's ``count`` (one step counter
  per optimizer). A literal ``0`` leaves the gradients untouched and needs no ``params``.
  """
  _validate.check_choice("kind", kind, ("l2", "l1"))
  scheduled = callable(weight_decay)
  if not scheduled:
    _validate.check_non_negative("weight_decay", weight_decay)

  def update_fn(updates, state, params=None, *, count=None, **extra):
    del extra
    if _is_literal(weight_decay, 0):
      return updates, state
    if params is None:
      raise ValueError("Weight decay needs `params`: call `update(grads, state, params)`.")
    wd = _schedules.scalar_or_schedule(weight_decay, _step("weight_decay", scheduled, count))
    keep = _masks.resolve_mask(mask, params)

    def decay(g, w, k):
      if g is None or not k:
        return g
      if isinstance(g, RowSparse):  # MindSpore: only the touched rows decay
        w = gather_rows(w, safe_ids(g.indices, g.num_rows))
        return g.with_values(decay(g.values, w, k))
      term = w if kind == "l2" else jnp.sign(w)
      # float32 arithmetic, but a complex w keeps its imaginary part (as optax's decay)
      dt = compute_dtype(term) if jnp.iscomplexobj(term) else jnp.float32
      return g + (wd.astype(dt) * term.astype(dt)).astype(g.dtype)

    new = jax.tree.map(decay, updates, params, keep,
                       is_leaf=lambda x: x is None or is_row_sparse(x))
    return new, state

  return optax.GradientTransformationExtraArgs(lambda _: optax.EmptyState(), update_fn)


def _step(name: str, scheduled: bool, count):
  """The step a scheduled link evaluates its schedule at: ``count`` handed down by the
  optimizer's chain (a constant needs none)."""
  if count is not None:
    return count
  if scheduled:
    raise ValueError(
        f"A scheduled `{name}` reads the step from `update(..., count=t)`, which a named "
        "adamkit optimizer passes down from its direction's count; in a plain optax.chain "
        "use optax's scheduled transforms (e.g. optax.scale_by_learning_rate).")
  return 0


def add_decoupled_decay(weight_decay: Any = 0.0,
                        mask: _masks.MaskSpec = None) -> optax.GradientTransformation:
  r"""Decoupled weight decay (AdamW): adds :math:`\lambda_t w` to the *direction*.

  .. math::

    u \leftarrow u + \lambda_t\, w \quad\text{(leaves chosen by mask)}

  The arithmetic is :func:`add_decay`'s; what makes the decay decoupled is where the link
  sits: after the ``scale_by_*`` direction and before the learning rate, so the decay never
  enters Adam's moments and the rate multiplies it,
  :math:`w \leftarrow w - \alpha_t (u + \lambda_t w)`. That is MindSpore
  ``nn.AdamWeightDecay`` literally (``update += wd * param``, then ``param -= lr * update``)
  and ``optax.add_decayed_weights`` in ``optax.adamw``; Paddle ``AdamW`` and
  ``torch.optim.AdamW`` first scale :math:`w \leftarrow w(1 - \alpha_t\lambda)` and then
  take the Adam step, which expands to the same update (the two differ by float32 rounding
  only, a few units in the last place of :math:`w` per step).

  Args:
    weight_decay: :math:`\lambda`, a number ``>= 0`` or a schedule ``count -> value``.
    mask: which leaves decay (any form :func:`adamkit.masks.resolve_mask` takes).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with an empty state; ``update``
    needs ``params``.

  Examples:
    >>> import jax.numpy as jnp, optax, adamkit as ak
    >>> params = {"w": jnp.array([2.0, -4.0])}
    >>> tx = optax.chain(ak.scale_by_adam(), ak.add_decoupled_decay(0.5),
    ...                  ak.scale_by_learning_rate(0.1))
    >>> u, _ = tx.update({"w": jnp.zeros(2)}, tx.init(params), params)
    >>> u["w"]  # zero gradient: only the decay, -lr * wd * w
    Array([-0.1,  0.2], dtype=float32)
  """
  return add_decay(weight_decay, mask, kind="l2")


# -------------------------------------------------------------- centralization


def centralize_gradients() -> optax.GradientTransformation:
  r"""Gradient centralization (MindSpore ``grad_centralization``).

  For every leaf with ``ndim > 1``: :math:`g \leftarrow g - \mathrm{mean}(g)` over all
  axes but the first (the output-channel axis of a kernel). 0-d and 1-D leaves are left
  alone.
  """

  def centralize(g):
    if g is None or g.ndim <= 1:
      return g
    axes = tuple(range(1, g.ndim))
    mean = jnp.mean(g.astype(jnp.float32), axis=axes, keepdims=True)
    return (g.astype(jnp.float32) - mean).astype(g.dtype)

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(centralize, updates), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


# -------------------------------------------------------------------- learning rate


class ScaleByLearningRateState(NamedTuple):
  # float32 scalar, the rate the *next* step will use. Not named `learning_rate`: inside
  # inject_hyperparams, tree_get(state, "learning_rate") finds the injected rate alone.
  next_lr: jax.Array


def scale_by_learning_rate(learning_rate: _schedules.ScalarOrSchedule
                           ) -> optax.GradientTransformationExtraArgs:
  r"""Multiplies the direction by :math:`-\alpha_t`.

  ``learning_rate`` takes every form of :func:`adamkit.as_schedule`. The state records the
  rate the next step will use, which :func:`adamkit.get_lr` reads (Paddle ``get_lr``). The
  link keeps no counter: a schedule is evaluated at ``update(..., count=t)``, the steps
  taken before this one, which a named optimizer's chain passes down from its direction's
  ``count`` (one step counter per optimizer); a constant rate needs no ``count``.
  """
  schedule = _schedules.as_schedule(learning_rate, "learning_rate")
  scheduled = not isinstance(schedule, _schedules._Constant)  # noqa: SLF001

  def init_fn(params):
    del params
    return ScaleByLearningRateState(next_lr=_lr_at(schedule, jnp.zeros([], jnp.int32)))

  def update_fn(updates, state, params=None, *, count=None, **extra):
    del params, extra
    count = jnp.asarray(_step("learning_rate", scheduled, count), jnp.int32)
    lr = _lr_at(schedule, count)

    def scale(u):
      dt = compute_dtype(u)
      return (-lr.astype(dt) * u.astype(dt)).astype(u.dtype)

    new = jax.tree.map(lambda u: map_values(scale, u), updates, is_leaf=is_row_sparse)
    return new, ScaleByLearningRateState(next_lr=_lr_at(schedule, optax.safe_increment(count)))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _lr_at(schedule, count):
  return jnp.asarray(schedule(count), jnp.float32)


def chain_on_step(*links: optax.GradientTransformation) -> optax.GradientTransformation:
  """``optax.chain(*links)`` (the same state: a tuple of the links' states) in which the
  links that take a step (:func:`add_decay`, :func:`scale_by_learning_rate`) read it from
  the one counter of the chain: the ``count`` of its direction (``scale_by_*``), the steps
  taken before this update.
  """

  links = tuple(optax.with_extra_args_support(link) for link in links)

  def init_fn(params):
    return tuple(link.init(params) for link in links)

  def update_fn(updates, state, params=None, **extra):
    counts = [s.count for s in state if "count" in getattr(s, "_fields", ())]
    if len(counts) != 1:
      raise ValueError(f"chain_on_step needs exactly one link with a `count`, got {len(counts)}.")
    new_state = []
    for link, s in zip(links, state):
      updates, s = link.update(updates, s, params, count=counts[0], **extra)
      new_state.append(s)
    return updates, tuple(new_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
