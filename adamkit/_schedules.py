"""Learning-rate (and weight-decay) forms, turned into one schedule type.

MindSpore and Paddle accept a learning rate as a number, a 0-d tensor, a 1-D tensor or a
Python iterable (step ``i`` uses element ``i``), or a schedule object. adamkit accepts
the same forms and turns each into a jit-friendly callable ``count -> float32 scalar``.
"""

from __future__ import annotations

import collections.abc
import numbers
from collections.abc import Callable
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

from adamkit import _validate
from adamkit._tree import is_tracer

ScalarOrSchedule = Union[float, int, jax.Array, np.ndarray, collections.abc.Iterable,
                         Callable[[jax.Array], jax.Array]]


class _PiecewiseArray:
  """Step ``i`` takes ``values[i]``; steps past the end keep the last value."""

  def __init__(self, values: jax.Array):
    self.values = values

  def __call__(self, count):
    last = self.values.shape[0] - 1
    idx = jnp.clip(jnp.asarray(count, jnp.int32), 0, last)
    return self.values[idx]

  def __repr__(self):
    return f"PiecewiseArray(len={self.values.shape[0]})"


class _Constant:
  def __init__(self, value):
    self.value = value

  def __call__(self, count):
    del count
    return jnp.asarray(self.value, jnp.float32)

  def __repr__(self):
    return f"Constant({self.value!r})"


def as_schedule(value: ScalarOrSchedule, name: str = "learning_rate") -> Callable:
  """Turns any accepted learning-rate form into ``count -> float32 scalar``.

  Args:
    value: a number ``>= 0``; a 0-d array (constant); a 1-D array or any Python iterable
      of numbers (step ``i`` uses element ``i``, later steps keep the last element); or a
      callable ``count -> value`` (every optax schedule is one).
    name: the argument's name, used in error messages.

  Returns:
    A callable mapping the 0-based step count to a float32 scalar.

  Raises:
    TypeError: for strings, booleans, ``None`` or non-numeric arrays.
    ValueError: for negative values, empty sequences or arrays of 2 or more dimensions.
  """
  if callable(value) and not isinstance(value, (jax.Array, np.ndarray)):
    return value
  if isinstance(value, (bool, np.bool_)) or value is None or isinstance(value, (str, bytes)):
    raise TypeError(
        f"`{name}` must be a number, a 0-d or 1-D array, an iterable of numbers or a "
        f"schedule (callable step -> value); got {value!r}.")
  if isinstance(value, numbers.Real):
    _validate.check_non_negative(name, value)
    return _Constant(float(value))
  if isinstance(value, (jax.Array, np.ndarray)):
    arr = value
  elif isinstance(value, collections.abc.Iterable):
    items = list(value)
    for i, item in enumerate(items):
      if isinstance(item, bool) or not isinstance(item, (numbers.Real, np.generic,
                                                         np.ndarray, jax.Array)):
        raise TypeError(f"`{name}` element {i} must be a number, got {item!r}.")
    arr = np.asarray(items, dtype=np.float32)
  else:
    raise TypeError(
        f"`{name}` must be a number, a 0-d or 1-D array, an iterable of numbers or a "
        f"schedule (callable step -> value); got {type(value).__name__}.")
  if arr.ndim > 1:
    raise ValueError(f"`{name}` as an array must be 0-d or 1-D, got shape {arr.shape}.")
  if not jnp.issubdtype(arr.dtype, jnp.floating) and not jnp.issubdtype(arr.dtype, jnp.integer):
    raise TypeError(f"`{name}` array must hold real numbers, got dtype {arr.dtype}.")
  if arr.ndim == 1 and arr.shape[0] == 0:
    raise ValueError(f"`{name}` must not be empty.")
  if not is_tracer(arr):
    host = np.asarray(arr, dtype=np.float64)
    if not np.all(np.isfinite(host)) or np.any(host < 0):
      bad = host[~(np.isfinite(host) & (host >= 0))].ravel()[0]
      raise ValueError(f"`{name}` values must be finite and >= 0, got {bad}.")
  if arr.ndim == 0:
    return _Constant(jnp.asarray(arr, jnp.float32) if isinstance(arr, jax.Array)
                     else float(arr))
  return _PiecewiseArray(jnp.asarray(arr, jnp.float32))


def scalar_or_schedule(value, count):
  """Evaluates a number or schedule at ``count`` as a float32 scalar."""
  if callable(value):
    return jnp.asarray(value(count), jnp.float32)
  return jnp.asarray(value, jnp.float32)
