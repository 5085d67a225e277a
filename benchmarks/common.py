"""Helpers shared by the dense benchmarks: interleaved timing, tables, JSON.

The machine is shared and noisy, so every scenario runs its contenders *interleaved*
(round ``r`` times contender A, then B, then C, ...) and reports medians: a burst of load
from elsewhere then hits every contender alike, and the ratios stay meaningful even when
the absolute times wobble.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import random
import statistics
import time
from collections.abc import Callable

import jax

RESULTS = pathlib.Path(__file__).parent / "results"


def stateful_runner(fn: Callable, carry: tuple, extra: tuple = ()) -> Callable[[], float]:
  """A zero-argument timer for ``carry = fn(*carry, *extra)`` (donated carries stay valid).

  Returns the wall time of one call, including ``block_until_ready``.
  """
  box = [carry]

  def run() -> float:
    t = time.perf_counter()
    out = fn(*box[0], *extra)
    jax.block_until_ready(out)
    dt = time.perf_counter() - t
    box[0] = out
    return dt

  return run


def with_cpu_time(run: Callable[[], float], out: list) -> Callable[[], float]:
  """``run``, appending the CPU time of the whole process (every thread) per call to ``out``:
  on a shared machine the wall time depends on whether the helper threads find a free core,
  the CPU time much less."""
  def timed() -> float:
    c = time.process_time()
    dt = run()
    out.append(time.process_time() - c)
    return dt
  return timed


def interleave(runners: dict[str, Callable[[], float]], reps: int,
               warmup: int = 2, shuffle: bool = False) -> dict[str, list[float]]:
  """Runs every runner ``warmup + reps`` times, round-robin; returns the timed seconds.

  ``shuffle``: each round in its own order (seeded, the same in every run). In a fixed
  order a runner always follows the same one and pays for whatever that one leaves
  behind: with bench_lowbit_speed.py's contenders (a short script timing them in turn),
  the fused 8-bit step that followed torch's foreach AdamW took 0.4-0.5 ms (5%) longer than
  after torch's fused step (torch's fused step, put there, paid nothing measurable).
  """
  times = {k: [] for k in runners}
  order = list(runners)
  rng = random.Random(0)
  for r in range(warmup + reps):
    if shuffle:
      rng.shuffle(order)
    for name in order:
      dt = runners[name]()
      if r >= warmup:
        times[name].append(dt)
  return times


def median_ms(samples: list[float]) -> float:
  return 1e3 * statistics.median(samples)


def table(title: str, header: list[str], rows: list[list]) -> str:
  """A plain-text table (also valid Markdown)."""
  def fmt(x):
    if isinstance(x, float):
      return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)
  cells = [header] + [[fmt(c) for c in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
  out = [f"\n### {title}\n", line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
  out += [line(r) for r in cells[1:]]
  return "\n".join(out)


def machine() -> dict:
  return {"platform": platform.platform(), "processor": platform.processor(),
          "cpus": os.cpu_count(), "jax": jax.__version__,
          "devices": [str(d) for d in jax.devices()]}


def write_json(name: str, payload: dict) -> pathlib.Path:
  RESULTS.mkdir(exist_ok=True)
  path = RESULTS / f"{name}.json"
  path.write_text(json.dumps({"machine": machine(), **payload}, indent=1))
  return path
