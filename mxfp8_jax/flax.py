"""Flax NNX training with MXFP8 FSDP weights.

    from mxfp8_jax import flax as mxflax

    model = MyModel(...)                         # any NNX layers; scan, vmap, remat, Python loops
    fsdp = mxflax.FSDP(model, mesh, loss_fn=loss_fn, example_batch=batch)
    print(fsdp)                                  # what each parameter became, and why
    state = fsdp.init(model, tx)
    step = fsdp.train_step(loss_fn, tx)          # loss_fn(model, batch) -> scalar
    state, loss = step(state, batch)
    model = fsdp.gather(state)

``FSDP(..., trainable=nnx.LoRAParam)`` trains only the variables that filter names (as
``nnx.Optimizer(wrt=)``); the others are frozen: gathered, never updated, no gradient.
``FSDP(..., gemm="mxfp8")`` runs the MXFP8 units' GEMMs in MXFP8 too (``gemm_paths()``: the
path each platform takes); ``gemm_operand`` hands an activation that is MXFP8 already (an
RMSNorm + quantize's planes) to those GEMMs as it is.

See ``mxfp8_jax._src.fsdp.flax_fsdp`` for what a step does and communicates, ``fsdp_plan`` for
what each parameter becomes, and ``fsdp_unit`` for one unit's gathers.
"""

from mxfp8_jax._src.core.jaxprs import TESTED_JAX, UnsupportedJax, UntestedJaxWarning
from mxfp8_jax._src.fsdp.flax_fsdp import FSDP
from mxfp8_jax._src.fsdp.flax_layers import Kernel, Linear, tensor_parallel
from mxfp8_jax._src.fsdp.fsdp_geometry import PRECISIONS, UnitGeometry
from mxfp8_jax._src.fsdp.fsdp_plan import KINDS, ROLES, ParamInfo
from mxfp8_jax._src.fsdp.fsdp_planes import UnitPlanes
from mxfp8_jax._src.fsdp.fsdp_specs import MODEL_CONSTRAINTS, Constraint, ModelConstraintWarning
from mxfp8_jax._src.fsdp.fsdp_state import TrainState
from mxfp8_jax._src.ops.mxfp8_gemm import GEMM_PATHS, GEMMS, gemm_operand, gemm_paths

__all__ = [
    "FSDP",
    "GEMMS",
    "GEMM_PATHS",
    "KINDS",
    "MODEL_CONSTRAINTS",
    "PRECISIONS",
    "ROLES",
    "TESTED_JAX",
    "Constraint",
    "Kernel",
    "Linear",
    "ModelConstraintWarning",
    "ParamInfo",
    "TrainState",
    "UnitGeometry",
    "UnitPlanes",
    "UnsupportedJax",
    "UntestedJaxWarning",
    "gemm_operand",
    "gemm_paths",
    "tensor_parallel",
]
