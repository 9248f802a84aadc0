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
    differently on n, n/2 and (2, n/2) devices (rows padded to 32 per device), so flat storage
    differs between the meshes."""

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


def logical_content(fsdp, state):
    """Every logical tensor of ``state`` by name (parameters and optimizer leaves in the
    parameters' own shapes, the step), as numpy arrays: gathered from every process."""
    from jax.experimental import multihost_utils

    out = {f"params/{p.name}": fsdp.to_logical(p, state.master[p.name]) for p in fsdp.trained}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        owner = fsdp.owner_of(key_path, leaf)
        name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in key_path)
        out[f"opt/{name}"] = leaf if owner is None else fsdp.to_logical(owner, leaf)
    out["step"] = state.step
    host = lambda a: np.asarray(a) if a.is_fully_addressable else multihost_utils.process_allgather(a, tiled=True)
    return {k: host(v) for k, v in out.items()}


def logical_grads(fsdp, grads):
    """A step's gradients by parameter name, in the parameters' own shapes (numpy)."""
    return {p.name: np.asarray(fsdp.to_logical(p, grads[p.name])) for p in fsdp.trained}


def per_example_terms(fsdp, state, data):
    """What each example of ``data`` adds to the loss and to every gradient of the step: one
    example at a time on ``fsdp``'s mesh (one device), scaled by ``1 / len(examples)`` (exact)."""
    x, y = data
    loss_and_grads = fsdp.loss_and_grads(loss_fn)
    losses, grads = [], []
    for i in range(len(x)):
        loss, g = loss_and_grads(state, (x[i : i + 1], y[i : i + 1]))
        losses.append(float(loss))
        grads.append(logical_grads(fsdp, g))
    m = float(len(x))
    return np.array(losses) / m, {k: np.stack([g[k] for g in grads]) / m for k in grads[0]}
