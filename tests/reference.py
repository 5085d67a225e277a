"""Independent float64 NumPy implementations of the formulas, step by step.

Written from the seed documents and ../shared/golden/README.md, sharing no code with
adamkit. Each function takes dicts of NumPy arrays keyed by parameter name.
"""

from __future__ import annotations

import numpy as np


def _f64(tree):
  return {k: np.asarray(v, np.float64) for k, v in tree.items()}


class NumpyAdam:
  """MindSpore nn.Adam / Paddle Adam, with every option of ak.adam, in float64.

  ``decoupled="mindspore"`` is nn.AdamWeightDecay's order (``u += wd * w``, then
  ``w -= lr * u``), ``decoupled="paddle"`` Paddle AdamW's and torch AdamW's (``w *= 1 - lr *
  wd`` on the old ``w`` first, then the Adam step); ``None`` is L2 decay in the gradient.
  ``amsgrad``: the raw second moment's running maximum replaces ``v`` in the denominator.
  """

  def __init__(self, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, *, eps_mode="hat",
               nesterov=False, weight_decay=0.0, decay=lambda name: True, loss_scale=1.0,
               l1=False, clip=None, gc=lambda name: False, algo="adam", lr_of=None,
               amsgrad=False, bias_correction=True, decoupled=None):
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.eps_mode, self.nesterov, self.algo = eps_mode, nesterov, algo
    self.wd, self.decay, self.loss_scale, self.l1 = weight_decay, decay, loss_scale, l1
    self.clip, self.gc = clip, gc
    self.lr_of = lr_of  # optional: name -> lr multiplier function of the step
    self.amsgrad, self.bias_correction, self.decoupled = amsgrad, bias_correction, decoupled
    self.t = 0
    self.m, self.v, self.vmax = {}, {}, {}

  def lr_at(self, t):
    lr = self.lr
    if callable(lr):
      return float(lr(t))
    if np.ndim(lr) == 1 or isinstance(lr, (list, tuple)):
      arr = np.asarray(lr, np.float64)
      return float(arr[min(t, len(arr) - 1)])
    return float(lr)

  def step(self, params, grads):
    params, grads = _f64(params), _f64(grads)
    grads = {k: g / self.loss_scale for k, g in grads.items()}
    if self.clip is not None:
      kind, c = self.clip
      if kind == "global":
        norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
        grads = {k: g * c / max(norm, c) for k, g in grads.items()}
      elif kind == "norm":
        grads = {k: g * c / max(np.sqrt(np.sum(g * g)), c) for k, g in grads.items()}
      else:
        grads = {k: np.clip(g, -c, c) for k, g in grads.items()}
    wd = self.wd(self.t) if callable(self.wd) else self.wd
    out = {}
    t = self.t + 1
    lr = self.lr_at(self.t)
    for k, w in params.items():
      g = grads[k]
      lr_k = lr * (self.lr_of(k) if self.lr_of is not None else 1.0)
      if self.decoupled == "paddle" and self.decay(k):
        w = w * (1.0 - lr_k * wd)
      if self.decay(k) and self.decoupled is None:
        g = g + wd * (np.sign(w) if self.l1 else w)
      if self.gc(k) and g.ndim > 1:
        g = g - g.mean(axis=tuple(range(1, g.ndim)), keepdims=True)
      m = self.m.get(k, np.zeros_like(w))
      v = self.v.get(k, np.zeros_like(w))
      m = self.b1 * m + (1 - self.b1) * g
      c1, c2 = (1 - self.b1 ** t, 1 - self.b2 ** t) if self.bias_correction else (1.0, 1.0)
      if self.algo == "adamax":
        v = np.maximum(self.b2 * v, np.abs(g))
        u = m / c1 / (v + self.eps)
      else:
        v = self.b2 * v + (1 - self.b2) * g * g
        den = v
        if self.amsgrad:
          den = self.vmax[k] = np.maximum(self.vmax.get(k, np.zeros_like(w)), v)
        num = self.b1 * m + (1 - self.b1) * g if self.nesterov else m
        if self.eps_mode == "hat":
          u = np.sqrt(c2) / c1 * num / (np.sqrt(den) + self.eps)
        else:
          u = (num / c1) / (np.sqrt(den / c2) + self.eps)
      if self.decoupled == "mindspore" and self.decay(k):
        u = u + wd * w
      self.m[k], self.v[k] = m, v
      out[k] = w - lr_k * u
    self.t = t
    return out


# ------------------------------------------------- the 4-bit first moment's dither
#
# From its definition (docs/low_memory.md, ak.Quantized's docstring): the random number of
# element i (its flat position in the leaf; row * D + column in a table) at step count t is
# u_i = floor(h((i * 0x9E3779B9) ^ h(t ^ 0x5BD1E995)) / 2^8) * 2^-24, h = Wellons'
# "lowbias32", arithmetic modulo 2^32; the first moment's level k = floor(7 r) rounds up
# to k + 1 when u_i < 7 r - floor(7 r), r = m / scale.

_M32 = 0xFFFFFFFF


def lowbias32(h):
  """Wellons' lowbias32 integer hash of uint64 arrays holding 32-bit values."""
  h = np.asarray(h, np.uint64) & _M32
  h ^= h >> 16
  h = (h * 0x7FEB352D) & _M32
  h ^= h >> 15
  h = (h * 0x846CA68B) & _M32
  return h ^ (h >> 16)


def dither_4bit(pos, step):
  """The 4-bit first moment's random number in [0, 1) of positions ``pos`` at step ``step``."""
  key = lowbias32(np.uint64(int(step) & _M32) ^ np.uint64(0x5BD1E995))
  i = np.asarray(pos, np.uint64) & _M32
  h = lowbias32(((i * 0x9E3779B9) & _M32) ^ key)
  return (h >> 8).astype(np.float64) * 2.0 ** -24


def round_4bit_mu(r, pos, step):
  """The level k in -7 .. 7 (code k + 7) of ``r = m / scale`` at positions ``pos``; ``7 r``
  is computed in ``r``'s dtype (a float32 ``r`` rounds it as the format does)."""
  r = np.asarray(r)
  y = r * r.dtype.type(7)
  lo = np.floor(y)
  return np.clip(lo + (dither_4bit(pos, step) < (y - lo).astype(np.float64)), -7, 7)
