"""FSDP training state <-> a logical checkpoint: every tensor by its model path, in its own shape.

Stored under these names (``mxfp8_jax._src.buffers.checkpoint`` writes them shard by shard):

    params/<parameter path>          every trained parameter (a unit as the parameter, padding dropped)
    frozen/<parameter path>          the parameters not trained, in their own dtype (a frozen unit
                                     as the parameter, padding dropped)
    rest/<variable path>             the model's other state (RNG streams: keys as their key data)
    opt/<optimizer path>             optimizer leaves; one that belongs to a parameter in its shape
    step

and the metadata: the global precision, the scale rule and the precision each trained parameter
was resolved to (``"mxfp8"``, ``"bf16"``, ``"plain"``), and each MXFP8 unit's weight blocks (a
record: a checkpoint restores into either block shape). Never the mesh, the padding or the
planes (recomputed on restore), so a checkpoint restores onto any mesh.

The functions take the ``Plan`` (``plan``: its parameters, precisions and the model's other
state), its ``StateLayout`` (``layout``: shardings and the moves between stored and logical
shapes) and a ``TrainState`` (``state``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mxfp8_jax._src.buffers import checkpoint
from mxfp8_jax._src.fsdp.fsdp_discover import path_names
from mxfp8_jax._src.fsdp.fsdp_plan import ParamInfo, Plan
from mxfp8_jax._src.fsdp.fsdp_state import StateLayout

KIND = "mxfp8_jax.flax.FSDP"


def names(plan: Plan, layout: StateLayout, opt_state) -> tuple[list[str], list[ParamInfo | None]]:
    """The stored name of every leaf of ``leaves(state)`` and, for those kept in a parameter's
    logical shape, that parameter (None: stored as it is)."""
    out: list[str] = []
    owners: list[ParamInfo | None] = []
    by_name = {p.name: p for p in plan.params}
    for name in sorted(p.name for p in plan.trained):
        out.append(f"params/{name}")
        owners.append(by_name[name])
    for name in sorted(p.name for p in plan.frozen):
        out.append(f"frozen/{name}")
        owners.append(by_name[name] if by_name[name].is_unit else None)
    for name in plan.rest_names:
        out.append(f"rest/{name}")
        owners.append(None)
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        out.append("opt/" + "/".join(map(str, path_names(key_path))))
        owners.append(layout.owner_of(key_path, leaf))
    out.append("step")
    owners.append(None)
    return out, owners


def leaves(state, tree: bool = False):
    """``(master by name, frozen by name, rest, opt_state, step)`` of ``state`` in the order of
    ``names``: its leaves, or the tuple itself."""
    master = {k: state.master[k] for k in sorted(state.master)}
    frozen = {k: state.frozen[k] for k in sorted(state.frozen)}
    parts = (master, frozen, tuple(state.rest), state.opt_state, state.step)
    return parts if tree else jax.tree.leaves(parts)


def save(plan: Plan, layout: StateLayout, state, directory, *, async_save: bool, overwrite: bool):
    stored_names, owners = names(plan, layout, state.opt_state)
    values = _to_logical(plan, layout, leaves(state), owners)
    tensors = dict(zip(stored_names, values))
    metadata = {
        "kind": KIND,
        "precision": plan.precision,
        "scale_rule": plan.scale_rule,
        "precisions": {p.name: p.kind for p in plan.trained},
        # recorded, not required: the planes are made again from the master, in the blocks of
        # the plan that restores (a 1x32 checkpoint resumes into 32x32 units and back)
        "weight_blocks": {p.name: p.unit.blocks for p in plan.mxfp8_units if p.trained},
        "key_impls": {n: str(jax.random.key_impl(r)) for n, r in zip(plan.rest_names, state.rest) if _is_key(r)},
        "step": int(np.asarray(state.step.addressable_data(0))),
    }
    return checkpoint.save_logical(directory, tensors, metadata, async_save=async_save, overwrite=overwrite)


def restore(plan: Plan, layout: StateLayout, directory, abstract) -> tuple:
    """``(master, frozen, rest, opt_state, step)`` of the checkpoint in ``directory``, placed in
    the shardings of ``abstract`` (``layout.abstract_state``); mismatches are named first."""
    info = checkpoint.read_metadata(directory)
    meta = info.metadata
    if meta.get("kind") != KIND:
        raise ValueError(f"{directory} holds no FSDP training state (kind {meta.get('kind')!r})")
    if meta.get("scale_rule") != plan.scale_rule:
        raise ValueError(
            f"{directory} was saved with scale_rule={meta.get('scale_rule')!r}; this plan has "
            f"scale_rule={plan.scale_rule!r} (build FSDP(..., scale_rule={meta.get('scale_rule')!r}) to resume it)"
        )
    saved = meta.get("precisions")
    mine = {p.name: p.kind for p in plan.trained}
    if saved is None:  # written before precisions were recorded per parameter
        if meta.get("precision") != plan.precision:
            raise _precision_error(directory, meta, plan, [])
    else:
        differ = sorted(k for k in mine.keys() & saved.keys() if mine[k] != saved[k])
        if differ:
            raise _precision_error(directory, meta, plan, [f"{k}: saved {saved[k]}, plan {mine[k]}" for k in differ])
    stored_names, owners = names(plan, layout, abstract.opt_state)
    rep = NamedSharding(plan.topology.mesh, PartitionSpec())
    targets = {}
    for name, leaf, owner in zip(stored_names, leaves(abstract), owners):
        shape, dtype = (owner.shape, leaf.dtype) if owner is not None else (leaf.shape, leaf.dtype)
        if _is_key(leaf):
            shape, dtype = jax.eval_shape(jax.random.key_data, leaf).shape, jnp.uint32
        sharding = rep if owner is None else layout.logical_sharding(owner)
        targets[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    values = checkpoint.restore_logical(directory, targets)
    impls = meta.get("key_impls", {})  # RNG keys are stored as their data, with the impl named
    ordered = [
        jax.random.wrap_key_data(values[n], impl=impls[n.removeprefix("rest/")]) if _is_key(a) else values[n]
        for n, a in zip(stored_names, leaves(abstract))
    ]
    physical = _from_logical(plan, layout, ordered, owners)
    treedef = jax.tree.structure(leaves(abstract, tree=True))
    return jax.tree.unflatten(treedef, physical)


def _precision_error(directory, meta, plan, differ) -> ValueError:
    detail = f": {'; '.join(differ)}" if differ else ""
    return ValueError(
        f"{directory} was saved with precision={meta.get('precision')!r} and this plan has "
        f"precision={plan.precision!r}; the parameters' precisions differ{detail} (build FSDP with the "
        "precision and precision_by_path the checkpoint was written with to resume it)"
    )


def _to_logical(plan: Plan, layout: StateLayout, values, owners):
    """Stored leaves -> logical ones (device to device: slices and transposes); keys as data."""
    rep = NamedSharding(plan.topology.mesh, PartitionSpec())
    shardings = [rep if p is None else layout.logical_sharding(p) for p in owners]

    def convert(xs):
        out = []
        for x, p in zip(xs, owners):
            out.append(jax.random.key_data(x) if _is_key(x) else x if p is None else layout.to_logical(p, x))
        return out

    return jax.jit(convert, out_shardings=shardings)(values)


def _from_logical(plan: Plan, layout: StateLayout, values, owners):
    """Logical leaves -> stored ones, placed in the plan's shardings."""
    rep = NamedSharding(plan.topology.mesh, PartitionSpec())
    shardings = [rep if p is None else layout.master_sharding(p) for p in owners]
    convert = lambda xs: [x if p is None else layout.from_logical(p, x, x.dtype) for x, p in zip(xs, owners)]
    return jax.jit(convert, out_shardings=shardings)(values)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
