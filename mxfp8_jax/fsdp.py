"""MXFP8 FSDP for any JAX model: a Flax NNX module, an Equinox module, or a pytree of arrays.

    from mxfp8_jax import fsdp as mxfsdp

    params = {"embed": ..., "blocks": {"up": ..., "down": ...}, "head": ...}   # or an eqx.Module
    fsdp = mxfsdp.FSDP(params, mesh, loss_fn=loss_fn, example_batch=batch)    # loss_fn(params, batch)
    print(fsdp)                                  # what each leaf became, and why
    state = fsdp.init(params, tx)
    step = fsdp.train_step(loss_fn, tx)          # jitted; donates the state
    state, loss = step(state, batch)
    params = fsdp.gather(state)                  # the same pytree, arrays whole

One class for every kind of model (``mxfp8_jax.flax.FSDP`` is the same class): the plan traces
``loss_fn(model, example_batch)`` and follows each parameter to the op that reads it. A pytree
model's parameters are its floating array leaves, named by their key paths
(``blocks/up/weight``); its other array leaves (integer counters, RNG keys) are its other state,
kept as they are; every other leaf (an Equinox module's functions and Python numbers) is static.
``trainable=lambda path, leaf: ...`` freezes the leaves it rejects. docs/pytrees.md has more.
"""

from mxfp8_jax._src.core.jaxprs import TESTED_JAX, UnsupportedJax, UntestedJaxWarning
from mxfp8_jax._src.fsdp.flax_fsdp import FSDP
from mxfp8_jax._src.fsdp.fsdp_geometry import PRECISIONS, UnitGeometry
from mxfp8_jax._src.fsdp.fsdp_plan import KINDS, ROLES, ParamInfo
from mxfp8_jax._src.fsdp.fsdp_planes import UnitPlanes
from mxfp8_jax._src.fsdp.fsdp_specs import MODEL_CONSTRAINTS, Constraint, ModelConstraintWarning
from mxfp8_jax._src.fsdp.fsdp_state import TrainState

__all__ = [
    "FSDP",
    "KINDS",
    "MODEL_CONSTRAINTS",
    "PRECISIONS",
    "ROLES",
    "TESTED_JAX",
    "Constraint",
    "ModelConstraintWarning",
    "ParamInfo",
    "TrainState",
    "UnitGeometry",
    "UnitPlanes",
    "UnsupportedJax",
    "UntestedJaxWarning",
]
