"""The small scanned model of the FSDP checkpoint tests, shared with their multi-process
workers (which must not import conftest)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

D, H, CLASSES, BATCH = 64, 96, 8, 32


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, H, rngs=rngs)
        self.down = nnx.Linear(H, D, rngs=rngs)


class Net(nnx.Module):
    """Two blocks stacked by vmap (run by scan), a plain head and norm; unit rows 96 and 64 pad
    differently on 8, 4 and 2x4 devices, so flat storage differs between the meshes."""

    def __init__(self, rngs, names=("blocks", "head")):
        self.names = names
        make = nnx.split_rngs(splits=2)(nnx.vmap(lambda r: Block(r), in_axes=(0,)))
        setattr(self, names[0], make(rngs))
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        setattr(self, names[1], nnx.Linear(D, CLASSES, rngs=rngs))

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, blk):
            return h + blk.down(jax.nn.gelu(blk.up(h)))

        h = body(x, getattr(self, self.names[0]))
        return getattr(self, self.names[1])(self.norm(h))


def make_net(seed=0, **kw):
    model = Net(nnx.Rngs(seed), **kw)
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        var.set_value(jnp.asarray(rng.standard_normal(var.get_value().shape) * 0.2, jnp.float32))
    return model


def loss_fn(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def batch(i):
    rng = np.random.default_rng(100 + i)
    return rng.standard_normal((BATCH, D)).astype(np.float32), rng.integers(0, CLASSES, BATCH).astype(np.int32)


TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
