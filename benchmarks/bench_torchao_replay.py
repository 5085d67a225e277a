"""How close ``ak.adamw(..., mu_dtype="8bit", nu_dtype="8bit")`` stays to torchao's
``AdamW8bit``, run by run (the figures of docs/low_memory.md, "How close to torchao").

Records torchao 0.18 ``AdamW8bit`` on CPU (the ``bench`` extra) on random params and
gradients, then replays the same gradients with

* ``ak.adamw`` with 8-bit moments (``eps_mode="corrected"``, decay on every leaf), and
* a NumPy replica of torchao's own float32 arithmetic: ``m.lerp(g, 1 - b1)`` without FMA,
  codes of ``x / s`` by torchao's residual rounding test, its update order;

and prints, per run, the largest ``|p - p_torchao| / lr`` over the steps (and at which step
it first passes 0.1). A last row counts, for bf16 params, the weights that
``ak.param_rounding(ak.adamw(...), "nearest")`` leaves one bf16 rounding away from
torchao's after the first step.

  python benchmarks/bench_torchao_replay.py      # about a minute
"""

from __future__ import annotations

import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import adamkit as ak  # noqa: E402

F = np.float32
# name: (shape of w, steps, seed, AdamW8bit keyword arguments)
RUNS = {
    "20 steps, lr 1e-3, betas (0.9, 0.95), wd 0.1": ((64, 256), 20, 10,
                                                     dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)),
    "20 steps, lr 1e-3": ((64, 256), 20, 11, dict(lr=1e-3, weight_decay=0.01)),
    "20 steps, lr 1e-2, betas (0.9, 0.95), wd 0": ((64, 256), 20, 12,
                                                   dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)),
    "20 steps, lr 3e-4, betas (0.9, 0.98), wd 0.05": ((64, 256), 20, 13,
                                                      dict(lr=3e-4, betas=(0.9, 0.98), weight_decay=0.05)),
    "20 steps, lr 1e-2, betas (0.8, 0.99)": ((64, 256), 20, 14,
                                             dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01)),
    "20 steps, lr 5e-3, eps 1e-6": ((64, 256), 20, 15, dict(lr=5e-3, weight_decay=0.01, eps=1e-6)),
    "100 steps, lr 1e-2": ((64, 256), 100, 3, dict(lr=1e-2, weight_decay=0.01)),
    "60 steps, lr 1e-3, betas (0.9, 0.95), wd 0.1": ((128, 256), 60, 4,
                                                     dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)),
}


def inputs(shape, steps, seed):
  rs = np.random.RandomState(seed)
  init = rs.standard_normal(shape).astype(F)
  scale = rs.uniform(0.01, 1.0, (steps,) + (1,) * len(shape))
  return init, (rs.standard_normal((steps,) + shape) * scale).astype(F)


def torchao_run(init, grads, kw, dtype="float32"):
  import torch  # noqa: PLC0415 - the bench extra
  from torchao.optim import AdamW8bit  # noqa: PLC0415

  p = torch.nn.Parameter(torch.tensor(init).to(getattr(torch, dtype)))
  opt = AdamW8bit([p], **kw)
  out = []
  for g in grads:
    p.grad = torch.tensor(g).to(p.dtype)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      opt.step()
    out.append(p.detach().float().numpy().copy())
  return out


def adamkit_run(init, grads, kw, dtype=jnp.float32, rounding=None):
  b1, b2 = kw.get("betas", (0.9, 0.999))
  tx = ak.adamw(kw["lr"], b1, b2, kw.get("eps", 1e-8), weight_decay=kw["weight_decay"],
                eps_mode="corrected", weight_decay_mask=None, mu_dtype="8bit", nu_dtype="8bit")
  if rounding:
    tx = ak.param_rounding(tx, rounding)
  p = jnp.asarray(init).astype(dtype)
  state, update, out = tx.init(p), jax.jit(tx.update), []
  for g in grads:
    u, state = update(jnp.asarray(g).astype(dtype), state, p)
    p = optax.apply_updates(p, u)
    out.append(np.asarray(p, F))
  return out


def _qmap(signed):
  from torchao.optim.quant_utils import create_dynamic_map  # noqa: PLC0415

  return np.asarray(create_dynamic_map(signed=signed), F)


def _quantize(x, qmap, block):
  """torchao's ``x / absmax`` and its binary search plus residual rounding test."""
  xb = x.reshape(-1, block)
  scale = np.maximum(np.abs(xb).max(-1), F(1e-12)).astype(F)
  r = (xb / scale[:, None]).astype(F).reshape(-1)
  codes = np.clip(np.searchsorted(qmap, r, side="right") - 1, 0, 255)
  up = np.minimum(codes + 1, 255)
  lo, hi = qmap[codes], qmap[up]
  return np.where((r - lo).astype(F) >= ((hi - lo) * F(0.5)).astype(F), up, codes), scale


def _lerp(a, b, w):  # torch.lerp in float32, no FMA
  d = (b - a).astype(F)
  return (a + F(w) * d).astype(F) if w < 0.5 else (b - d * F(1 - w)).astype(F)


def replica_run(init, grads, kw, block=256):
  """torchao's AdamW8bit step on a leaf, in NumPy float32."""
  qs, qu = _qmap(True), _qmap(False)
  lr, wd, eps = F(kw["lr"]), F(kw["weight_decay"]), F(kw.get("eps", 1e-8))
  b1, b2 = kw.get("betas", (0.9, 0.999))
  p = init.reshape(-1).astype(F)
  mc, ms = _quantize(np.zeros_like(p), qs, block)
  vc, vs = _quantize(np.zeros_like(p), qu, block)
  out = []
  for t, g in enumerate(grads, start=1):
    g = g.reshape(-1)
    p = (p - (lr * wd) * p).astype(F)
    m = _lerp((qs[mc].reshape(-1, block) * ms[:, None]).reshape(-1).astype(F), g, 1 - b1)
    v = _lerp((qu[vc].reshape(-1, block) * vs[:, None]).reshape(-1).astype(F), (g * g).astype(F),
              1 - b2)
    mc, ms = _quantize(m, qs, block)
    vc, vs = _quantize(v, qu, block)
    bc1, bc2 = F(1) - F(b1) ** F(t), F(1) - F(b2) ** F(t)
    denom = (np.sqrt(v) / np.sqrt(bc2) + eps).astype(F)
    p = (p - lr * (m / bc1) / denom).astype(F)
    out.append(p.reshape(init.shape).copy())
  return out


def drift(ours, theirs, lr):
  per_step = [float(np.max(np.abs(a - b))) / lr for a, b in zip(ours, theirs)]
  over = next((t for t, d in enumerate(per_step) if d > 0.1), None)
  return max(per_step), "-" if over is None else over


def main():
  rows = []
  for name, (shape, steps, seed, kw) in RUNS.items():
    init, grads = inputs(shape, steps, seed)
    ref = torchao_run(init, grads, kw)
    ak_max, ak_over = drift(adamkit_run(init, grads, kw), ref, kw["lr"])
    np_max, _ = drift(replica_run(init, grads, kw), ref, kw["lr"])
    rows.append([name, f"{ak_max:.3f}", ak_over, f"{np_max:.3f}"])
  print(common.table("AdamW8bit on a (64|128) x 256 leaf: max |p - p_torchao| / lr over the steps",
                     ["run", "ak.adamw 8-bit", "first step over 0.1", "NumPy replica of torchao"],
                     rows))
  kw = dict(lr=1e-2, weight_decay=0.01)
  init, grads = inputs((64, 256), 1, 20)
  ref = torchao_run(init, grads, kw, "bfloat16")[0]
  ours = adamkit_run(init, grads, kw, jnp.bfloat16, rounding="nearest")[0]
  w0 = np.asarray(jnp.asarray(init).astype(jnp.bfloat16), F)
  off = ours != ref
  big = np.abs(ref - w0) > np.abs(w0) / 2  # the step moved the weight by over half itself
  print(f"\nbf16 params, one step (lr 1e-2): {off.mean():.2%} of the weights differ from "
        f"torchao's; of those, {(off & big).sum() / max(off.sum(), 1):.0%} moved by more than "
        "half their magnitude")


if __name__ == "__main__":
  main()
