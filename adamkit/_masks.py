"""Which leaves weight decay applies to.

A mask is given as ``None`` (every leaf), a bool pytree matching the params, a callable
``params -> bool pytree``, or one of the rule objects here. Rules are deliberately *not*
callable: ``optax.inject_hyperparams`` treats every callable keyword as a schedule, so a
callable default would be called with a step count.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from typing import Any, Union

import jax
import numpy as np

from adamkit._validate import path_name


@dataclasses.dataclass(frozen=True)
class MaskRule:
  """Base class of adamkit's mask rules; ``rule.mask(params)`` gives the bool tree."""

  def mask(self, params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda p, x: self.keep(path_name(p), x), params)

  def keep(self, name: str, leaf: Any) -> bool:  # pragma: no cover - abstract
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ExcludeNames(MaskRule):
  """Decay every leaf whose dotted path contains none of ``substrings``.

  ``ExcludeNames(("beta", "gamma"))`` is MindSpore's default rule: a parameter is decayed
  unless ``'beta'`` or ``'gamma'`` occurs in its name.
  """

  substrings: tuple[str, ...] = ("beta", "gamma")

  def keep(self, name, leaf):
    return not any(s in name for s in self.substrings)


@dataclasses.dataclass(frozen=True)
class MatchNames(MaskRule):
  """Decay exactly the leaves whose dotted path matches one of the glob ``patterns``."""

  patterns: tuple[str, ...] = ()

  def keep(self, name, leaf):
    return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


@dataclasses.dataclass(frozen=True)
class MinNdim(MaskRule):
  """Decay leaves with at least ``ndim`` dimensions (weights, not biases or norms)."""

  ndim: int = 2

  def keep(self, name, leaf):
    return np.ndim(leaf) >= self.ndim


def mindspore_rule() -> ExcludeNames:
  """MindSpore's default: skip every leaf whose name contains 'beta' or 'gamma'."""
  return ExcludeNames(("beta", "gamma"))


def flax_rule() -> MaskRule:
  """Flax naming: skip LayerNorm/BatchNorm ``scale`` and every ``bias``."""
  return ExcludeNames(("scale", "bias"))


def ndim_rule(ndim: int = 2) -> MinNdim:
  """Decay only leaves with ``ndim >= 2`` (matrices and kernels)."""
  return MinNdim(ndim)


def exclude_names(*substrings: str) -> ExcludeNames:
  """Skip the leaves whose dotted path contains any of ``substrings``."""
  return ExcludeNames(tuple(substrings))


def match_names(*patterns: str) -> MatchNames:
  """Decay only the leaves whose dotted path matches a glob pattern, e.g. ``'*.weight'``."""
  return MatchNames(tuple(patterns))


# The default of every named optimizer: MindSpore's rule.
MINDSPORE_DEFAULT = ExcludeNames(("beta", "gamma"))

MaskSpec = Union[None, MaskRule, Callable[[Any], Any], Any]


def resolve_mask(spec: MaskSpec, params: Any) -> Any:
  """The bool pytree of a mask spec for ``params`` (``None`` means every leaf)."""
  if spec is None:
    return jax.tree.map(lambda _: True, params)
  if isinstance(spec, MaskRule):
    return spec.mask(params)
  if callable(spec):
    return spec(params)
  return spec
