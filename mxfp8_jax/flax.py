"""Flax NNX training with MXFP8 FSDP weights.

    from mxfp8_jax import flax as mxflax

    model = MyModel(...)                         # uses mxflax.Linear for its dense layers
    fsdp = mxflax.FSDP(model, mesh)              # eligible kernels -> MXFP8 master shards
    state = fsdp.init(model, tx)
    step = fsdp.train_step(loss_fn, tx)          # loss_fn(model, batch) -> scalar
    state, loss = step(state, batch)
    model = fsdp.gather(state)

See ``mxfp8_jax._src.flax_fsdp`` for what a step does and communicates.
"""

from mxfp8_jax._src.flax_fsdp import (
    FSDP,
    PRECISIONS,
    GatheredKernel,
    Kernel,
    Linear,
    ParamInfo,
    TrainState,
)

__all__ = ["FSDP", "PRECISIONS", "GatheredKernel", "Kernel", "Linear", "ParamInfo", "TrainState"]
