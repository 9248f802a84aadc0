"""Flax NNX training with MXFP8 FSDP weights.

    from mxfp8_jax import flax as mxflax

    model = MyModel(...)                         # any NNX layers; scan, vmap, remat, Python loops
    fsdp = mxflax.FSDP(model, mesh, loss_fn=loss_fn, example_batch=batch)
    print(fsdp)                                  # what each parameter became, and why
    state = fsdp.init(model, tx)
    step = fsdp.train_step(loss_fn, tx)          # loss_fn(model, batch) -> scalar
    state, loss = step(state, batch)
    model = fsdp.gather(state)

See ``mxfp8_jax._src.flax_fsdp`` for what a step does and communicates, ``fsdp_plan`` for
what each parameter becomes, and ``fsdp_unit`` for one unit's gathers.
"""

from mxfp8_jax._src.flax_fsdp import FSDP, TrainState, UnitPlanes
from mxfp8_jax._src.flax_layers import Kernel, Linear, tensor_parallel
from mxfp8_jax._src.fsdp_plan import KINDS, ROLES, ParamInfo
from mxfp8_jax._src.fsdp_unit import PRECISIONS, UnitGeometry

__all__ = [
    "FSDP",
    "KINDS",
    "PRECISIONS",
    "ROLES",
    "Kernel",
    "Linear",
    "ParamInfo",
    "TrainState",
    "UnitGeometry",
    "UnitPlanes",
    "tensor_parallel",
]
