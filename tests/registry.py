"""The one registry of adamkit optimizers that the shared suites run through every idiom.

A new optimizer or option joins ``REGISTRY`` (name -> factory(learning_rate) returning an
``optax.GradientTransformation``); every suite that takes the registry then covers it.
"""

import optax

import adamkit as ak

# name -> factory(learning_rate) of every optimizer the shared properties must hold for.
REGISTRY = {
    "adam": lambda lr: ak.adam(lr),
    "adam_corrected": lambda lr: ak.adam(lr, eps_mode="corrected"),
    "adam_nesterov_wd": lambda lr: ak.adam(lr, nesterov=True, weight_decay=0.01),
    "adam_full": lambda lr: ak.adam(
        lr, weight_decay=0.01, loss_scale=8.0, grad_clip=ak.ClipGradByGlobalNorm(1.0),
        groups=[ak.Group("conv.*", lr_scale=2.0, grad_centralization=True)]),
    "adamax": lambda lr: ak.adamax(lr),
    "adamax_wd_groups": lambda lr: ak.adamax(
        lr, weight_decay=0.01, groups=[{"params": "bn.*", "lr": 0.001}]),
    # issue 13: decoupled decay and AMSGrad
    "adamw": lambda lr: ak.adamw(lr),
    "adamw_mindspore": lambda lr: ak.adamw(lr, eps=1e-6, weight_decay=0.05,
                                           bias_correction=False, eps_mode="hat"),
    "adamw_paddle": lambda lr: ak.adamw(
        lr, weight_decay=0.05, eps_mode="corrected", weight_decay_mask=None,
        groups=[{"params": "conv.*", "learning_rate": 2.0, "weight_decay": 0.1}]),
    "adamw_amsgrad_full": lambda lr: ak.adamw(
        lr, weight_decay=0.01, amsgrad=True, loss_scale=8.0, grad_clip=ak.ClipGradByGlobalNorm(1.0),
        weight_decay_mask=ak.masks.name_rule(lambda n: not n.startswith("bn"))),
    "adam_amsgrad": lambda lr: ak.adam(lr, amsgrad=True, weight_decay=0.01),
    "adam_amsgrad_corrected": lambda lr: ak.adam(lr, eps_mode="corrected", amsgrad=True,
                                                 nesterov=True),
    # issue 13: lazy AMSGrad and lazy AdamW (dense leaves here; row-sparse in test_sparse.py)
    "sparse_adam_amsgrad": lambda lr: ak.sparse_adam(lr, amsgrad=True, weight_decay=0.01),
    "sparse_adamw": lambda lr: ak.sparse_adamw(lr),
    "sparse_adamw_amsgrad_mindspore": lambda lr: ak.sparse_adamw(
        lr, weight_decay=0.05, amsgrad=True, bias_correction=False, eps_mode="hat"),
}
for _name in ("sparse_adam", "adam_offload"):  # written alongside; joined when present
  if hasattr(ak, _name):
    REGISTRY[_name] = (lambda f: lambda lr: f(lr))(getattr(ak, _name))

NAMES = sorted(REGISTRY)

# MultiSteps' lax.cond cannot mix host-resident and device scalars, so an offloaded
# optimizer is accumulated the other way round: the offload wraps MultiSteps (documented
# in ak.offload).
MULTISTEPS = {}
if hasattr(ak, "adam_offload"):
  MULTISTEPS["adam_offload"] = lambda lr: ak.offload(
      optax.MultiSteps(ak.adam(lr), every_k_schedule=2).gradient_transformation(), mode="state")
