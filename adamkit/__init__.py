"""adamkit: Adam-family optimizer transforms for JAX that reproduce MindSpore and Paddle.

Every public optimizer is an ``optax.GradientTransformation``::

  import adamkit as ak
  tx = ak.adam(1e-3, weight_decay=0.05)        # MindSpore nn.Adam semantics
"""

from adamkit import masks
from adamkit._adam import ScaleByAdamState, adam, scale_by_adam
from adamkit._adamax import ScaleByAdamaxState, adamax, scale_by_adamax
from adamkit._groups import Group
from adamkit._links import (
    AddDecayState,
    ClipGradByGlobalNorm,
    ClipGradByNorm,
    ClipGradByValue,
    L1Decay,
    L2Decay,
    ScaleByLearningRateState,
    add_decay,
    centralize_gradients,
    clip_by_norm,
    scale_by_learning_rate,
    scale_by_loss_scale,
)
from adamkit._schedules import as_schedule

# --- checkpoint / state helpers (core) ---
from adamkit._checkpoint import get_lr, load_state_dict, state_dict
# --- sparse (issue 3) ---
from adamkit._sparse import (
    ScaleBySparseAdamState,
    apply_updates,
    check_row_ids,
    fused_sparse_adam,
    fused_sparse_lazy_adam,
    scale_by_sparse_adam,
    sparse_adam,
)
from adamkit._sparse_grad import GatheredRows, lookup, sparse_grad, value_and_sparse_grad
from adamkit._sparse_types import RowSparse
# --- offload (issue 4) ---
from adamkit._offload import adam_offload, offload, offload_shardings, offload_state
# --- speed (issue 5) ---
from adamkit._fused import (FusedAdamState, FusedStep, build_cpu_kernel,
                            cpu_kernel_available, fused_adam, fused_adamax)
from adamkit._precision import MasterWeightsState, inject_hyperparams, master_weights
# --- users (issue 6) ---
from adamkit._interop import from_mindspore_state, from_paddle_state

__version__ = "0.1.0"

__all__ = [
    # sparse (issue 3)
    "GatheredRows", "RowSparse", "ScaleBySparseAdamState", "apply_updates", "check_row_ids",
    "fused_sparse_adam", "fused_sparse_lazy_adam", "lookup", "scale_by_sparse_adam",
    "sparse_adam", "sparse_grad", "value_and_sparse_grad",
    # speed (issue 5)
    "FusedAdamState", "FusedStep", "build_cpu_kernel", "cpu_kernel_available", "fused_adam",
    "fused_adamax", "MasterWeightsState", "inject_hyperparams", "master_weights",
    "AddDecayState",
    "ClipGradByGlobalNorm",
    "ClipGradByNorm",
    "ClipGradByValue",
    "Group",
    "L1Decay",
    "L2Decay",
    "ScaleByAdamState",
    "ScaleByAdamaxState",
    "ScaleByLearningRateState",
    "adam",
    "adam_offload",
    "offload",
    "offload_shardings",
    "offload_state",
    "adamax",
    "add_decay",
    "as_schedule",
    "centralize_gradients",
    "get_lr",
    "load_state_dict",
    "state_dict",
    "clip_by_norm",
    "from_mindspore_state",
    "from_paddle_state",
    "masks",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_learning_rate",
    "scale_by_loss_scale",
]
