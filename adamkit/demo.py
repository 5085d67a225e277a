r"""End-to-end demo: a click-through model trained with each adamkit optimizer.

Run ``python -m adamkit.demo`` (``--help`` for the options). It generates a synthetic
click log with a fixed seed, trains the same model with each optimizer on the same
batches, shows a progress bar, prints a comparison table and saves a loss plot.

The data: users and items drawn with a long tail (a few ids are frequent, most are
rare), and a click with probability

.. math::

  P(\text{click} \mid u, i) = \sigma\!\left(2\,\langle U_u, V_i\rangle + a_u + 1.5\,b_i - 1\right)

for hidden factors :math:`U, V` and biases :math:`a, b`. The model sees only the ids:
two embedding tables (users, items) feeding a small MLP plus a dot product, trained with
the binary cross-entropy. The hidden model's own cross-entropy is printed as the floor.

The optimizers are the rows of ``OPTIMIZERS`` (one table: a new optimizer is one more
entry there); ``--help`` lists them. Each step is compiled ahead of time, so the table
reports the compile time in its own column and times only compiled steps; the plot's
second panel shows each run's loss minus ``optax.adam``'s, and a note names the runs that
are identical by design (``Entry.same_as``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import adamkit as ak

# ------------------------------------------------------------------------------ data


def make_data(seed: int = 0, *, n_users: int = 20_000, n_items: int = 2_000,
              n_train: int = 200_000, n_eval: int = 20_000, rank: int = 8
              ) -> dict[str, Any]:
  """A synthetic click log: ``users``, ``items``, ``labels`` for train and eval.

  Also returns ``bayes_loss``: the eval cross-entropy of the true click probabilities,
  the best any model can reach.
  """
  rng = np.random.default_rng(seed)
  u_fac = rng.normal(size=(n_users, rank)) / np.sqrt(rank)
  v_fac = rng.normal(size=(n_items, rank)) / np.sqrt(rank)
  u_bias, v_bias = 0.5 * rng.normal(size=n_users), rng.normal(size=n_items)
  p_user = 1.0 / np.arange(1, n_users + 1) ** 0.8
  p_item = 1.0 / np.arange(1, n_items + 1) ** 0.6
  p_user, p_item = p_user / p_user.sum(), p_item / p_item.sum()

  def draw(n):
    users = rng.choice(n_users, size=n, p=p_user).astype(np.int32)
    items = rng.choice(n_items, size=n, p=p_item).astype(np.int32)
    logit = 2.0 * np.sum(u_fac[users] * v_fac[items], axis=1) + u_bias[users] + \
        1.5 * v_bias[items] - 1.0
    prob = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < prob).astype(np.float32)
    return users, items, labels, prob

  train, evals = draw(n_train), draw(n_eval)
  p = np.clip(evals[3], 1e-7, 1 - 1e-7)
  bayes = float(-np.mean(evals[2] * np.log(p) + (1 - evals[2]) * np.log(1 - p)))
  return dict(train=train[:3], eval=evals[:3], n_users=n_users, n_items=n_items,
              bayes_loss=bayes, bayes_auc=auc(evals[3], evals[2]))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """Area under the ROC curve (Mann-Whitney statistic from the ranks).

  Examples:
    >>> import numpy as np
    >>> from adamkit.demo import auc
    >>> auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]))
    0.75
  """
  scores, labels = np.asarray(scores, np.float64), np.asarray(labels) > 0.5
  ranks = np.empty(len(scores))
  ranks[np.argsort(scores, kind="stable")] = np.arange(1, len(scores) + 1)
  n_pos, n_neg = int(labels.sum()), int((~labels).sum())
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# ----------------------------------------------------------------------------- model


def init_params(key: jax.Array, n_users: int, n_items: int, dim: int = 16,
                hidden: int = 32) -> dict[str, Any]:
  """Two embedding tables and an MLP (``fc1``, ``fc2``)."""
  ku, ki, k1, k2 = jax.random.split(key, 4)
  return {
      "user_emb": 0.05 * jax.random.normal(ku, (n_users, dim)),
      "item_emb": 0.05 * jax.random.normal(ki, (n_items, dim)),
      "fc1": {"weight": jax.random.normal(k1, (2 * dim, hidden)) / np.sqrt(2 * dim),
              "bias": jnp.zeros(hidden)},
      "fc2": {"weight": jax.random.normal(k2, (hidden,)) / np.sqrt(hidden),
              "bias": jnp.zeros(())},
  }


def logits(params, users, items):
  u = ak.lookup(params["user_emb"], users)
  v = ak.lookup(params["item_emb"], items)
  h = jax.nn.relu(jnp.concatenate([u, v], axis=-1) @ params["fc1"]["weight"] +
                  params["fc1"]["bias"])
  return h @ params["fc2"]["weight"] + params["fc2"]["bias"] + jnp.sum(u * v, axis=-1)


def loss_fn(params, users, items, labels):
  return jnp.mean(optax.sigmoid_binary_cross_entropy(logits(params, users, items), labels))


# ------------------------------------------------------------------------ optimizers


@dataclasses.dataclass(frozen=True)
class Entry:
  label: str  # shown in the table and the plot
  make: Callable[[float], optax.GradientTransformation]
  sparse: bool = False  # row-sparse embedding gradients (ak.value_and_sparse_grad)
  strict_promotion_ok: bool = True  # False: optax's code mixes int and float internally
  # (name, how) when this entry's curve equals another's by design: the plot says so
  same_as: tuple[str, str] | None = None


# Every optimizer the demo knows, in the order of the table and the plot.
OPTIMIZERS: dict[str, Entry] = {
    "adam": Entry("ak.adam", lambda lr: ak.adam(lr)),
    "adam_corrected": Entry('ak.adam(eps_mode="corrected")',
                            lambda lr: ak.adam(lr, eps_mode="corrected"),
                            same_as=("optax_adam", "the same formula, to float32 rounding")),
    "optax_adam": Entry("optax.adam", lambda lr: optax.adam(lr), strict_promotion_ok=False),
    "adamax": Entry("ak.adamax", lambda lr: ak.adamax(lr)),
    "adam_offload": Entry("ak.adam_offload (host state)", lambda lr: ak.adam_offload(lr),
                          same_as=("adam", "the same maths, bit for bit")),
    "sparse_adam": Entry("ak.sparse_adam (lazy)", lambda lr: ak.sparse_adam(lr), sparse=True),
    "adamw": Entry("ak.adamw (wd 1e-4)", lambda lr: ak.adamw(lr, weight_decay=1e-4),
                   same_as=("optax_adamw", "no beta/gamma names here, so the same decoupled "
                                           "update, to float32 rounding")),
    "optax_adamw": Entry("optax.adamw (wd 1e-4)", lambda lr: optax.adamw(lr, weight_decay=1e-4),
                         strict_promotion_ok=False),
    # 8-bit moments (bitsandbytes'/torchao's format): a quarter of the state's memory
    "adamw_8bit": Entry("ak.adamw 8-bit moments", lambda lr: ak.adamw(
        lr, weight_decay=1e-4, mu_dtype="8bit", nu_dtype="8bit")),
    "sparse_adam_8bit": Entry("ak.sparse_adam 8-bit", lambda lr: ak.sparse_adam(
        lr, mu_dtype="8bit", nu_dtype="8bit"), sparse=True),
}


def _make_step(tx: optax.GradientTransformation, sparse: bool):
  if sparse:
    grad_fn = ak.value_and_sparse_grad(loss_fn)

    def step(params, state, users, items, labels):
      loss, grads = grad_fn(params, {"user_emb": users, "item_emb": items}, users, items,
                            labels)
      updates, state = tx.update(grads, state, params)
      return ak.apply_updates(params, updates), state, loss
  else:

    def step(params, state, users, items, labels):
      loss, grads = jax.value_and_grad(loss_fn)(params, users, items, labels)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss

  return jax.jit(step, donate_argnums=(0, 1))


# -------------------------------------------------------------------------- training


class _Progress:
  """tqdm when installed, else a line every tenth of the run."""

  def __init__(self, total: int, desc: str, enabled: bool):
    self.total, self.desc, self.n, self.bar = total, desc, 0, None
    self.enabled = enabled
    if enabled:
      try:
        from tqdm.auto import tqdm
        self.bar = tqdm(total=total, desc=desc, leave=True, file=sys.stderr)
      except ImportError:
        pass

  def note(self, text: str):
    """A remark shown next to the bar (or printed), e.g. the compile time."""
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.set_description(f"{self.desc} ({text})")
    else:
      print(f"{self.desc}: {text}", file=sys.stderr)

  def update(self, loss: float):
    self.n += 1
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.update(1)
      if self.n % 10 == 0 or self.n == self.total:
        self.bar.set_postfix(mean_loss=f"{loss:.4f}")
    elif self.n % max(1, self.total // 10) == 0 or self.n == self.total:
      print(f"{self.desc}: step {self.n}/{self.total}  mean loss {loss:.4f}", file=sys.stderr)

  def close(self):
    if self.bar is not None:
      self.bar.close()


def train(names: Sequence[str], data: dict[str, Any], *, steps: int, batch: int, lr: float,
          seed: int, eval_every: int, progress: bool = True) -> dict[str, dict[str, Any]]:
  """Trains the model with each of ``OPTIMIZERS[n] for n in names``; returns per name the
  losses, eval metrics and timings.

  Every step is compiled ahead of time (``jit(...).lower(...).compile()``) before any
  training, so ``compile_s`` is its tracing and compilation alone and the loop, timed into
  ``step_ms``, runs only compiled code: a step that needed another compilation would raise
  instead of being timed. The optimizers then train in lockstep (step ``t`` of each, then
  step ``t + 1``), so a change in the machine's load hits them alike. The parameters are
  committed to the device first: arrays fresh from ``jax.random`` are uncommitted, the
  step returns committed ones, and with host-memory state in the same call
  (``ak.adam_offload``) ``jit`` would otherwise compile the step a second time.
  """
  users, items, labels = data["train"]
  order = np.arange(steps * batch).reshape(steps, batch) % len(labels)
  e_users, e_items, e_labels = (jnp.asarray(x) for x in data["eval"])
  predict = jax.jit(logits)

  def batch_at(t):
    idx = order[t]
    return jnp.asarray(users[idx]), jnp.asarray(items[idx]), jnp.asarray(labels[idx])

  runs = {}
  for name in names:
    entry = OPTIMIZERS[name]
    promotion = (contextlib.nullcontext() if entry.strict_promotion_ok
                 else jax.numpy_dtype_promotion("standard"))
    with promotion:  # tracing happens here, once; the compiled step needs no context
      tx = entry.make(lr)
      params = jax.device_put(
          init_params(jax.random.key(seed), data["n_users"], data["n_items"]),
          jax.devices()[0])
      state = tx.init(params)
      start = time.perf_counter()
      step = _make_step(tx, entry.sparse).lower(params, state, *batch_at(0)).compile()
      compile_s = time.perf_counter() - start
    runs[name] = dict(label=entry.label, step=step, params=params, state=state,
                      compile_s=compile_s, losses=[], step_ms=[], eval_steps=[],
                      eval_auc=[], eval_loss=[])
  total_compile = sum(r["compile_s"] for r in runs.values())
  bar = _Progress(steps, f"{len(runs)} optimizer(s), lockstep", progress)  # after compiling
  bar.note(f"compiled in {total_compile:.1f} s")
  for t in range(steps):
    users_t, items_t, labels_t = batch_at(t)
    for r in runs.values():
      start = time.perf_counter()
      r["params"], r["state"], loss = r["step"](r["params"], r["state"], users_t, items_t,
                                                labels_t)
      loss = float(loss)  # waits for the step: the timing is honest
      r["step_ms"].append(1e3 * (time.perf_counter() - start))
      r["losses"].append(loss)
      if t == 0:
        r["first_params"] = jax.tree.map(lambda x: np.array(x, copy=True), r["params"])
      if (t + 1) % eval_every == 0 or t + 1 == steps:
        z = np.asarray(predict(r["params"], e_users, e_items))
        y = np.asarray(e_labels)
        r["eval_steps"].append(t + 1)
        r["eval_auc"].append(auc(z, y))
        r["eval_loss"].append(float(np.mean(np.logaddexp(0.0, z) - y * z)))
    bar.update(float(np.mean([r["losses"][-1] for r in runs.values()])))
  bar.close()
  for r in runs.values():
    del r["step"], r["state"]
    r["ms_per_step"] = float(np.median(r["step_ms"]))
  return runs


# --------------------------------------------------------------------------- reports


def smooth(values: Sequence[float], window: int) -> np.ndarray:
  """Trailing moving average (the first points average what there is)."""
  x = np.asarray(values, np.float64)
  c = np.cumsum(np.concatenate([[0.0], x]))
  n = np.arange(1, len(x) + 1)
  lo = np.maximum(n - window, 0)
  return (c[n] - c[lo]) / (n - lo)


def format_table(results: dict[str, dict[str, Any]], data: dict[str, Any]) -> str:
  """The comparison table (Markdown), with a note on what the time columns measure."""
  window = max(1, len(next(iter(results.values()))["losses"]) // 10)
  header = (f"| {'optimizer':<30} | step-1 loss | final loss | eval loss | eval AUC | "
            "compile s | ms/step |")
  rule = "|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|"
  rows = [header, rule]
  for r in results.values():
    final = float(smooth(r["losses"], window)[-1])
    rows.append(f"| {r['label']:<30} | {r['losses'][0]:11.4f} | {final:10.4f} | "
                f"{r['eval_loss'][-1]:9.4f} | {r['eval_auc'][-1]:8.4f} | "
                f"{r['compile_s']:9.2f} | {r['ms_per_step']:7.2f} |")
  rows.append(f"| {'(true click model: the floor)':<30} | {'':11} | {'':10} | "
              f"{data['bayes_loss']:9.4f} | {data['bayes_auc']:8.4f} | {'':9} | {'':7} |")
  rows.append("compile s: tracing and compiling the jitted training step, once per optimizer "
              "(ahead of time);\nms/step: median wall time of the compiled steps, the "
              "gradient and the update together (final loss: mean of the last "
              f"{window} steps).")
  return "\n".join(rows)


def identical_by_design(results: dict[str, dict[str, Any]]) -> list[str]:
  """One sentence per run whose curve equals another run's by design (``Entry.same_as``)."""
  notes = []
  for name in results:
    same = OPTIMIZERS[name].same_as
    if same is not None and same[0] in results:
      notes.append(f"{results[name]['label']} = {results[same[0]]['label']}: {same[1]}")
  return notes


def save_plot(results: dict[str, dict[str, Any]], data: dict[str, Any],
              path: pathlib.Path) -> pathlib.Path | None:
  """Two panels: the training loss, and each loss minus the reference optimizer's.

  The reference is ``optax.adam`` when it ran, else the first optimizer. Curves that are
  identical by design are drawn on top of each other, so the figure says so in a note;
  the second panel shows what does differ. ``None`` without matplotlib.
  """
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  ref = "optax_adam" if "optax_adam" in results else next(iter(results))
  n = len(results[ref]["losses"])
  window = max(1, n // 20)
  fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.8))
  styles = [dict(ls="-", lw=2.2), dict(ls="--", lw=1.6), dict(ls="-", lw=1.4),
            dict(ls="-.", lw=1.4), dict(ls=":", lw=2.4), dict(ls="-", lw=1.0)]
  steps = np.arange(1, n + 1)
  ref_smooth = smooth(results[ref]["losses"], window)
  for k, r in enumerate(results.values()):
    style = dict(styles[k % len(styles)], color=f"C{k}")
    ax_loss.plot(steps, smooth(r["losses"], window), label=r["label"], **style)
    ax_diff.plot(steps, smooth(r["losses"], window) - ref_smooth, label=r["label"], **style)
  ax_loss.axhline(data["bayes_loss"], color="gray", lw=0.8, label="true model (floor)")
  ax_loss.set(xlabel="step", ylabel=f"train BCE (moving average of {window})",
              title="Training loss, same batches for every optimizer")
  ax_diff.axhline(0.0, color="gray", lw=0.8)
  # symlog: the float32-rounding drift (~1e-3) and the algorithms' gaps (~1e-2) both show
  ax_diff.set_yscale("symlog", linthresh=1e-3)
  ax_diff.set(xlabel="step (lines as on the left)",
              ylabel=f"train BCE minus {results[ref]['label']}'s (symlog)",
              title=f"What differs: loss minus {results[ref]['label']}'s")
  ax_loss.legend(fontsize=8)
  notes = identical_by_design(results)
  if notes:
    fig.text(0.01, 0.01, "Identical by design (their curves coincide): " + "; ".join(notes),
             fontsize=8, va="bottom", wrap=True)
  fig.tight_layout(rect=(0, 0.06 if notes else 0, 1, 1))
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


# ------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
  """The command line of ``python -m adamkit.demo``; ``--help`` lists every flag."""
  names = "\n".join(f"  {n:<16} {e.label}" for n, e in OPTIMIZERS.items())
  p = argparse.ArgumentParser(
      prog="python -m adamkit.demo", formatter_class=argparse.RawDescriptionHelpFormatter,
      description=("Trains a click-through model (two embedding tables and an MLP) on a "
                   "synthetic click log\nwith each optimizer, in lockstep on the same "
                   "batches; prints a table (losses, eval AUC,\ncompile time, time per "
                   "compiled step) and saves a plot of the training losses and of\ntheir "
                   "differences."),
      epilog=(f"optimizers (--optimizers):\n{names}\n\noutputs: <out>/results.json "
              "(every loss and timing), <out>/demo_loss.png (the plot)"))
  p.add_argument("--steps", type=int, default=300,
                 help="training steps per optimizer (default: %(default)s)")
  p.add_argument("--batch", type=int, default=512, help="examples per step (default: %(default)s)")
  p.add_argument("--lr", type=float, default=0.01,
                 help="learning rate of every optimizer (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the data and of the initial parameters (default: %(default)s)")
  p.add_argument("--users", type=int, default=20_000,
                 help="rows of the user embedding table (default: %(default)s)")
  p.add_argument("--items", type=int, default=2_000,
                 help="rows of the item embedding table (default: %(default)s)")
  p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                 help="comma-separated names from the list below (default: all)")
  p.add_argument("--out", default="demo_out",
                 help="folder for results.json and the plot (default: %(default)s)")
  p.add_argument("--no-progress", action="store_true",
                 help="no progress bar (tqdm when installed, else a line per tenth of the run)")
  p.add_argument("--no-plot", action="store_true", help="do not save the plot")
  return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = build_parser()
  args = p.parse_args(argv)
  names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
  unknown = [n for n in names if n not in OPTIMIZERS]
  if unknown or not names:
    p.error(f"unknown optimizer(s) {unknown}; choose from {', '.join(OPTIMIZERS)}")
  if args.steps < 1 or args.batch < 1:
    p.error("--steps and --batch must be >= 1")
  args.optimizers = names
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the demo; returns ``{name: results}`` (also written to ``<out>/results.json``)."""
  args = parse_args(argv)
  out = pathlib.Path(args.out)
  print(f"adamkit {ak.__version__} demo on {jax.devices()[0].platform}: "
        f"{args.users:,} users x {args.items:,} items, {args.steps} steps of "
        f"{args.batch}, lr {args.lr}")
  # One pass over fresh clicks, as in online CTR training: the train loss is honest.
  data = make_data(args.seed, n_users=args.users, n_items=args.items,
                   n_train=args.steps * args.batch)
  print(f"train clicks: {data['train'][2].mean():.1%} positive")
  results = train(args.optimizers, data, steps=args.steps, batch=args.batch, lr=args.lr,
                  seed=args.seed, eval_every=max(1, args.steps // 10),
                  progress=not args.no_progress)

  table = format_table(results, data)
  print()
  print(table)
  if "adam_corrected" in results and "optax_adam" in results:
    ours, theirs = results["adam_corrected"], results["optax_adam"]
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(
        jax.tree.leaves(ours["first_params"]), jax.tree.leaves(theirs["first_params"])))
    dloss = float(np.max(np.abs(np.subtract(ours["losses"], theirs["losses"]))))
    print(f"\ncheck: ak.adam(eps_mode=\"corrected\") vs optax.adam: max |w difference| after "
          f"step 1 = {diff:.1e}; max |train loss difference| over {args.steps} steps = "
          f"{dloss:.1e}\n(float32 rounding only: Adam turns a rounding-sized gradient into a "
          "full step, so the two runs drift slowly apart)")
  if "adam" in results and "adam_offload" in results:
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
        jax.tree.leaves(results["adam"]["params"]),
        jax.tree.leaves(results["adam_offload"]["params"])))
    print(f"check: ak.adam_offload vs ak.adam (same maths, state in host memory): max |w "
          f"difference| after {args.steps} steps = {diff:.1e}")
  out.mkdir(parents=True, exist_ok=True)
  summary = {n: {k: v for k, v in r.items() if "params" not in k} for n, r in results.items()}
  (out / "results.json").write_text(json.dumps(summary, indent=1))
  if not args.no_plot:
    path = save_plot(results, data, out / "demo_loss.png")
    print(f"\nplot: {path}" if path else "\nmatplotlib is not installed: no plot "
          "(pip install 'adamkit[demo]').")
  return results


if __name__ == "__main__":
  main()
