"""Records ``ao_8bit_runs.npz``: torchao's 8-bit Adam and AdamW on CPU in settings the
public run (``ao_adamw8bit_public.npz``) does not cover: other block sizes, L2 (coupled)
decay, other betas and eps, a leaf whose size is not a multiple of the block, and a
learning rate changed at every step.

Run once, with the ``bench`` extra (torch, torchao) installed, from the repository root:

    python tests/golden/make_ao_8bit_runs.py

Initial params and gradients come from ``numpy.random.RandomState`` (whose stream NumPy
keeps fixed across versions), so the tests regenerate them with :func:`inputs` and the file
holds torchao's params only, at the steps in ``STEPS``. Keys: ``<run>/config`` (JSON:
optimizer class, keyword arguments, the learning rate of each step), ``<run>/params/<t>/<name>``
(after step ``t``, 0-based), ``<run>/quantized/<name>`` (whether torchao kept that leaf's
moments in 8 bits).
"""

import json
import pathlib
import warnings

import numpy as np

SHAPES = {"w": (32, 160), "t": (4500,), "b": (100,)}  # 5120 = 20 x 256; 4500 = 17 x 256 + 148
STEPS = (0, 1, 2, 4, 9)  # the steps whose params are kept (10 steps in all)
NUM_STEPS = 10
RUNS = {
    "adamw_block128": ("AdamW8bit", {"lr": 0.01, "weight_decay": 0.01, "block_size": 128}),
    "adamw_block512": ("AdamW8bit", {"lr": 0.002, "betas": (0.95, 0.98), "weight_decay": 0.1,
                                     "block_size": 512}),
    "adam_l2": ("Adam8bit", {"lr": 0.005, "betas": (0.8, 0.99), "eps": 1e-6,
                             "weight_decay": 0.01}),
    "adamw_warmup": ("AdamW8bit", {"lr": 0.01, "weight_decay": 0.01}),
}
WARMUP = [0.01 * (t + 1) / NUM_STEPS for t in range(NUM_STEPS)]  # adamw_warmup's lr at step t


def inputs(seed: int = 0) -> tuple[dict, dict]:
  """The initial params and the gradients of every step (float32), as recorded."""
  rs = np.random.RandomState(seed)
  init = {k: rs.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  grads = {}
  for k, s in SHAPES.items():
    scale = rs.uniform(0.01, 1.0, (NUM_STEPS,) + (1,) * len(s))
    grads[k] = (rs.standard_normal((NUM_STEPS,) + s) * scale).astype(np.float32)
  return init, grads


def main() -> None:
  import torch  # noqa: PLC0415 - only the recording needs them
  import torchao
  from torchao.optim import Adam8bit, AdamW8bit  # noqa: PLC0415

  classes = {"AdamW8bit": AdamW8bit, "Adam8bit": Adam8bit}
  init, grads = inputs()
  out = {}
  for run, (cls, kw) in RUNS.items():
    ps = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in init.items()}
    opt = classes[cls](list(ps.values()), **kw)
    lrs = WARMUP if run == "adamw_warmup" else [kw["lr"]] * NUM_STEPS
    for t in range(NUM_STEPS):
      for group in opt.param_groups:  # torchao keeps lr as a tensor, changed in place
        if torch.is_tensor(group["lr"]):
          group["lr"].fill_(lrs[t])
        else:
          group["lr"] = lrs[t]
      for k, p in ps.items():
        p.grad = torch.tensor(grads[k][t])
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
      if t in STEPS:
        for k, p in ps.items():
          out[f"{run}/params/{t}/{k}"] = p.detach().numpy().copy()
    for k, p in ps.items():
      out[f"{run}/quantized/{k}"] = np.array(
          type(opt.state[p]["exp_avg"]).__name__ == "OptimState8bit")
    out[f"{run}/config"] = np.array(json.dumps(
        {"optimizer": cls, "kwargs": kw, "lr": lrs, "torchao": torchao.__version__,
         "torch": torch.__version__}))
  path = pathlib.Path(__file__).with_name("ao_8bit_runs.npz")
  np.savez(path, **out)
  print(f"written: {path}")


if __name__ == "__main__":
  main()
