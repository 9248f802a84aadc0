"""Flax NNX training with MXFP8 FSDP weights.

    from mxfp8_jax import flax as mxflax

    model = MyModel(...)                         # flax.nnx.Linear layers; scan, vmap, remat welcome
    fsdp = mxflax.FSDP(model, mesh)              # eligible kernels -> MXFP8 units, sharded
    state = fsdp.init(model, tx)
    step = fsdp.train_step(loss_fn, tx)          # loss_fn(model, batch) -> scalar
    state, loss = step(state, batch)
    model = fsdp.gather(state)

See ``mxfp8_jax._src.flax_fsdp`` for what a step does and communicates, and
``mxfp8_jax._src.fsdp_unit`` for one unit's gathers.
"""

from mxfp8_jax._src.flax_fsdp import FSDP, ParamInfo, TrainState, UnitPlanes
from mxfp8_jax._src.flax_layers import Kernel, Linear, tensor_parallel
from mxfp8_jax._src.fsdp_unit import PRECISIONS, ShardedKernel, UnitGeometry, unit_matmul

__all__ = [
    "FSDP",
    "PRECISIONS",
    "Kernel",
    "Linear",
    "ParamInfo",
    "ShardedKernel",
    "TrainState",
    "UnitGeometry",
    "UnitPlanes",
    "tensor_parallel",
    "unit_matmul",
]
