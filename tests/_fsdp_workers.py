"""What each process of the two-process FSDP test runs (tests/multiproc.py): the model's
parameters made as arrays sharded over BOTH processes' devices (neither holds them whole),
``FSDP.init`` from them with host transfers disallowed, the first step's gradients, 10 steps,
checkpoints of the initial and the final state, and a resume of the final one here."""

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

    from fsdp_model import TX, batch, logical_content, loss_fn, make_net

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    model = make_net()
    graphdef, params = nnx.split(model, nnx.Param)

    def sharded(a):
        host = np.asarray(a)
        split = host.ndim and host.shape[-1] % mesh.size == 0
        spec = PartitionSpec(*(None,) * (host.ndim - 1), "fsdp") if split else None
        sharding = NamedSharding(mesh, spec if spec is not None else PartitionSpec())
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    params = jax.tree.map(sharded, params)
    fsdp = FSDP(nnx.merge(graphdef, params), mesh)
    with jax.transfer_guard("disallow"):
        state = fsdp.init(nnx.merge(graphdef, params), TX)
    fsdp.save(state, os.path.join(directory, "init"))

    from jax.experimental import multihost_utils

    first_loss, grads = fsdp.loss_and_grads(loss_fn)(state, batch(0))
    gathered = {
        p.name: multihost_utils.process_allgather(fsdp.to_logical(p, grads[p.name]), tiled=True) for p in fsdp.trained
    }
    step = fsdp.train_step(loss_fn, TX)
    losses = []
    for i in range(STEPS):
        state, loss = step(state, batch(i))
        losses.append(float(np.asarray(loss.addressable_data(0))))
    fsdp.save(state, os.path.join(directory, "final"))
    content = logical_content(fsdp, state)
    # The same layout resumes exactly: the checkpoint's next step against the uninterrupted one.
    resumed = fsdp.restore(os.path.join(directory, "final"), TX)
    resumed, resumed_loss = step(resumed, batch(STEPS))
    state, next_loss = step(state, batch(STEPS))
    if jax.process_index() == 0:
        np.savez(os.path.join(directory, "first_grads.npz"), **gathered)
        np.savez(os.path.join(directory, "final_content.npz"), **content)
    return dict(
        process=jax.process_index(),
        devices=jax.device_count(),
        params_fully_addressable=[leaf.is_fully_addressable for leaf in jax.tree.leaves(params)],
        first_loss=float(np.asarray(first_loss.addressable_data(0))),
        losses=losses,
        next_loss=float(np.asarray(next_loss.addressable_data(0))),
        resumed_loss=float(np.asarray(resumed_loss.addressable_data(0))),
    )
