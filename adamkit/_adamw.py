"""AdamW: Adam with decoupled weight decay (MindSpore ``AdamWeightDecay``, Paddle ``AdamW``)."""

from __future__ import annotations

from typing import Any

import optax

from adamkit import _adam, _groups, _links, _masks, _schedules, _validate


@_validate.foreign_keywords
def adamw(learning_rate: _schedules.ScalarOrSchedule = 1e-3, b1: float = 0.9,
          b2: float = 0.999, eps: float = 1e-8, *, weight_decay: Any = 0.01,
          weight_decay_mask: _masks.MaskSpec = _masks.MINDSPORE_DEFAULT,
          bias_correction: bool = True, eps_mode: str = "corrected", amsgrad: bool = False,
          groups=None, grad_clip: _links.GradClip = None, loss_scale: float = 1.0,
          mu_dtype: Any = None, nu_dtype: Any = None,
          nonfinite: str = "propagate") -> optax.GradientTransformation:
  r"""Adam with decoupled weight decay, as a chain of primitives.

  .. math::

    g &\leftarrow \mathrm{clip}(g / s) \quad \text{(loss scale, Paddle grad\_clip)} \\
    u_t &\leftarrow \mathtt{scale\_by\_adam}(g)
      \quad\text{(bias\_correction, eps\_mode, amsgrad)} \\
    u_t &\leftarrow u_t + \lambda_t w \quad \text{(decoupled decay, masked)} \\
    w &\leftarrow w - \alpha_t\, u_t

  The chain is ``check -> unscale -> clip -> [scale_by_adam -> add_decoupled_decay ->
  -lr]``, the bracket with each parameter group's settings (one shared state). The decay
  never enters the moments, and the learning rate (a group's ``lr`` or ``lr_scale``
  included) multiplies it.

  Porting:

  - MindSpore ``nn.AdamWeightDecay(lr, beta1, beta2, eps=1e-6, weight_decay)``:
    ``ak.adamw(lr, b1, b2, 1e-6, weight_decay=wd, bias_correction=False, eps_mode="hat")``
    (no bias correction at all; the default mask is MindSpore's ``beta``/``gamma`` rule; a
    group's own ``weight_decay`` applies to its whole group).
  - Paddle ``optimizer.AdamW(learning_rate, beta1, beta2, epsilon, weight_decay=coeff,
    apply_decay_param_fun=f, amsgrad=a)``: ``ak.adamw(learning_rate, beta1, beta2, epsilon,
    weight_decay=coeff, eps_mode="corrected", weight_decay_mask=None, amsgrad=a)``, or
    ``weight_decay_mask=ak.masks.name_rule(f)`` with ``apply_decay_param_fun``.
  - ``torch.optim.AdamW(lr, betas, eps, weight_decay, amsgrad)``: as Paddle.

  .. warning::
    Orders of the decay. MindSpore adds :math:`\lambda w` to the direction before the
    learning rate (this chain, literally, and ``optax.adamw``'s order); Paddle and PyTorch
    first scale :math:`w \leftarrow w(1-\alpha_t\lambda)` (the old :math:`w`) and then take
    the Adam step. Expanded, both are :math:`w - \alpha_t u_t - \alpha_t\lambda w`; they
    differ by float32 rounding only (a few ulps of :math:`w` per step), and the replays
    of both frameworks' trajectories agree to float32 rounding.

  .. warning::
    Defaults, against the frameworks: ``eps_mode="corrected"`` and
    ``bias_correction=True`` (the AdamW of Paddle, PyTorch and optax; unlike
    :func:`adamkit.adam`, whose default ``"hat"`` is MindSpore ``nn.Adam``'s),
    ``eps=1e-8`` (MindSpore ``AdamWeightDecay``: ``1e-6``), ``weight_decay=0.01`` (Paddle
    and PyTorch; optax ``1e-4``, MindSpore ``0.0``) and decay masked by MindSpore's name
    rule, as in :func:`adamkit.adam` (Paddle, PyTorch and optax decay every leaf: pass
    ``weight_decay_mask=None``). ``optax.adamw`` differs from the default only in that
    mask and ``weight_decay``, and in optax's float64 :math:`1-\beta` (see
    :func:`scale_by_adam`); it has no ``bias_correction=False`` (MindSpore) and its
    ``amsgrad`` analogue keeps another maximum (see :func:`scale_by_adam`).

  Args:
    learning_rate: :math:`\alpha_t` (default 1e-3): a number >= 0, a 0-d array, a 1-D
      array or iterable (step ``i`` uses element ``i``, later steps the last), or a
      schedule ``count -> lr``. It multiplies the decay too.
    b1: decay :math:`\beta_1` of the first moment, in [0, 1) (default 0.9).
    b2: decay :math:`\beta_2` of the second moment, in [0, 1) (default 0.999).
    eps: :math:`\epsilon`, added to the denominator (default 1e-8, as Paddle, PyTorch and
      optax; MindSpore ``AdamWeightDecay``: 1e-6), finite and at least 1.18e-38.
    weight_decay: the decoupled coefficient :math:`\lambda_t` (default 0.01, as Paddle
      and PyTorch), a number >= 0 or a schedule (MindSpore's dynamic weight decay). Not
      ``ak.L1Decay`` / ``ak.L2Decay``: those are penalties on the gradient,
      :func:`adamkit.adam`'s.
    weight_decay_mask: which leaves decay. Default: every leaf whose path does not contain
      ``"beta"`` or ``"gamma"`` (MindSpore). ``None``: every leaf (Paddle, PyTorch, optax).
      Also a bool pytree, a callable ``params -> bool tree`` (optax's ``mask``) or an
      ``ak.masks`` rule, e.g. ``ak.masks.name_rule(apply_decay_param_fun)`` (Paddle) or
      ``ak.masks.flax_rule()`` (Flax names: no decay on norm ``scale`` and ``bias``).
    bias_correction: divide the moments by :math:`1-\beta^t` (default ``True``, as
      Paddle, PyTorch and optax); ``False`` is MindSpore ``nn.AdamWeightDecay``.
    eps_mode: where :math:`\epsilon` enters (default ``"corrected"``: added to
      :math:`\sqrt{\hat v_t}`, as Paddle, PyTorch and optax); ``"hat"`` adds it before the
      bias correction (MindSpore). The formulas: :func:`scale_by_adam`.
    amsgrad: divide by the running maximum of the raw :math:`v_t` (default ``False``;
      Paddle and PyTorch ``amsgrad``); the state then holds ``nu_max``.
    groups: parameter groups (default ``None``), a list of :class:`adamkit.Group` or
      MindSpore/Paddle-style dicts, with ``lr`` (absolute, MindSpore), ``lr_scale``
      (Paddle's group ``learning_rate``, which also scales the decay), ``weight_decay``,
      ``b1``, ``b2``, ``eps``. Paddle's ``lr_ratio`` (a per-parameter multiplier, GPU only
      in Paddle) is a group with ``lr_scale``.
    grad_clip: ``ak.ClipGradByGlobalNorm``/``ClipGradByNorm``/``ClipGradByValue`` or any
      optax transform (default ``None``: no clipping); applied after unscaling (Paddle's
      order).
    loss_scale: gradients are divided by it first, > 0 (default 1.0; MindSpore).
    mu_dtype: storage of the first moment (default: the params' dtype): a float dtype,
      e.g. ``jnp.bfloat16`` to halve its memory, or a quantized format
      (:class:`adamkit.Quantized`, ``"8bit"``, ``"4bit"``, ``"fp8"``; see
      :func:`adamkit.scale_by_adam`). The arithmetic is always float32 or wider.
    nu_dtype: storage of the second moment and of the AMSGrad maximum (default: the
      params' dtype), as ``mu_dtype``.
    nonfinite: ``"propagate"`` (default; NaN/Inf gradients reach the params) or
      ``"skip"`` (the step is skipped, see :func:`adamkit.adam`).

  Complex parameters are trained as ``optax.adamw`` trains them (:math:`g^2` is
  :math:`|g|^2`, the decay :math:`\lambda w` keeps its imaginary part). Integer gradients
  are cast to their parameter's dtype first, as optax's arithmetic promotes them.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax.numpy as jnp, optax, adamkit as ak
    >>> params = {"fc": {"weight": jnp.array([1.0, -2.0])}, "bn": {"gamma": jnp.ones(2)}}
    >>> tx = ak.adamw(0.1, weight_decay=0.5)  # decays fc.weight, not bn.gamma
    >>> grads = {"fc": {"weight": jnp.array([0.5, 0.5])}, "bn": {"gamma": jnp.zeros(2)}}
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> optax.apply_updates(params, updates)["fc"]["weight"]  # w - lr (sign(g) + wd w)
    Array([ 0.85, -2.  ], dtype=float32)

  References:
    Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
    Reproduces MindSpore 2.10 ``nn.AdamWeightDecay`` and PaddlePaddle 3.3.1
    ``optimizer.AdamW`` (checked against their trajectories).
  """
  _adam.check_adam_hyper(b1, b2, eps, mu_dtype, nu_dtype)
  _validate.check_choice("eps_mode", eps_mode, ("hat", "corrected"))
  _validate.check_bool("bias_correction", bias_correction)
  _validate.check_bool("amsgrad", amsgrad)
  if isinstance(weight_decay, (_links.L1Decay, _links.L2Decay)):
    raise TypeError(
        f"ak.adamw's `weight_decay` is the decoupled coefficient (a number >= 0 or a "
        f"schedule), got {type(weight_decay).__name__}: an L1/L2 penalty on the gradient "
        "is ak.adam(weight_decay=...).")

  def direction(b1, b2, eps):
    return _adam.scale_by_adam(b1, b2, eps, eps_mode=eps_mode, bias_correction=bias_correction,
                               amsgrad=amsgrad, mu_dtype=mu_dtype, nu_dtype=nu_dtype)

  return _groups.build_named(
      direction, learning_rate=learning_rate, hyper=dict(b1=b1, b2=b2, eps=eps),
      weight_decay=weight_decay, weight_decay_mask=weight_decay_mask, loss_scale=loss_scale,
      grad_clip=grad_clip, groups=groups, nonfinite=nonfinite, dense_only="ak.adamw",
      decoupled=True, complex_ok=True)
