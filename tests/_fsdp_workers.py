"""What each process of the two-process FSDP test runs (tests/multiproc.py): the model's
parameters made as arrays sharded over BOTH processes' devices (neither holds them whole),
``FSDP.init`` from them with host transfers disallowed, 10 steps, a checkpoint."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 10


def train_and_save(directory: str) -> dict:
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mxfp8_jax.flax import FSDP

    from fsdp_model import TX, batch, loss_fn, make_net

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    model = make_net()
    graphdef, params = nnx.split(model, nnx.Param)

    def sharded(a):
        host = np.asarray(a)
        spec = PartitionSpec(*(None,) * (host.ndim - 1), "fsdp") if host.ndim and host.shape[-1] % 8 == 0 else None
        sharding = NamedSharding(mesh, spec if spec is not None else PartitionSpec())
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    params = jax.tree.map(sharded, params)
    fsdp = FSDP(nnx.merge(graphdef, params), mesh)
    with jax.transfer_guard("disallow"):
        state = fsdp.init(nnx.merge(graphdef, params), TX)
    step = fsdp.train_step(loss_fn, TX)
    losses = []
    for i in range(STEPS):
        state, loss = step(state, batch(i))
        losses.append(float(np.asarray(loss.addressable_data(0))))
    fsdp.save(state, directory)
    return dict(
        process=jax.process_index(),
        devices=jax.device_count(),
        params_fully_addressable=[leaf.is_fully_addressable for leaf in jax.tree.leaves(params)],
        losses=losses,
    )
