"""Adam: the ``scale_by_adam`` primitive and the named ``adam`` optimizer."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from adamkit import _groups, _links, _masks, _quant, _quant_ops, _schedules, _validate
from adamkit._tree import through_variables, tree_map_multi, zero_moments  # noqa: F401 - also imported from here


class ScaleByAdamState(NamedTuple):
  count: jax.Array  # int32 scalar, steps taken (saturates at int32 max)
  # first moment, params' shapes, ``mu_dtype`` or the params' dtype (a QuantizedArray per
  # leaf of at least ``min_size`` elements when ``mu_dtype`` is a quantized format)
  mu: optax.Updates
  nu: optax.Updates  # second moment, params' shapes, ``nu_dtype`` or the params' dtype


class ScaleByAmsgradState(NamedTuple):
  """The state of ``scale_by_adam(amsgrad=True)``: Adam's, plus the running maximum."""

  count: jax.Array  # int32 scalar, steps taken (saturates at int32 max)
  mu: optax.Updates  # first moment, params' shapes, ``mu_dtype`` or the params' dtype
  nu: optax.Updates  # second moment, params' shapes, ``nu_dtype`` or the params' dtype
  nu_max: optax.Updates  # max of every nu so far (raw, not bias-corrected), as ``nu``


def bias_corrections(b1, b2, count):
  """``(1 - b1**t, 1 - b2**t)`` as float32 scalars, ``t = count`` (1-based)."""
  t = count.astype(jnp.float32)
  return (1.0 - jnp.asarray(b1, jnp.float32) ** t, 1.0 - jnp.asarray(b2, jnp.float32) ** t)


def check_adam_hyper(b1, b2, eps, mu_dtype=None, nu_dtype=None) -> tuple:
  """Validates the shared hyperparameters; returns ``(mu_dtype, nu_dtype)`` as ``None``,
  a ``jnp.dtype`` or an :class:`adamkit.Quantized`."""
  _validate.check_beta("b1", b1)
  _validate.check_beta("b2", b2)
  _validate.check_eps("eps", eps)
  return _quant.as_format("mu_dtype", mu_dtype), _quant.as_format("nu_dtype", nu_dtype)


def abs_sq(g):
  """:math:`|g|^2`, real for a complex ``g`` (as optax), in ``g``'s dtype."""
  return (g * jnp.conj(g)).real.astype(g.dtype) if jnp.iscomplexobj(g) else g * g


def _joined(g, *xs):
  """The float32 scalars ``xs`` in a complex leaf's dtype (strict promotion), else as they are."""
  return tuple(jnp.asarray(x, g.dtype) for x in xs) if jnp.iscomplexobj(g) else xs


def adam_moments(g, m, v, *, b1, b2):
  """The moment rows of the Adam step: returns ``(m_t, v_t)`` (for a complex leaf ``v``
  holds the real :math:`|g|^2` averages in the complex dtype, as optax)."""
  b1, b2 = _joined(g, b1, b2)
  m = b1 * m + (1.0 - b1) * g
  v = b2 * v + (1.0 - b2) * abs_sq(g)
  return m, v


def adam_ratio(g, m, v, *, b1, eps, bc1, bc2, eps_mode, nesterov):
  """The direction from the new moments: ``v`` is :math:`v_t`, or AMSGrad's running max.

  ``bc1 = bc2 = 1`` turns bias correction off (the two eps modes then coincide).
  """
  b1, eps, bc1, bc2 = _joined(g, b1, eps, bc1, bc2)
  m_num = b1 * m + (1.0 - b1) * g if nesterov else m
  if eps_mode == "hat":
    return (jnp.sqrt(bc2) / bc1) * m_num / (jnp.sqrt(v) + eps)
  m_hat = m_num / bc1
  v_hat = v / bc2
  return m_hat / (jnp.sqrt(v_hat) + eps)


def adam_direction(g, m, v, *, b1, b2, eps, bc1, bc2, eps_mode, nesterov):
  """One leaf of the Adam step, in the docstring's order. Returns ``(u, m, v)`` in f32."""
  m, v = adam_moments(g, m, v, b1=b1, b2=b2)
  u = adam_ratio(g, m, v, b1=b1, eps=eps, bc1=bc1, bc2=bc2, eps_mode=eps_mode,
                 nesterov=nesterov)
  return u, m, v


def amsgrad_direction(g, m, v, v_max, *, b1, b2, eps, bc1, bc2, eps_mode, nesterov):
  """One leaf of the AMSGrad step. Returns ``(u, m, v, v_max)`` in f32."""
  m, v = adam_moments(g, m, v, b1=b1, b2=b2)
  v_max = jnp.maximum(v_max, v)
  u = adam_ratio(g, m, v_max, b1=b1, eps=eps, bc1=bc1, bc2=bc2, eps_mode=eps_mode,
                 nesterov=nesterov)
  return u, m, v, v_max


@_validate.foreign_keywords
def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                  eps_mode: str = "hat", nesterov: bool = False, bias_correction: bool = True,
                  amsgrad: bool = False, mu_dtype: Any = None,
                  nu_dtype: Any = None) -> optax.GradientTransformation:
  r"""Rescales updates by Adam's moment estimates (no learning rate, no decay).

  .. math::

    m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t \\
    v_t &= \beta_2 v_{t-1} + (1-\beta_2) g_t^2 \\
    \bar v_t &= \max(\bar v_{t-1}, v_t) \text{ if amsgrad else } v_t \\
    n_t &= \beta_1 m_t + (1-\beta_1) g_t \text{ if nesterov else } m_t \\
    u_t &= \frac{\sqrt{c_2}}{c_1}\,\frac{n_t}{\sqrt{\bar v_t}+\epsilon}
          \quad\text{(eps\_mode="hat")} \\
    u_t &= \frac{n_t/c_1}{\sqrt{\bar v_t/c_2}+\epsilon}
          \quad\text{(eps\_mode="corrected")}

  with :math:`c_1 = 1-\beta_1^t`, :math:`c_2 = 1-\beta_2^t`, or
  :math:`c_1 = c_2 = 1` when ``bias_correction=False`` (MindSpore ``AdamWeightDecay``; the
  two eps modes are then the same formula, bit for bit).

  ``"hat"`` is the formula of MindSpore ``nn.Adam``/``nn.AdamOffload``, TensorFlow and
  ``torch.optim.SparseAdam`` (the :math:`\hat\epsilon` of the Adam paper, section 2);
  ``"corrected"`` is optax's ``scale_by_adam``, ``torch.optim.Adam`` and what Paddle's
  dense kernel really computes (its documentation prints the other formula).

  .. warning::
    With ``nesterov=True`` this is MindSpore/TensorFlow ``use_nesterov``: the numerator
    :math:`\beta_1 m_t + (1-\beta_1) g_t` is divided by :math:`1-\beta_1^t`. optax's
    ``nadam`` corrects the two terms with different powers and gives another answer.

  .. warning::
    ``eps_mode="corrected"`` is optax's formula, but not quite its arithmetic: adamkit
    forms :math:`1-\beta` and :math:`\beta^t` from the same float32 :math:`\beta`, as the
    float32 kernels of MindSpore and Paddle do (so the first step is exactly
    :math:`\alpha\, g/(|g|+\epsilon)`); optax takes :math:`1-\beta` in double precision.
    When :math:`\beta` is not a float32 number the two differ by up to
    :math:`|\mathrm{fl}(\beta)-\beta|/(1-\beta)` relative (about 6e-6 for
    :math:`\beta_2 = 0.999`); for representable betas they agree to float32 rounding.

  .. warning::
    ``amsgrad=True`` keeps the maximum of the *raw* second moment :math:`v_t`, as PyTorch
    (``torch.optim.Adam(amsgrad=True)``), Paddle (``moment2_max``) and MindSpore
    (``ApplyAdamWithAmsgradV2``, ``vhat``) do. ``optax.amsgrad`` keeps the maximum of the
    bias-corrected :math:`v_t/(1-\beta_2^t)` instead: since :math:`1-\beta_2^t` grows with
    :math:`t`, an early large :math:`v` weighs more there: once the raw maximum holds
    from step :math:`s`, optax's denominator is at least
    :math:`\sqrt{(1-\beta_2^t)/(1-\beta_2^s)}` times adamkit's (about 2.6 for
    :math:`\beta_2 = 0.999`, :math:`s = 100`, :math:`t = 1000`), so its steps are smaller.

  Args:
    b1: decay :math:`\beta_1` of the first moment, in [0, 1) (default 0.9; MindSpore and
      Paddle ``beta1``). 0 keeps no memory: :math:`m_t = g_t`.
    b2: decay :math:`\beta_2` of the second moment, in [0, 1) (default 0.999; ``beta2``).
    eps: :math:`\epsilon`, added to the denominator (default 1e-8; MindSpore ``eps``,
      Paddle ``epsilon``); finite and at least float32's smallest normal number
      (1.18e-38), below which the float32 step would flush it to zero.
    eps_mode: where :math:`\epsilon` enters (default ``"hat"``): ``"hat"`` adds it to
      :math:`\sqrt{\bar v_t}` before the bias correction (MindSpore ``nn.Adam``,
      TensorFlow), ``"corrected"`` to :math:`\sqrt{\bar v_t/c_2}` (optax, PyTorch, Paddle);
      the formulas above.
    nesterov: use the Nesterov numerator :math:`n_t` (default ``False``; MindSpore
      ``use_nesterov``, which differs from ``optax.nadam``: see the warning above).
    bias_correction: divide by :math:`c_1 = 1-\beta_1^t` and :math:`c_2 = 1-\beta_2^t`
      (default ``True``); ``False`` is MindSpore ``nn.AdamWeightDecay``, which has none.
    amsgrad: use the running maximum :math:`\bar v_t` of the raw :math:`v_t` in the
      denominator (default ``False``; Reddi et al.); the state is then
      :class:`ScaleByAmsgradState`.
    mu_dtype: storage of the first moment (default: the params' dtype): a float dtype
      (e.g. ``jnp.bfloat16`` to halve its memory) or a quantized format,
      :class:`adamkit.Quantized` or its kind alone (``"8bit"``: bitsandbytes'/torchao's
      block-wise format, 1 byte per parameter plus a scale per block; ``"4bit"``: half a
      byte; ``"fp8"``). The arithmetic is always float32 or wider.
    nu_dtype: storage of the second moment and of the AMSGrad maximum (default: the
      params' dtype), a float dtype or a quantized format, as ``mu_dtype``
      (``jnp.bfloat16`` keeps float32's 8-bit exponent, so :math:`g^2` neither under- nor
      overflows as it would in float16).

  With a quantized format each leaf of at least ``min_size`` elements (default 4096; smaller
  leaves keep float32 moments) stores its moment as a :class:`adamkit.QuantizedArray`
  (codes and one float32 scale per block): the step reads the old moments dequantized,
  takes this step's float32 moments for the direction, and stores them re-quantized, as
  bitsandbytes and torchao do. Under ``jit`` the step keeps no full-size float32 copy of
  either moment (the new codes are computed in chunks). A leaf whose size is not a
  multiple of the block is padded to whole blocks (cheaper than keeping float32); complex
  params refuse a quantized format.

  Complex parameters are trained as optax does: :math:`g^2` is :math:`|g|^2`.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`ScaleByAdamState`, or
    :class:`ScaleByAmsgradState` with ``amsgrad=True``.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> tx = ak.scale_by_adam()
    >>> params = {"w": jnp.ones(3)}
    >>> u, state = tx.update({"w": jnp.full(3, 0.5)}, tx.init(params))
    >>> u["w"].round(4)  # first step: sqrt(1-b2) g / (sqrt(1-b2) |g| + eps), about sign(g)
    Array([1., 1., 1.], dtype=float32)
    >>> tx = ak.scale_by_adam(amsgrad=True)  # the state keeps max(nu) as well
    >>> u, state = tx.update({"w": jnp.full(3, 0.5)}, tx.init(params))
    >>> type(state).__name__, state.nu_max["w"]
    ('ScaleByAmsgradState', Array([0.00025, 0.00025, 0.00025], dtype=float32))
    >>> tx = ak.scale_by_adam(mu_dtype="8bit", nu_dtype="8bit")  # block-wise 8-bit moments
    >>> mu = tx.init({"w": jnp.zeros((64, 256))}).mu["w"]
    >>> type(mu).__name__, mu.codes.dtype, mu.nbytes  # a byte a value, a float32 per block
    ('QuantizedArray', dtype('uint8'), 16640)

  References:
    Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015.
    Reddi, Kale & Kumar, "On the Convergence of Adam and Beyond", ICLR 2018 (AMSGrad).
    Reproduces MindSpore 2.10 ``nn.Adam`` (``use_amsgrad``) and ``nn.AdamWeightDecay``'s
    direction, PaddlePaddle 3.3.1 ``optimizer.Adam`` / ``AdamW`` (``amsgrad``).
  """
  mu_dtype, nu_dtype = check_adam_hyper(b1, b2, eps, mu_dtype, nu_dtype)
  _validate.check_choice("eps_mode", eps_mode, ("hat", "corrected"))
  _validate.check_bool("nesterov", nesterov)
  _validate.check_bool("bias_correction", bias_correction)
  _validate.check_bool("amsgrad", amsgrad)
  formats = ((mu_dtype, "mu", "first moment"), (nu_dtype, "nu", "second moment"),
             (nu_dtype, "nu", "running maximum of the second moment"))[:3 if amsgrad else 2]

  def init_fn(params):
    _validate.check_float_params(params, complex_ok=True)
    moments = [_quant_ops.zero_moments(params, fmt, role) for fmt, role, _ in formats]
    count = jnp.zeros([], jnp.int32)
    if amsgrad:
      return ScaleByAmsgradState(count, *moments)
    return ScaleByAdamState(count, *moments)

  def update_fn(updates, state, params=None):
    _validate.check_dense_grads(updates, "ak.scale_by_adam")
    _validate.check_state(state, ScaleByAmsgradState if amsgrad else ScaleByAdamState,
                          "ak.scale_by_adam", updates)
    olds = (state.mu, state.nu, state.nu_max) if amsgrad else (state.mu, state.nu)
    for tree, (fmt, role, what) in zip(olds, formats):
      _quant_ops.check_moments(updates, tree, fmt, role, what)
    updates = _validate.float_grads(updates, params)
    count = optax.safe_increment(state.count)
    if bias_correction:
      bc1, bc2 = bias_corrections(b1, b2, count)
    else:
      bc1 = bc2 = jnp.ones([], jnp.float32)
    hyper = dict(b1=jnp.asarray(b1, jnp.float32), b2=jnp.asarray(b2, jnp.float32),
                 eps=jnp.asarray(eps, jnp.float32), bc1=bc1, bc2=bc2, eps_mode=eps_mode,
                 nesterov=nesterov)
    step = functools.partial(amsgrad_direction if amsgrad else adam_direction, **hyper)

    rule = _quant_ops.MomentRule("adam", hyper["b1"], hyper["b2"])

    def leaf(g, *olds):  # olds: (m, v) or (m, v, v_max), each kept as stored
      return _quant_ops.leaf_step(step, g, olds, count, rule)

    u, *moments = tree_map_multi(leaf, 1 + len(olds), updates, *olds)
    if amsgrad:
      return u, ScaleByAmsgradState(count, *moments)
    return u, ScaleByAdamState(count, *moments)

  return optax.GradientTransformation(*through_variables(init_fn, update_fn))


@_validate.foreign_keywords
def adam(learning_rate: _schedules.ScalarOrSchedule = 1e-3, b1: float = 0.9,
         b2: float = 0.999, eps: float = 1e-8, *, eps_mode: str = "hat",
         nesterov: bool = False, amsgrad: bool = False, weight_decay: Any = 0.0,
         weight_decay_mask: _masks.MaskSpec = _masks.MINDSPORE_DEFAULT,
         loss_scale: float = 1.0, grad_clip: _links.GradClip = None,
         grad_centralization: bool = False, groups=None, mu_dtype: Any = None,
         nu_dtype: Any = None, nonfinite: str = "propagate") -> optax.GradientTransformation:
  r"""Adam with MindSpore's and Paddle's options, as a chain of primitives.

  .. math::

    g &\leftarrow g / s \quad \text{(loss scale)} \\
    g &\leftarrow \mathrm{clip}(g) \quad \text{(Paddle grad\_clip)} \\
    g &\leftarrow g + \lambda_t w \quad \text{(L2 decay, masked)} \\
    g &\leftarrow g - \mathrm{mean}_{1..}(g) \quad \text{(grad centralization, ndim>1)} \\
    w &\leftarrow w - \alpha_t\, u_t \quad \text{(} u_t \text{ from } \mathtt{scale\_by\_adam}\text{)}

  The chain is ``check -> unscale -> clip -> [decay -> centralize -> scale_by_adam ->
  -lr]``, the bracket with each parameter group's settings. The groups share one state
  (one step counter, one moment tree over every parameter), as in MindSpore and Paddle.

  Args:
    learning_rate: :math:`\alpha_t` (default 1e-3): a number >= 0, a 0-d array, a 1-D
      array or iterable (step ``i`` uses element ``i``, later steps the last), or a
      schedule ``count -> lr``.
    b1: decay :math:`\beta_1` of the first moment, in [0, 1) (default 0.9; MindSpore and
      Paddle ``beta1``).
    b2: decay :math:`\beta_2` of the second moment, in [0, 1) (default 0.999; ``beta2``).
    eps: :math:`\epsilon`, added to the denominator (default 1e-8; MindSpore ``eps``,
      Paddle ``epsilon``), finite and at least 1.18e-38 (float32's smallest normal).
    eps_mode: where :math:`\epsilon` enters (default ``"hat"``, MindSpore ``nn.Adam``:
      added to :math:`\sqrt{v_t}` before the bias correction); ``"corrected"`` adds it
      to :math:`\sqrt{\hat v_t}`, the formula of ``optax.adam``, ``torch.optim.Adam`` and
      Paddle ``Adam``. The two formulas: :func:`scale_by_adam`.
    nesterov: MindSpore ``use_nesterov`` (default ``False``): the numerator
      :math:`\beta_1 m_t + (1-\beta_1) g_t`; not ``optax.nadam``'s (see
      :func:`scale_by_adam`).
    amsgrad: divide by the running maximum of the raw :math:`v_t` (default ``False``);
      the state then holds ``nu_max`` (:class:`ScaleByAmsgradState`). MindSpore
      ``nn.Adam(use_amsgrad=True)`` with ``eps_mode="hat"``, Paddle
      ``Adam(amsgrad=True)`` and ``torch.optim.Adam(amsgrad=True)`` with
      ``eps_mode="corrected"``; ``optax.amsgrad`` keeps another maximum.
    weight_decay: L2 coefficient :math:`\lambda_t` (default 0.0: no decay), a number >= 0
      or a schedule, or ``ak.L1Decay(c)`` / ``ak.L2Decay(c)`` (Paddle's regularizers).
      Coupled: added to the gradient before the moments, not decoupled as in
      :func:`adamw`.
    weight_decay_mask: which leaves decay. Default: every leaf whose path does not
      contain ``"beta"`` or ``"gamma"`` (MindSpore). ``None``: every leaf (Paddle).
      Also a bool pytree, a callable ``params -> bool tree`` (optax's convention) or an
      ``ak.masks`` rule; a predicate on the leaf's dotted name (Paddle's
      ``apply_decay_param_fun``) is ``ak.masks.name_rule(fn)``; ``ak.masks.flax_rule()``
      skips Flax's norm ``scale`` and every ``bias``.
    loss_scale: gradients are divided by it first, > 0 (default 1.0; MindSpore
      ``loss_scale``).
    grad_clip: ``ak.ClipGradByGlobalNorm``/``ClipGradByNorm``/``ClipGradByValue`` or any
      optax transform (default ``None``: no clipping); applied after unscaling and before
      decay (Paddle's order).
    grad_centralization: subtract from each leaf with ndim > 1 its mean over every axis
      but the first (default ``False``; MindSpore ``grad_centralization``, also settable
      per group).
    groups: parameter groups (default ``None``: one group, the arguments above), a list
      of :class:`adamkit.Group` or MindSpore/Paddle-style dicts; a group's settings
      replace the arguments for its leaves.
    mu_dtype: storage of the first moment (default: the params' dtype): a float dtype,
      e.g. ``jnp.bfloat16`` to halve its memory, or a quantized format
      (:class:`adamkit.Quantized`, ``"8bit"``, ``"4bit"``, ``"fp8"``; see
      :func:`adamkit.scale_by_adam`). The arithmetic is always float32 or wider.
    nu_dtype: storage of the second moment and of the AMSGrad maximum (default: the
      params' dtype), as ``mu_dtype``; ``jnp.bfloat16`` keeps float32's exponent range,
      float16 may underflow.
    nonfinite: ``"propagate"`` (default; a NaN/Inf gradient reaches the params, as in
      optax and PyTorch) or ``"skip"`` (the whole step is skipped and the state kept,
      via ``optax.apply_if_finite``, as MindSpore's loss-scale overflow handling).

  Complex parameters are trained as optax trains them (:math:`g^2` is :math:`|g|^2`, the
  L2 term :math:`\lambda w` keeps its imaginary part). Integer gradients are cast to their
  parameter's dtype first, as optax's arithmetic promotes them (never an integer update).

  Returns:
    An ``optax.GradientTransformation``.

  .. warning::
    Defaults follow MindSpore: ``eps_mode="hat"`` and decay masked by name. For
    ``optax.adam``/``torch.optim.Adam``/Paddle numerics use ``eps_mode="corrected"``;
    for Paddle's decay of every leaf use ``weight_decay_mask=None``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, adamkit as ak
    >>> params = {"w": jnp.array([1.0, -2.0])}
    >>> tx = ak.adam(0.1, eps_mode="corrected")
    >>> state = tx.init(params)
    >>> grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> optax.apply_updates(params, updates)["w"]
    Array([ 0.9, -1.9], dtype=float32)
  """
  check_adam_hyper(b1, b2, eps, mu_dtype, nu_dtype)
  _validate.check_choice("eps_mode", eps_mode, ("hat", "corrected"))
  _validate.check_bool("nesterov", nesterov)
  _validate.check_bool("amsgrad", amsgrad)
  _validate.check_bool("grad_centralization", grad_centralization)

  def direction(b1, b2, eps):
    return scale_by_adam(b1, b2, eps, eps_mode=eps_mode, nesterov=nesterov, amsgrad=amsgrad,
                         mu_dtype=mu_dtype, nu_dtype=nu_dtype)

  return _groups.build_named(
      direction, learning_rate=learning_rate, hyper=dict(b1=b1, b2=b2, eps=eps),
      weight_decay=weight_decay, weight_decay_mask=weight_decay_mask, loss_scale=loss_scale,
      grad_clip=grad_clip, groups=groups, grad_centralization=grad_centralization,
      nonfinite=nonfinite, dense_only="ak.adam", complex_ok=True)
