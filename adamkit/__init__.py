"""adamkit: Adam-family optimizer transforms for JAX that reproduce MindSpore and Paddle.

Every optimizer is an ``optax.GradientTransformation`` (the fused steps and the offloaded
transforms also have a one-pass ``step`` that returns the new params)::

  import adamkit as ak
  tx = ak.adam(1e-3, weight_decay=0.05)        # MindSpore nn.Adam semantics
  tx = ak.adamw(1e-3, weight_decay=0.01, weight_decay_mask=None)   # Paddle AdamW
"""

from adamkit import masks

# Gradient accumulation, dense and row-sparse.
from adamkit._accumulate import multi_steps

# Adam and AdaMax: primitives, named optimizers and their chain links.
from adamkit._adam import ScaleByAdamState, ScaleByAmsgradState, adam, scale_by_adam
from adamkit._adamax import ScaleByAdamaxState, adamax, scale_by_adamax
from adamkit._adamw import adamw

# State: save/restore, the next learning rate, framework state import.
from adamkit._checkpoint import get_lr, load_state_dict, set_lr, state_dict

# Speed and precision: the one-pass fused step, master weights, float32 hyperparameters.
from adamkit._fused import (
    FlatMoments,
    FusedAdamaxState,
    FusedAdamState,
    FusedAmsgradState,
    FusedStep,
    fused_adam,
    fused_adamax,
    fused_adamw,
)
from adamkit._groups import Group
from adamkit._interop import from_mindspore_state, from_paddle_state
from adamkit._kernels import build_cpu_kernel, cpu_kernel_available
from adamkit._links import (
    ClipGradByGlobalNorm,
    ClipGradByNorm,
    ClipGradByValue,
    L1Decay,
    L2Decay,
    ScaleByLearningRateState,
    add_decay,
    add_decoupled_decay,
    centralize_gradients,
    clip_by_norm,
    scale_by_learning_rate,
    scale_by_loss_scale,
)

# Offload: optimizer state in host memory.
from adamkit._offload import (
    OffloadedStateWarning,
    UncommittedParamsWarning,
    adam_offload,
    offload,
    offload_shardings,
    offload_state,
)
from adamkit._precision import MasterWeightsState, inject_hyperparams, master_weights

# Low-bit optimizer states: 8-bit, 4-bit and fp8 moments (mu_dtype / nu_dtype).
from adamkit._quant import Quantized, QuantizedArray

# Low-precision params without a master copy: stochastic rounding, Kahan-compensated updates.
from adamkit._rounding import (
    KahanState,
    NearestRoundingState,
    StochasticRoundingState,
    param_rounding,
    stochastic_round,
)
from adamkit._schedules import as_schedule

# Sparse Adam for embedding tables.
from adamkit._sparse import (
    ScaleBySparseAdamState,
    apply_updates,
    check_row_ids,
    fused_sparse_adam,
    fused_sparse_lazy_adam,
    scale_by_sparse_adam,
    sparse_adam,
    sparse_adamw,
)
from adamkit._sparse_grad import GatheredRows, lookup, sparse_grad, value_and_sparse_grad
from adamkit._sparse_types import RowSparse

# Planning memory for a TPU or GPU from a machine without one (deviceless compilation).
from adamkit._targets import MemoryReport, memory_report

__version__ = "0.2.0"

__all__ = [
    # Adam, AdaMax and the chain links
    "adam", "adamax", "scale_by_adam", "scale_by_adamax", "ScaleByAdamState",
    "ScaleByAdamaxState", "Group", "masks", "as_schedule", "add_decay",
    "L1Decay", "L2Decay", "ClipGradByGlobalNorm", "ClipGradByNorm", "ClipGradByValue",
    "clip_by_norm", "centralize_gradients", "scale_by_learning_rate",
    "ScaleByLearningRateState", "scale_by_loss_scale",
    # AdamW and AMSGrad
    "adamw", "add_decoupled_decay", "ScaleByAmsgradState", "fused_adamw", "FusedAmsgradState",
    "sparse_adamw",
    # state
    "get_lr", "set_lr", "state_dict", "load_state_dict", "from_mindspore_state", "from_paddle_state",
    # sparse
    "RowSparse", "lookup", "sparse_grad", "value_and_sparse_grad", "GatheredRows",
    "sparse_adam", "scale_by_sparse_adam", "ScaleBySparseAdamState", "apply_updates",
    "check_row_ids", "fused_sparse_adam", "fused_sparse_lazy_adam", "multi_steps",
    # offload
    "offload", "adam_offload", "offload_shardings", "offload_state", "UncommittedParamsWarning",
    "OffloadedStateWarning",
    # speed and precision
    "fused_adam", "fused_adamax", "FusedStep", "FusedAdamState", "FusedAdamaxState",
    "FlatMoments", "build_cpu_kernel", "cpu_kernel_available", "master_weights",
    "MasterWeightsState", "inject_hyperparams",
    # low-precision params without a master copy
    "param_rounding", "stochastic_round", "NearestRoundingState", "StochasticRoundingState",
    "KahanState",
    # low-bit optimizer states
    "Quantized", "QuantizedArray",
    # memory on a target, from a deviceless compile
    "memory_report", "MemoryReport",
]
