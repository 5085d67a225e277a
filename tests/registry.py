"""The one registry of adamkit optimizers that the shared suites run through every idiom.

A new optimizer or option joins ``REGISTRY`` (name -> factory(learning_rate) returning an
``optax.GradientTransformation``); every suite that takes the registry then covers it.
``SPARSE`` names the entries that also take :class:`adamkit.RowSparse` gradients; the
other sets name documented limits (no learning-rate record, flat multi-tensor moments) that
the suites check instead of skipping. The (sparse gradient, optax transform) pairs that
raise a documented error instead of working are ``REFUSED`` in ``tests/test_composition.py``.

The fused steps (``ak.fused_adam``, ``ak.fused_adamax``) are ``GradientTransformation``s
too (their ``update``; ``step`` is tested in ``tests/test_fused.py``): multi-tensor (the
default) and per leaf, and under ``ak.master_weights``.
"""

import adamkit as ak

# Quantized moment formats small enough for the suites' leaves (see the issue-19 entries).
Q8 = ak.Quantized("8bit", block_size=64, min_size=0)
Q4 = ak.Quantized("4bit", block_size=64, min_size=0)
QF = ak.Quantized("fp8", block_size=64, min_size=0)
Q8_ROWS = ak.Quantized("8bit", block_size=2, min_size=0)  # divides the sparse suites' rows
# torchao's rule: a leaf whose size is no multiple of the block keeps float32 moments (the
# suites' 72- and 32-element leaves are quantized, the 4-element ones not: a mixed state)
Q8_UNPADDED = ak.Quantized("8bit", block_size=8, min_size=0, pad=False)

# name -> factory(learning_rate) of every optimizer the shared properties must hold for.
# Each entry runs through some 25 idioms (a quantized one costs about a minute of CI), so an
# entry earns its place by a code path or option no other entry takes. Options ride on a
# shared entry where they change no path of their own: eps_mode="corrected", nesterov and
# L2 decay on adam_amsgrad_corrected; ak.adam_offload(...) is ak.offload(ak.adam(...),
# "compute"); plain Adam's 8-bit and 4-bit moments take adamw_8bit's, adam_8bit_full's and
# master_weights_adamw_4bit's paths; sparse AdamW's 8-bit moments sparse_adam_8bit's; the
# quantized state offload is adam_offload_8bit's (2026-12-01: nine such entries left).
REGISTRY = {
    "adam": lambda lr: ak.adam(lr),
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
    "adam_amsgrad_corrected": lambda lr: ak.adam(lr, eps_mode="corrected", amsgrad=True,
                                                 nesterov=True, weight_decay=0.01),
    "sparse_adam": lambda lr: ak.sparse_adam(lr),
    "sparse_adam_dense_rows": lambda lr: ak.sparse_adam(lr, lazy=False),
    "sparse_adam_full": lambda lr: ak.sparse_adam(
        lr, weight_decay=0.01, loss_scale=4.0, grad_clip=ak.ClipGradByGlobalNorm(1.0),
        groups=[ak.Group("bn.*", lr=0.001)], nonfinite="skip"),
    "adam_offload": lambda lr: ak.adam_offload(lr),
    "offload_adam_state": lambda lr: ak.offload(ak.adam(lr), mode="state"),
    "offload_adamax_state": lambda lr: ak.offload(ak.adamax(lr), mode="state"),
    "offload_sparse_adam_state": lambda lr: ak.offload(ak.sparse_adam(lr), mode="state"),
    "master_weights_adamax": lambda lr: ak.master_weights(ak.adamax(lr)),
    "master_weights_sparse_adam": lambda lr: ak.master_weights(ak.sparse_adam(lr)),
    "offload_adamw_amsgrad_state": lambda lr: ak.offload(ak.adamw(lr, amsgrad=True), mode="state"),
    "master_weights_adamw": lambda lr: ak.master_weights(ak.adamw(lr)),
    # issue 13: lazy AMSGrad and lazy AdamW (dense leaves here; row-sparse in test_sparse.py)
    "sparse_adam_amsgrad": lambda lr: ak.sparse_adam(lr, amsgrad=True, weight_decay=0.01),
    "sparse_adamw": lambda lr: ak.sparse_adamw(lr),
    "sparse_adamw_amsgrad_mindspore": lambda lr: ak.sparse_adamw(
        lr, weight_decay=0.05, amsgrad=True, bias_correction=False, eps_mode="hat"),
    # issue 11 item 4: the fused steps' optax form
    "fused_adam": lambda lr: ak.fused_adam(lr),
    "fused_adam_per_leaf": lambda lr: ak.fused_adam(lr, eps_mode="corrected", weight_decay=0.01,
                                                    multi_tensor=False),
    "fused_adamax": lambda lr: ak.fused_adamax(lr, weight_decay=0.01),
    "master_weights_fused_adam": lambda lr: ak.master_weights(ak.fused_adam(lr)),
    # issue 13 x issue 11: AdamW and AMSGrad in the fused step, optax form
    "fused_adamw": lambda lr: ak.fused_adamw(lr),
    "fused_adam_amsgrad_per_leaf": lambda lr: ak.fused_adam(lr, amsgrad=True, weight_decay=0.01,
                                                            multi_tensor=False),
    "fused_adamw_amsgrad": lambda lr: ak.fused_adamw(lr, amsgrad=True),
    # issue 11 verification: the fused steps offloaded, in both modes
    "offload_fused_adam_state": lambda lr: ak.offload(ak.fused_adam(lr), mode="state"),
    "offload_fused_adamax_compute": lambda lr: ak.offload(
        ak.fused_adamax(lr, multi_tensor=False), mode="compute"),
    # issue 20: bf16 params without a master copy (float32 leaves pass straight through;
    # tests/test_rounding.py runs them on bf16 and fp16 params)
    "adamw_bf16_kahan": lambda lr: ak.param_rounding(ak.adamw(lr, weight_decay=0.01), "kahan"),
    "adam_bf16_stochastic": lambda lr: ak.param_rounding(ak.adam(lr, weight_decay=0.01),
                                                         "stochastic", seed=7),
    # issue 19: quantized moments of row-sparse tables (blocks within rows)
    "sparse_adam_8bit": lambda lr: ak.sparse_adam(lr, mu_dtype=Q8, nu_dtype=Q8),
    "sparse_adam_4bit_full": lambda lr: ak.sparse_adam(
        lr, weight_decay=0.01, amsgrad=True, mu_dtype=Q4, nu_dtype=Q4, nonfinite="skip"),
    "offload_sparse_adam_8bit_state": lambda lr: ak.offload(
        ak.sparse_adam(lr, mu_dtype=Q8, nu_dtype=Q8), mode="state"),
    # issue 19: the fused step with 8-bit moments (min_size=0: the suites' small leaves are
    # quantized too), multi-tensor (flat code buffers)
    "fused_adamw_8bit": lambda lr: ak.fused_adamw(
        lr, mu_dtype=ak.Quantized("8bit", min_size=0), nu_dtype=ak.Quantized("8bit", min_size=0)),
    # and its lazy row step on a table with quantized moments: the sparse suites' tables
    # have rows of 2 elements, so blocks of 2 (each row whole blocks of the flat buffer;
    # blocks of 256 span rows, and fused_adamw_8bit refuses a RowSparse with a ValueError)
    "fused_adamw_8bit_rows": lambda lr: ak.fused_adamw(lr, mu_dtype=Q8_ROWS, nu_dtype=Q8_ROWS),
    # issue 19: quantized moments. The suites' leaves are small (72 elements at most), so
    # min_size=0 and blocks of 64 put every leaf through the quantized step (padded blocks).
    "adamw_8bit": lambda lr: ak.adamw(lr, mu_dtype=Q8, nu_dtype=Q8),
    "adamw_8bit_unpadded": lambda lr: ak.adamw(lr, mu_dtype=Q8_UNPADDED, nu_dtype=Q8_UNPADDED),
    "adamw_4bit_amsgrad": lambda lr: ak.adamw(lr, amsgrad=True, mu_dtype=Q4, nu_dtype=Q4),
    "adamw_fp8": lambda lr: ak.adamw(lr, mu_dtype=QF, nu_dtype=QF),
    "adamax_8bit": lambda lr: ak.adamax(lr, weight_decay=0.01, mu_dtype=Q8, nu_dtype=Q8),
    "adam_8bit_full": lambda lr: ak.adam(
        lr, weight_decay=0.01, loss_scale=8.0, grad_clip=ak.ClipGradByGlobalNorm(1.0),
        groups=[ak.Group("conv.*", lr_scale=2.0, grad_centralization=True)],
        mu_dtype=Q8, nu_dtype=Q4),
    # ak.adam_offload with a quantized format defaults to mode="state"
    "adam_offload_8bit": lambda lr: ak.adam_offload(lr, mu_dtype=Q8, nu_dtype=Q8),
    "master_weights_adamw_4bit": lambda lr: ak.master_weights(ak.adamw(lr, mu_dtype=Q4,
                                                                        nu_dtype=Q4)),
    # issue 20: the fused step's param_rounding (its optax form is ak.param_rounding's; the
    # one-pass step is tested in tests/test_fused_rounding.py)
    "fused_adamw_bf16_kahan": lambda lr: ak.fused_adamw(lr, param_rounding="kahan"),
}

NAMES = sorted(REGISTRY)

# The quantized entries: their moments are ak.QuantizedArray (codes and scales), shaped by
# blocks rather than like the params (the suite's (4, 2, 3, 3) leaf is padded to blocks).
QUANTIZED = tuple(n for n in NAMES if any(k in n for k in ("8bit", "4bit", "fp8")))

# Documented limits of the fused steps' optax form (docs/optimizers/fused.md):
# - their state keeps no learning-rate record: ak.get_lr raises a ValueError naming the
#   missing "learning-rate link" (the rate is the schedule's at `count`);
NO_LR_RECORD = ("fused_adam", "fused_adam_per_leaf", "fused_adamax", "master_weights_fused_adam",
                "fused_adamw", "fused_adam_amsgrad_per_leaf", "fused_adamw_amsgrad",
                "offload_fused_adam_state", "offload_fused_adamax_compute", "fused_adamw_8bit",
                "fused_adamw_bf16_kahan", "fused_adamw_8bit_rows")
# - multi-tensor moments are flat buffers (one per dtype), which cannot take a param's
#   sharding: the params keep theirs, the buffers are laid out by XLA.
FLAT_STATE = ("fused_adam", "fused_adamax", "master_weights_fused_adam", "fused_adamw",
              "fused_adamw_amsgrad", "offload_fused_adam_state", "fused_adamw_8bit",
              "fused_adamw_bf16_kahan", "fused_adamw_8bit_rows")

# The entries that take RowSparse gradients (the others refuse them with a TypeError).
SPARSE = ("sparse_adam", "sparse_adam_dense_rows", "sparse_adam_full", "offload_sparse_adam_state",
          "master_weights_sparse_adam", "sparse_adam_amsgrad", "sparse_adamw",
          "sparse_adamw_amsgrad_mindspore", "fused_adam", "fused_adam_per_leaf",
          "master_weights_fused_adam", "fused_adamw", "fused_adam_amsgrad_per_leaf",
          "fused_adamw_amsgrad", "offload_fused_adam_state", "sparse_adam_8bit",
          "sparse_adam_4bit_full", "offload_sparse_adam_8bit_state",
          "fused_adamw_bf16_kahan", "fused_adamw_8bit_rows")

# Their gradient accumulation: optax.MultiSteps cannot take a RowSparse (its accumulator is
# zeros_like(params)); ak.multi_steps keeps k * n ids and rows per table instead. The same
# wrapper for every entry, the offloaded one included (ak.multi_steps goes outside ak.offload).
SPARSE_MULTISTEPS = {
    name: (lambda f: lambda lr, k, ids_per_step: ak.multi_steps(
        f(lr), k, ids_per_step=ids_per_step))(REGISTRY[name])
    for name in SPARSE
}

# The offloaded entries' inner optimizer and offload mode, so that the suites wrap an
# accumulator (optax.MultiSteps) inside the offload as well as around it.
OFFLOADED = {
    "adam_offload": (ak.adam, "compute"),
    "offload_adam_state": (ak.adam, "state"),
    "offload_adamax_state": (ak.adamax, "state"),
    "offload_sparse_adam_state": (ak.sparse_adam, "state"),
    "offload_adamw_amsgrad_state": (lambda lr: ak.adamw(lr, amsgrad=True), "state"),
    "offload_fused_adam_state": (ak.fused_adam, "state"),
    "offload_fused_adamax_compute": (lambda lr: ak.fused_adamax(lr, multi_tensor=False),
                                     "compute"),
    "offload_sparse_adam_8bit_state": (lambda lr: ak.sparse_adam(lr, mu_dtype=Q8, nu_dtype=Q8),
                                       "state"),
    "adam_offload_8bit": (lambda lr: ak.adam(lr, mu_dtype=Q8, nu_dtype=Q8), "state"),
}
