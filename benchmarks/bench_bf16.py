"""bf16 params without a float32 master copy: how well does training go? (issue 20)

A 64-512-512-10 ReLU MLP on scikit-learn's digits (1,797 8x8 images; 75% train, 25% test),
300 full-batch steps of ``ak.adamw`` with a cosine-decayed learning rate, the same
initialisation and data for every run. The forward and backward passes compute in
float32 in every run; only how the params are *stored* and *updated* differs:

* ``float32``: float32 params (the reference);
* ``bf16, ak.adamw alone``: bf16 params and ``ak.adamw`` directly (its moments are bf16,
  as the params; its bf16 update is added and rounded by ``optax.apply_updates``);
* ``bf16 nearest`` / ``stochastic`` / ``kahan``: ``ak.param_rounding(ak.adamw(...), method)``;
* ``bf16 + master weights``: ``ak.master_weights(ak.adamw(...))`` (a float32 copy).

Target (issue 20): ``stochastic`` and ``kahan`` end within 1.25x the float32 run's train
loss (plus 0.002) and within 1.5 points of its test accuracy. The table is printed and
written to ``benchmarks/bench_bf16_results.md`` (``--out`` to change), which
``docs/low_memory.md`` quotes.

    python benchmarks/bench_bf16.py            # about 3 minutes on 2 CPU cores
    python benchmarks/bench_bf16.py --seeds 3  # stochastic rounding with 3 keys
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import adamkit as ak

SIZES = (64, 512, 512, 10)
STEPS, LR, WEIGHT_DECAY = 300, 1e-3, 1e-4
HERE = pathlib.Path(__file__).parent


def data():
  x, y = load_digits(return_X_y=True)
  x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.25, random_state=0,
                                            stratify=y)
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  return f32(x_tr), jnp.asarray(y_tr), f32(x_te), jnp.asarray(y_te)


def init_params(key):
  params = {}
  for i, (n_in, n_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
    key, sub = jax.random.split(key)
    params[f"layer{i}"] = {"w": jax.random.normal(sub, (n_in, n_out)) * np.sqrt(2.0 / n_in),
                           "b": jnp.zeros(n_out)}
  return params


def logits(params, x):
  h = x
  for i in range(len(SIZES) - 1):
    layer = jax.tree.map(lambda a: a.astype(jnp.float32), params[f"layer{i}"])
    h = h @ layer["w"] + layer["b"]
    if i < len(SIZES) - 2:
      h = jax.nn.relu(h)
  return h


def loss_fn(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def adamw():
  return ak.adamw(optax.cosine_decay_schedule(LR, STEPS), weight_decay=WEIGHT_DECAY)


def runs(seed: int):
  """name -> (transform, params dtype, optimizer state bytes per parameter beyond the
  params themselves)."""
  out = {
      "float32": (adamw(), jnp.float32),
      "bf16, ak.adamw alone (bf16 moments)": (adamw(), jnp.bfloat16),
      "bf16 nearest": (ak.param_rounding(adamw(), "nearest"), jnp.bfloat16),
      "bf16 stochastic": (ak.param_rounding(adamw(), "stochastic", seed=seed), jnp.bfloat16),
      "bf16 kahan": (ak.param_rounding(adamw(), "kahan"), jnp.bfloat16),
      "bf16 + master weights": (ak.master_weights(adamw()), jnp.bfloat16),
  }
  return out


def bytes_per_param(params, state) -> float:
  n = sum(x.size for x in jax.tree.leaves(params))
  arrays = [x for x in jax.tree.leaves((params, state)) if getattr(x, "ndim", 0) > 0]
  return sum(x.size * x.dtype.itemsize for x in arrays) / n


def train(tx, dtype, params0, x_tr, y_tr, x_te, y_te):
  params = jax.tree.map(lambda a: a.astype(dtype), params0)
  state = tx.init(params)
  nbytes = bytes_per_param(params, state)

  @jax.jit
  def step(params, state):
    grads = jax.grad(loss_fn)(params, x_tr, y_tr)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(STEPS):
    params, state = step(params, state)
  train_loss = float(loss_fn(params, x_tr, y_tr))
  acc = float(jnp.mean(jnp.argmax(logits(params, x_te), -1) == y_te))
  return train_loss, 100.0 * acc, nbytes


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=1,
                      help="keys for the stochastic run (the other runs are deterministic)")
  parser.add_argument("--out", type=pathlib.Path, default=HERE / "bench_bf16_results.md")
  parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
  args = parser.parse_args()

  x_tr, y_tr, x_te, y_te = data()
  params0 = init_params(jax.random.key(0))
  results = {}
  t0 = time.perf_counter()
  for seed in range(args.seeds):
    for name, (tx, dtype) in runs(seed).items():
      if seed > 0 and name != "bf16 stochastic":
        continue
      label = name if args.seeds == 1 or name != "bf16 stochastic" else f"{name} (key {seed})"
      results[label] = train(tx, dtype, params0, x_tr, y_tr, x_te, y_te)
      print(f"{label:32s} loss {results[label][0]:.3e}  acc {results[label][1]:.2f}%", flush=True)

  ref_loss, ref_acc, _ = results["float32"]
  rows = []
  for name, (loss, acc, nbytes) in results.items():
    target = ""
    if name.startswith(("bf16 stochastic", "bf16 kahan")):
      ok = loss <= 1.25 * ref_loss + 0.002 and acc >= ref_acc - 1.5
      target = "met" if ok else "MISSED"
    rows.append(f"| {name} | {nbytes:.0f} | {loss:.2e} | {loss / ref_loss:.2f}x | {acc:.2f} | "
                f"{acc - ref_acc:+.2f} | {target} |")
  header = ("| params, update | bytes/param (params + state) | train loss | vs float32 | "
            "test acc. (%) | vs float32 (points) | target |\n|---|---|---|---|---|---|---|")
  text = "\n".join([header, *rows])
  setup = (f"Digits MLP {'-'.join(map(str, SIZES))}, {STEPS} full-batch steps of ak.adamw "
           f"(cosine-decayed lr {LR}, weight decay {WEIGHT_DECAY}); jax {jax.__version__}, "
           f"{platform.processor() or platform.machine()}, "
           f"{time.perf_counter() - t0:.0f} s. Target: stochastic and kahan within 1.25x the "
           "float32 train loss (+0.002) and 1.5 points of its test accuracy.")
  print("\n" + text + "\n\n" + setup)
  args.out.write_text("# bf16 params: `python benchmarks/bench_bf16.py`\n\n" + setup + "\n\n"
                      + text + "\n")
  if args.check and "MISSED" in text:
    raise SystemExit("a quality target was missed")


if __name__ == "__main__":
  main()
