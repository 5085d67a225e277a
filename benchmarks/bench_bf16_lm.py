"""bf16 params without a float32 master copy, second run: a small transformer language model.

A decoder-only transformer (pre-norm, learned positions, causal multi-head attention, GELU
MLP; plain ``jax.numpy``, the params one dict) trained on text from a fixed probabilistic
grammar (below), with ``ak.adamw`` under a warmup-cosine schedule that decays to zero.
Five runs on the same data, batches and initial values; the forward and backward passes
compute in float32 in every run, only how the params are *stored* and *updated* differs:

* ``float32``: float32 params (the reference);
* ``bf16 nearest`` / ``stochastic`` / ``kahan``:
  ``ak.param_rounding(ak.adamw(...), method)`` on bf16 params;
* ``bf16 kahan + 8-bit moments``: the same with ``mu_dtype=nu_dtype=ak.Quantized("8bit")``
  (every matrix and the embeddings quantized; the biases and norm scales, under its
  ``min_size`` of 4096 elements, keep float32 moments).

The text: sentences ``subject verb object [adverb] .`` whose noun phrases carry a
determiner, adjectives and at times a prepositional phrase (a subject's number decides its
verb's form across that phrase); nouns, adjectives and adverbs come from one of 8 topics,
which changes between sentences with probability 0.05; the verb is one of the 4 its
subject's noun does, the object one of the 4 nouns its verb takes; every choice
Zipf-weighted (exponent 1.5). The words are generated pseudo-words; only their ids matter.
The train stream and the held-out stream are two draws (seeds 0 and 1) of the grammar.
The initial values (LeCun normal matrices, embeddings of standard deviation 1, as T5's)
are rounded to bf16 for every run, the float32 one included.

The train loss is recorded every ``--every`` steps (the mean over those steps' batches),
the held-out loss at the end. Writes ``benchmarks/results/bench_bf16_lm.json``, the table
``benchmarks/bench_bf16_lm_results.md`` and the figure ``docs/_static/bf16_lm_loss.png``
(``docs/low_memory.md`` quotes both).

    python benchmarks/bench_bf16_lm.py            # about 11 minutes on 2 loaded CPU cores
    python benchmarks/bench_bf16_lm.py --steps 200 --no-plot   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import adamkit as ak  # noqa: E402

HERE = pathlib.Path(__file__).parent
FIGURE = HERE.parent / "docs" / "_static" / "bf16_lm_loss.png"


@dataclasses.dataclass(frozen=True)
class Config:
  d_model: int = 128
  layers: int = 2
  heads: int = 4
  seq: int = 64
  batch: int = 16
  steps: int = 1500
  peak_lr: float = 1e-3
  warmup: int = 100
  weight_decay: float = 0.01
  train_tokens: int = 600_000
  held_out_tokens: int = 40_000


# ------------------------------------------------------------------------- the grammar

TOPICS = 8
SINGULAR_DETS = ("a", "the", "this", "that", "every", "one", "each", "my")
PLURAL_DETS = ("the", "these", "those", "some", "many", "two", "few", "our")
PREPOSITIONS = ("near", "under", "with", "behind", "beside", "above", "for", "without")


def pseudo_words(rng: np.random.Generator, count: int, taken: set) -> list[str]:
  """``count`` distinct pronounceable words of two or three syllables."""
  onsets = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st")
  vowels = ("a", "e", "i", "o", "u", "ai", "ou")
  out = []
  while len(out) < count:
    word = "".join(rng.choice(onsets) + rng.choice(vowels)
                   for _ in range(rng.integers(2, 4)))
    if word not in taken:
      taken.add(word)
      out.append(word)
  return out


class Grammar:
  """The text source: a vocabulary, Zipf weights per topic and a sentence sampler."""

  def __init__(self, seed: int = 0):
    rng = np.random.default_rng(seed)
    taken = set(SINGULAR_DETS + PLURAL_DETS + PREPOSITIONS + (".",))
    nouns = pseudo_words(rng, 96, taken)
    verbs = pseudo_words(rng, 64, taken)
    self.adjectives = pseudo_words(rng, 48, taken)
    self.adverbs = pseudo_words(rng, 16, taken)
    self.nouns = [(n, n + "s") for n in nouns]          # singular, plural
    self.verbs = [(v + "s", v) for v in verbs]          # with a singular, a plural subject
    words = [".", *dict.fromkeys(SINGULAR_DETS + PLURAL_DETS), *PREPOSITIONS,
             *[w for pair in self.nouns for w in pair], *[w for pair in self.verbs for w in pair],
             *self.adjectives, *self.adverbs]
    self.vocab = words
    self.id = {w: i for i, w in enumerate(words)}
    # Each topic favours its own ordering of every word class: Zipf weights 1/(rank+1)
    # over a topic-specific permutation.
    self.order = {cls: [rng.permutation(n) for _ in range(TOPICS)]
                  for cls, n in (("noun", len(nouns)), ("verb", len(verbs)),
                                 ("adj", len(self.adjectives)), ("adv", len(self.adverbs)))}
    # The verbs a noun does (4 each) and the nouns a verb takes as object (4 each).
    self.verbs_of = [rng.permutation(len(verbs))[:4] for _ in nouns]
    self.object_of = [rng.permutation(len(nouns))[:4] for _ in verbs]

  @staticmethod
  def zipf(rng, order, s=1.5):
    w = 1.0 / (np.arange(len(order)) + 1.0) ** s
    return order[rng.choice(len(order), p=w / w.sum())]

  def noun_phrase(self, rng, topic, depth=0, nouns=None):
    """Determiner, adjectives, noun and at times a prepositional phrase; the noun from
    the topic's, or from ``nouns``. Returns ``(words, head noun, plural)``."""
    plural = rng.random() < 0.4
    out = [rng.choice(PLURAL_DETS if plural else SINGULAR_DETS)]
    for _ in range(rng.choice(3, p=(0.5, 0.35, 0.15))):
      out.append(self.adjectives[self.zipf(rng, self.order["adj"][topic])])
    noun = self.zipf(rng, self.order["noun"][topic] if nouns is None else nouns)
    out.append(self.nouns[noun][int(plural)])
    if depth == 0 and rng.random() < 0.3:
      out += [rng.choice(PREPOSITIONS), *self.noun_phrase(rng, topic, depth + 1)[0]]
    return out, noun, plural

  def sentence(self, rng, topic):
    subject, noun, plural = self.noun_phrase(rng, topic)
    verb = self.zipf(rng, self.verbs_of[noun])
    obj, _, _ = self.noun_phrase(rng, topic, nouns=self.object_of[verb])
    out = [*subject, self.verbs[verb][int(plural)], *obj]
    if rng.random() < 0.3:
      out.append(self.adverbs[self.zipf(rng, self.order["adv"][topic])])
    return [*out, "."]

  def stream(self, tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    topic, out = 0, []
    while len(out) < tokens:
      if rng.random() < 0.05:
        topic = int(rng.integers(TOPICS))
      out += [self.id[w] for w in self.sentence(rng, topic)]
    return np.asarray(out[:tokens], np.int32)


# ------------------------------------------------------------------------- the model


def init_params(cfg: Config, vocab: int, key) -> dict:
  """Matrices normal with standard deviation 1/sqrt(fan-in) (LeCun; the residual
  projections a further 1/sqrt(2 layers), as GPT-2), embeddings 1, norms' scales 1, biases
  0; rounded to bf16, so that every run starts from the same values."""
  d, keys = cfg.d_model, iter(jax.random.split(key, 4 + 4 * cfg.layers))
  normal = lambda shape, std: std * jax.random.normal(next(keys), shape)  # noqa: E731
  params = {"embed": normal((vocab, d), 1.0), "position": normal((cfg.seq, d), 1.0),
            "final_gamma": jnp.ones(d), "unembed": normal((d, vocab), d ** -0.5)}
  residual = (2 * cfg.layers) ** -0.5
  for i in range(cfg.layers):
    params[f"block{i}"] = {
        "attn_gamma": jnp.ones(d), "qkv": normal((d, 3 * d), d ** -0.5),
        "attn_out": normal((d, d), residual * d ** -0.5),
        "mlp_gamma": jnp.ones(d), "mlp_in": normal((d, 4 * d), d ** -0.5),
        "mlp_in_bias": jnp.zeros(4 * d),
        "mlp_out": normal((4 * d, d), residual * (4 * d) ** -0.5), "mlp_out_bias": jnp.zeros(d)}
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)


def rms_norm(x, gamma):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * gamma


def logits_fn(params, tokens, heads: int):
  p = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  t = tokens.shape[-1]
  x = p["embed"][tokens] + p["position"][:t]
  causal = jnp.tril(jnp.ones((t, t), bool))
  for i in range(sum(k.startswith("block") for k in p)):
    b = p[f"block{i}"]
    q, k, v = jnp.split(rms_norm(x, b["attn_gamma"]) @ b["qkv"], 3, -1)
    split = lambda a: a.reshape(*a.shape[:-1], heads, -1)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), -1)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)
    x = x + attended @ b["attn_out"]
    h = jax.nn.gelu(rms_norm(x, b["mlp_gamma"]) @ b["mlp_in"] + b["mlp_in_bias"])
    x = x + h @ b["mlp_out"] + b["mlp_out_bias"]
  return rms_norm(x, p["final_gamma"]) @ p["unembed"]


def loss_fn(params, windows, heads: int):
  """Mean next-token cross-entropy (nats) over windows of seq + 1 tokens."""
  logits = logits_fn(params, windows[:, :-1], heads)
  return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


# ------------------------------------------------------------------------- the runs


def warmup_steps(cfg: Config) -> int:
  return min(cfg.warmup, cfg.steps // 10)


def adamw(cfg: Config, **kw):
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.peak_lr, warmup_steps(cfg), cfg.steps,
                                                  0.0)
  decayed = lambda params: jax.tree.map(lambda x: x.ndim == 2, params)  # noqa: E731 - matrices
  return ak.adamw(schedule, weight_decay=cfg.weight_decay, weight_decay_mask=decayed, **kw)


def runs(cfg: Config) -> dict:
  """name -> (transform, params dtype)."""
  q8 = ak.Quantized("8bit", min_size=4096)
  return {
      "float32": (adamw(cfg), jnp.float32),
      "bf16 nearest": (ak.param_rounding(adamw(cfg), "nearest"), jnp.bfloat16),
      "bf16 stochastic": (ak.param_rounding(adamw(cfg), "stochastic", seed=0), jnp.bfloat16),
      "bf16 kahan": (ak.param_rounding(adamw(cfg), "kahan"), jnp.bfloat16),
      "bf16 kahan + 8-bit moments": (
          ak.param_rounding(adamw(cfg, mu_dtype=q8, nu_dtype=q8), "kahan"), jnp.bfloat16),
  }


def bytes_per_param(params, state) -> float:
  """Params and optimizer state (arrays of one element or more: not the step count or key)."""
  n = sum(x.size for x in jax.tree.leaves(params))
  arrays = [x for x in jax.tree.leaves((params, state)) if getattr(x, "ndim", 0) > 0]
  return sum(x.size * x.dtype.itemsize for x in arrays) / n


def train(cfg: Config, tx, dtype, params0, train_stream, starts, held_out, every: int) -> dict:
  params = jax.tree.map(lambda a: a.astype(dtype), params0)
  state = tx.init(params)
  nbytes = bytes_per_param(params, state)
  offsets = jnp.arange(cfg.seq + 1)

  @jax.jit
  def step(params, state, start):
    windows = train_stream[start[:, None] + offsets]
    loss, grads = jax.value_and_grad(loss_fn)(params, windows, cfg.heads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  @jax.jit
  def evaluate(params):
    return jax.lax.map(lambda w: loss_fn(params, w, cfg.heads), held_out).mean()

  t0 = time.perf_counter()
  curve, window = [], []
  for i in range(cfg.steps):
    params, state, loss = step(params, state, starts[i])
    window.append(loss)
    if (i + 1) % every == 0 or i + 1 == cfg.steps:
      curve.append((i + 1, float(jnp.mean(jnp.stack(window)))))
      window = []
  seconds = time.perf_counter() - t0
  return {"curve": curve, "train_loss": curve[-1][1], "held_out_loss": float(evaluate(params)),
          "bytes_per_param": nbytes, "seconds": seconds}


def plot(results: dict, cfg: Config, path: pathlib.Path):
  import matplotlib  # noqa: PLC0415 - only for the figure

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, (full, late) = plt.subplots(1, 2, figsize=(11, 4.2))
  ref = dict(results["float32"]["curve"])
  for name, r in results.items():
    steps, loss = np.asarray(r["curve"]).T
    full.plot(steps, loss, label=name, lw=1.3)
    tail = steps >= cfg.steps // 2
    late.plot(steps[tail], loss[tail] - np.asarray([ref[s] for s in steps[tail]]), label=name,
              lw=1.3)
  full.set(yscale="log", xlabel="step", ylabel="train loss (nats/token, log scale)",
           title="train loss")
  late.axhline(0.0, color="k", lw=0.6)
  late.set(xlabel="step", ylabel="train loss minus float32's (nats/token)",
           title="second half: difference to float32 params")
  full.legend()
  for ax in (full, late):
    ax.grid(alpha=0.3, which="both")
  fig.suptitle(f"Transformer LM ({cfg.layers} layers, d_model {cfg.d_model}), ak.adamw, "
               f"{cfg.steps} steps, warmup-cosine to 0", fontsize=10)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=Config.steps)
  ap.add_argument("--every", type=int, default=25, help="record the train loss every N steps")
  ap.add_argument("--runs", default=None,
                  help="comma-separated subset of the run names (default: all five)")
  ap.add_argument("--out", type=pathlib.Path, default=HERE / "bench_bf16_lm_results.md")
  ap.add_argument("--figure", type=pathlib.Path, default=FIGURE)
  ap.add_argument("--no-plot", action="store_true")
  args = ap.parse_args()
  cfg = Config(steps=args.steps)

  grammar = Grammar(0)
  train_stream = jnp.asarray(grammar.stream(cfg.train_tokens, seed=0))
  held = grammar.stream(cfg.held_out_tokens, seed=1)
  n_windows = (len(held) - 1) // (cfg.seq + 1) // cfg.batch * cfg.batch
  held_out = jnp.asarray(held[:n_windows * (cfg.seq + 1)].reshape(-1, cfg.batch, cfg.seq + 1))
  starts = jnp.asarray(np.random.default_rng(2).integers(
      0, cfg.train_tokens - cfg.seq - 1, (cfg.steps, cfg.batch)), jnp.int32)
  params0 = init_params(cfg, len(grammar.vocab), jax.random.key(0))
  n_params = sum(x.size for x in jax.tree.leaves(params0))
  print(f"vocabulary {len(grammar.vocab)}, {n_params / 1e6:.2f}M params, "
        f"{cfg.steps} steps of {cfg.batch}x{cfg.seq} tokens", flush=True)

  selected = runs(cfg)
  if args.runs:
    selected = {k: v for k, v in selected.items() if k in args.runs.split(",")}
  results = {}
  for name, (tx, dtype) in selected.items():
    results[name] = train(cfg, tx, dtype, params0, train_stream, starts, held_out, args.every)
    r = results[name]
    print(f"{name:28s} train {r['train_loss']:.4f}  held-out {r['held_out_loss']:.4f}  "
          f"{r['bytes_per_param']:.2f} B/param  {r['seconds']:.0f} s", flush=True)

  ref = results.get("float32")
  rows = []
  for name, r in results.items():
    vs = (f"{r['train_loss'] / ref['train_loss']:.3f}x | "
          f"{r['held_out_loss'] / ref['held_out_loss']:.3f}x") if ref else "- | -"
    rows.append(f"| {name} | {r['bytes_per_param']:.2f} | {r['train_loss']:.4f} | "
                f"{r['held_out_loss']:.4f} | {vs} |")
  header = ("| params, update | bytes/param (params + state) | train loss | held-out loss | "
            "train vs float32 | held-out vs float32 |\n|---|---|---|---|---|---|")
  text = "\n".join([header, *rows])
  total = sum(r["seconds"] for r in results.values())
  setup = (f"Transformer LM: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, "
           f"sequence {cfg.seq}, vocabulary {len(grammar.vocab)}, {n_params / 1e6:.2f}M params; "
           f"{cfg.steps} steps of {cfg.batch} x {cfg.seq} tokens, ak.adamw (peak lr "
           f"{cfg.peak_lr}, {warmup_steps(cfg)} warmup steps, cosine to 0, weight decay "
           f"{cfg.weight_decay} on the matrices). Train loss: mean of the last {args.every} "
           f"steps' batches; held-out: {held_out.shape[0] * cfg.batch} windows of another draw "
           f"of the grammar. jax {jax.__version__}, {platform.machine()}, {total:.0f} s.")
  print("\n" + text + "\n\n" + setup)
  args.out.write_text("# bf16 params, transformer LM: `python benchmarks/bench_bf16_lm.py`\n\n"
                      + setup + "\n\n" + text + "\n")
  path = common.write_json("bench_bf16_lm", {"config": dataclasses.asdict(cfg),
                                             "vocabulary": len(grammar.vocab),
                                             "params": n_params, "results": results})
  print(f"written: {args.out}, {path}")
  if not args.no_plot:
    plot(results, cfg, args.figure)
    print(f"figure: {args.figure}")


if __name__ == "__main__":
  main()
