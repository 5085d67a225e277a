"""Weight-decay mask rules: ``ak.masks.mindspore_rule()``, ``flax_rule()``, ``ndim_rule()``,
``exclude_names(...)``, ``match_names(...)``, ``name_rule(fn)`` (Paddle's
``apply_decay_param_fun``)."""

from adamkit._masks import (
    ExcludeNames,
    MaskRule,
    MatchNames,
    MinNdim,
    NameRule,
    exclude_names,
    flax_rule,
    match_names,
    mindspore_rule,
    name_rule,
    ndim_rule,
    resolve_mask,
)

__all__ = ["ExcludeNames", "MaskRule", "MatchNames", "MinNdim", "NameRule", "exclude_names", "flax_rule",
           "match_names", "mindspore_rule", "name_rule", "ndim_rule", "resolve_mask"]
