"""AdaMax: the ``scale_by_adamax`` primitive and the named ``adamax`` optimizer."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from adamkit import _groups, _links, _masks, _quant_ops, _schedules, _validate
from adamkit._adam import bias_corrections, check_adam_hyper, tree_map_multi
from adamkit._tree import through_variables


class ScaleByAdamaxState(NamedTuple):
  count: jax.Array  # int32 scalar, steps taken (saturates at int32 max)
  mu: optax.Updates  # first moment, params' shapes, ``mu_dtype`` or the params' dtype
  # infinity norm max(b2 * nu, |g|), ``nu_dtype`` (a quantized one: as a second moment)
  # or the params' dtype
  nu: optax.Updates


def adamax_direction(g, m, v, *, b1, b2, eps, bc1):
  """One leaf of the AdaMax step, in the docstring's order. Returns ``(u, m, v)``."""
  cplx = jnp.iscomplexobj(g)
  if cplx:  # strict promotion: the float32 scalars join the complex dtype
    b1, eps, bc1 = (jnp.asarray(x, g.dtype) for x in (b1, eps, bc1))
  m = b1 * m + (1.0 - b1) * g
  v = jnp.maximum(b2 * v.real, jnp.abs(g)).astype(g.dtype) if cplx else jnp.maximum(b2 * v, jnp.abs(g))
  u = m / (bc1 * (v + eps))
  return u, m, v


@_validate.foreign_keywords
def scale_by_adamax(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                    mu_dtype: Any = None, nu_dtype: Any = None) -> optax.GradientTransformation:
  r"""Rescales updates by AdaMax's moments, MindSpore ``nn.AdaMax``'s formula.

  .. math::

    m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t \\
    v_t &= \max(\beta_2 v_{t-1}, |g_t|) \\
    u_t &= \frac{1}{1-\beta_1^t}\,\frac{m_t}{v_t + \epsilon}

  .. warning::
    optax's ``scale_by_adamax`` and ``torch.optim.Adamax`` put :math:`\epsilon` inside
    the max (:math:`v_t = \max(\beta_2 v_{t-1}, |g_t| + \epsilon)`) and divide by
    :math:`v_t` alone; MindSpore adds it outside. The answers differ whenever
    :math:`|g|` is small against :math:`\epsilon`.

  Args:
    b1: decay :math:`\beta_1` of the first moment, in [0, 1) (default 0.9; MindSpore
      ``beta1``).
    b2: decay :math:`\beta_2` of the infinity norm :math:`v`, in [0, 1) (default 0.999;
      ``beta2``).
    eps: :math:`\epsilon`, added to :math:`v_t` in the denominator (default 1e-8),
      finite and at least float32's smallest normal number (1.18e-38).
    mu_dtype: storage of the first moment (default: the params' dtype): a float dtype
      (e.g. ``jnp.bfloat16`` to halve its memory) or a quantized format,
      :class:`adamkit.Quantized` or its kind alone (``"8bit"``: bitsandbytes'/torchao's
      block-wise format, 1 byte per parameter plus a scale per block; ``"4bit"``: half a
      byte; ``"fp8"``). The arithmetic is always float32 or wider.
    nu_dtype: storage of the infinity norm :math:`v` (default: the params' dtype), a float
      dtype or a quantized format (stored as a non-negative second moment).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`ScaleByAdamaxState`.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> tx = ak.scale_by_adamax(eps=1e-8)
    >>> u, _ = tx.update({"w": jnp.array([2.0, -4.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> u["w"]  # first step: (1-b1) g / ((1-b1) (|g| + eps)) = sign(g)
    Array([ 1., -1.], dtype=float32)

  References:
    Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, section 7.1.
    Reproduces MindSpore 2.10 ``nn.AdaMax``.
  """
  mu_dtype, nu_dtype = check_adam_hyper(b1, b2, eps, mu_dtype, nu_dtype)

  def init_fn(params):
    _validate.check_float_params(params, complex_ok=True)
    return ScaleByAdamaxState(count=jnp.zeros([], jnp.int32),
                              mu=_quant_ops.zero_moments(params, mu_dtype, "mu"),
                              nu=_quant_ops.zero_moments(params, nu_dtype, "nu"))

  def update_fn(updates, state, params=None):
    _validate.check_dense_grads(updates, "ak.scale_by_adamax")
    _validate.check_state(state, ScaleByAdamaxState, "ak.scale_by_adamax", updates)
    _quant_ops.check_moments(updates, state.mu, mu_dtype, "mu", "first moment")
    _quant_ops.check_moments(updates, state.nu, nu_dtype, "nu", "infinity norm")
    updates = _validate.float_grads(updates, params)
    count = optax.safe_increment(state.count)
    bc1, _ = bias_corrections(b1, b2, count)
    b1_, b2_, eps_ = (jnp.asarray(x, jnp.float32) for x in (b1, b2, eps))

    def step(g, m, v):
      return adamax_direction(g, m, v, b1=b1_, b2=b2_, eps=eps_, bc1=bc1)

    rule = _quant_ops.MomentRule("adamax", b1_, b2_)

    def leaf(g, m_old, v_old):
      return _quant_ops.leaf_step(step, g, (m_old, v_old), count, rule)

    u, mu, nu = tree_map_multi(leaf, 3, updates, state.mu, state.nu)
    return u, ScaleByAdamaxState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(*through_variables(init_fn, update_fn))


@_validate.foreign_keywords
def adamax(learning_rate: _schedules.ScalarOrSchedule = 1e-3, b1: float = 0.9,
           b2: float = 0.999, eps: float = 1e-8, *, weight_decay: Any = 0.0,
           weight_decay_mask: _masks.MaskSpec = _masks.MINDSPORE_DEFAULT,
           loss_scale: float = 1.0, grad_clip: _links.GradClip = None,
           grad_centralization: bool = False, groups=None, mu_dtype: Any = None,
           nu_dtype: Any = None, nonfinite: str = "propagate") -> optax.GradientTransformation:
  r"""AdaMax with MindSpore's options (``nn.AdaMax``), as a chain of primitives.

  .. math::

    g &\leftarrow \mathrm{centralize}(\mathrm{decay}(\mathrm{clip}(g / s))) \\
    w &\leftarrow w - \alpha_t\, u_t \quad \text{(} u_t \text{ from }
        \mathtt{scale\_by\_adamax}\text{)}

  Every keyword means what it means in :func:`adamkit.adam`.

  Args:
    learning_rate: :math:`\alpha_t` (default 1e-3), every form :func:`adamkit.adam`
      accepts: a number >= 0, an array of per-step rates or a schedule ``count -> lr``.
    b1: decay :math:`\beta_1` of the first moment, in [0, 1) (default 0.9).
    b2: decay :math:`\beta_2` of the infinity norm, in [0, 1) (default 0.999).
    eps: :math:`\epsilon`, added to :math:`v_t` in the denominator (default 1e-8),
      finite and at least 1.18e-38; MindSpore's placement (see :func:`scale_by_adamax`).
    weight_decay: L2 coefficient (default 0.0: no decay), a number >= 0 or a schedule, or
      ``ak.L1Decay(c)`` / ``ak.L2Decay(c)``; added to the gradient (coupled).
    weight_decay_mask: which leaves decay (default: MindSpore's rule, no ``"beta"`` or
      ``"gamma"`` in the path; ``None``: every leaf), as in :func:`adamkit.adam`.
    loss_scale: gradients are divided by it first, > 0 (default 1.0).
    grad_clip: an ``ak.ClipGrad*`` or any optax transform (default ``None``), applied
      after unscaling and before decay.
    grad_centralization: centralize leaves with ndim > 1 (default ``False``).
    groups: parameter groups (default ``None``), as in :func:`adamkit.adam`.
    mu_dtype: storage of the first moment (default: the params' dtype): a float dtype or
      a quantized format (:class:`adamkit.Quantized`, ``"8bit"``, ``"4bit"``, ``"fp8"``;
      see :func:`adamkit.scale_by_adam`).
    nu_dtype: storage of the infinity norm (default: the params' dtype), as ``mu_dtype``.
    nonfinite: ``"propagate"`` (default) or ``"skip"``, as in :func:`adamkit.adam`.

  Returns:
    An ``optax.GradientTransformation``.

  .. warning::
    The :math:`\epsilon` placement is MindSpore's, not optax's or PyTorch's: see
    :func:`scale_by_adamax`.

  Examples:
    >>> import jax.numpy as jnp, optax, adamkit as ak
    >>> params = {"w": jnp.array([1.0, -2.0])}
    >>> tx = ak.adamax(0.1)
    >>> updates, _ = tx.update({"w": jnp.array([3.0, -1.0])}, tx.init(params), params)
    >>> optax.apply_updates(params, updates)["w"]
    Array([ 0.9, -1.9], dtype=float32)
  """
  check_adam_hyper(b1, b2, eps, mu_dtype, nu_dtype)
  _validate.check_bool("grad_centralization", grad_centralization)

  def direction(b1, b2, eps):
    return scale_by_adamax(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype)

  return _groups.build_named(
      direction, learning_rate=learning_rate, hyper=dict(b1=b1, b2=b2, eps=eps),
      weight_decay=weight_decay, weight_decay_mask=weight_decay_mask, loss_scale=loss_scale,
      grad_clip=grad_clip, groups=groups, grad_centralization=grad_centralization,
      nonfinite=nonfinite, dense_only="ak.adamax", complex_ok=True)
