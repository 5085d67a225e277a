"""Which leaves weight decay applies to.

A mask is given as ``None`` (every leaf), a bool pytree matching the params, a callable
``params -> bool pytree`` (optax's convention), or one of the rule objects here. A
predicate on the leaf's dotted name (Paddle's ``apply_decay_param_fun``) is wrapped in
:func:`name_rule`, so a plain callable always means ``params -> bool tree``. Rules are
deliberately *not* callable: ``optax.inject_hyperparams`` treats every callable keyword as
a schedule, so a callable default would be called with a step count.
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


@dataclasses.dataclass(frozen=True)
class NameRule(MaskRule):
  """Decay the leaves for which ``predicate(dotted_name)`` is true."""

  predicate: Callable[[str], Any]

  def keep(self, name, leaf):
    return bool(self.predicate(name))


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


def name_rule(predicate: Callable[[str], Any]) -> NameRule:
  """Decay the leaves whose dotted path satisfies ``predicate``: Paddle's
  ``apply_decay_param_fun``.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> rule = ak.masks.name_rule(lambda name: not name.endswith("bias"))
    >>> ak.masks.resolve_mask(rule, {"fc": {"weight": jnp.ones(2), "bias": jnp.ones(2)}})
    {'fc': {'bias': False, 'weight': True}}
  """
  if not callable(predicate) or isinstance(predicate, MaskRule):
    raise TypeError("`name_rule` takes a callable name -> bool (Paddle's apply_decay_param_fun), "
                    f"got {type(predicate).__name__}.")
  return NameRule(predicate)


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
    tree = spec(params)
    if isinstance(tree, (bool, np.bool_)) and not _is_single_leaf(params):
      raise TypeError(
          "`weight_decay_mask`: a callable mask takes the params and returns a bool tree "
          f"(optax's convention), but this one returned {tree!r} for the whole tree. For a "
          "predicate on each leaf's name (Paddle's apply_decay_param_fun) pass "
          "`ak.masks.name_rule(fn)`.")
    return tree
  return spec


def _is_single_leaf(params) -> bool:
  leaves = jax.tree.leaves(params)
  return len(leaves) == 1 and leaves[0] is params
