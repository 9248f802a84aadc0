"""The FSDP training state: what each device stores, how it is split, and its moves between shapes.

``TrainState`` holds the parameters as the step trains them (a unit's padded master rows
``[*stack, N_padded, K]`` and its MXFP8 planes, a plain parameter in its own shape), the
optimizer state and the model's other state. ``StateLayout`` knows, for a plan's parameters
on a mesh, how each array is split (``spec``, ``master_sharding``), how it maps to the
parameter's own shape (``to_logical`` / ``from_logical``), how the optimizer sees it by path
(``param_tree``), and makes the compiled programs that place, gather and quantize a state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from mxfp8_jax._src.core import spmd
from mxfp8_jax._src.fsdp.fsdp_discover import path_names
from mxfp8_jax._src.fsdp.fsdp_plan import ParamInfo, Plan, split_axis
from mxfp8_jax._src.fsdp.fsdp_planes import UnitPlanes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step updates. Invariant: ``quantized`` is the quantization of the MXFP8
    units' masters (a frozen unit's: of its rows in ``frozen``).

    ``master``: parameter name (its path joined by ``/``) -> fp32 array, for every trained
    parameter: a unit's ``W`` with its rows padded, ``[*stack, N_padded, K]``, rows sharded
    over the mesh; a plain parameter in its own shape, split along ``ParamInfo.shard_axis`` (or
    replicated).
    ``quantized``: MXFP8 unit name -> its ``UnitPlanes`` (empty without MXFP8 units); a frozen
    unit's are quantized once and carried unchanged by the steps.
    ``frozen``: name -> value of each parameter the optimizer does not train: a frozen unit's
    ``W [*stack, N_padded, K]`` in the parameter's own dtype, rows sharded like a master's; any
    other (kind ``"frozen"``) whole and replicated. Never updated.
    ``rest``: the values of the model's other state (RNG keys and counts), replicated.
    ``opt_state``: the optax state of ``FSDP.param_tree(master)``, sharded like the parameters.
    """

    master: dict[str, jax.Array]
    quantized: dict[str, UnitPlanes]
    frozen: dict[str, jax.Array]
    rest: tuple
    opt_state: Any
    step: jax.Array


class StateLayout:
    """How a plan's parameters are stored over its mesh: the sharding of every array of a
    ``TrainState``, the moves between a stored array and the parameter's own shape, the tree the
    optimizer sees, and the compiled programs that place, gather and quantize a state.

    Args:
      plan: the ``Plan`` (its parameters, topology, precision and scale rule, and the shapes of
        the model's other state).
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def master_sharding(self, info: ParamInfo) -> NamedSharding:
        """A unit's master (and planes): the row axis (second to last) split over the mesh.
        A plain parameter: split along its ``shard_axis``, or replicated.

        Args:
          info: a parameter of this plan (an entry of ``params``).

        Returns:
          The ``NamedSharding`` over ``mesh`` of its ``TrainState.master`` array
          (``info.stored_shape``). Under tensor parallelism a ``"column"`` unit's rows are split
          over the tp axis and then the FSDP axes; a ``"row"`` unit's rows over the FSDP axes and
          its columns over the tp axis. A frozen unit's rows (``TrainState.frozen``) are split
          like a master's; any other frozen parameter is replicated.
        """
        return NamedSharding(self.plan.topology.mesh, self.spec(info))

    def logical_sharding(self, info: ParamInfo) -> NamedSharding:
        """A parameter in its own shape (a checkpoint's tensor): split along the first axis the
        device count divides.

        Args:
          info: a parameter of this plan (an entry of ``params``).

        Returns:
          The ``NamedSharding`` over ``mesh`` for an array of ``info.shape``. For a unit, its first
          axis that ``mesh.size`` divides is split over every mesh axis (replicated when none
          does); for any other parameter, ``master_sharding(info)``.
        """
        if info.unit is None:
            return self.master_sharding(info)
        axis = split_axis(info.shape, self.plan.topology.size)
        if axis is None:
            return NamedSharding(self.plan.topology.mesh, PartitionSpec())
        return NamedSharding(self.plan.topology.mesh, PartitionSpec(*(None,) * axis, self.plan.topology.axes))

    def param_tree(self, arrays: dict[str, Any]) -> dict:
        """``{name: array}`` (like ``TrainState.master``) as nested dicts keyed by the parameter
        paths of ``nnx.state(model, trainable)`` (its ``to_pure_dict()`` structure): the tree
        ``tx`` is initialised and applied on.

        Args:
          arrays: ``{name: value}`` with an entry for every trained parameter (``trained``), e.g.
            ``TrainState.master`` or the gradients of ``loss_and_grads``; other entries are
            ignored.

        Returns:
          Nested dicts holding the trained parameters' values from ``arrays``, as given.
        """
        tree: dict = {}
        for p in self.plan.trained:
            node = tree
            for key in p.path[:-1]:
                node = node.setdefault(key, {})
            node[p.path[-1]] = arrays[p.name]
        return tree

    def from_param_tree(self, tree: dict) -> dict[str, Any]:
        """The inverse of ``param_tree``.

        Args:
          tree: nested dicts holding a value at every trained parameter's path (as
            ``param_tree`` builds them, e.g. after ``optax.apply_updates``); other entries are
            ignored.

        Returns:
          ``{name: value}`` for every trained parameter, in parameter order.
        """
        out = {}
        for p in self.plan.trained:
            node = tree
            for key in p.path:
                node = node[key]
            out[p.name] = node
        return out

    def owner_of(self, key_path, leaf) -> ParamInfo | None:
        """The parameter an optimizer leaf belongs to: its key path ends with the parameter's
        path and it has the parameter's stored shape (adam's moments, masked or labelled).

        Args:
          key_path: the leaf's key path in the optimizer state (as
            ``jax.tree_util.tree_flatten_with_path`` gives it).
          leaf: the leaf (an array or ``jax.ShapeDtypeStruct``); only its shape is read.

        Returns:
          The ``ParamInfo`` of the trained parameter whose path is the longest such suffix, or
          None when no trained parameter matches.
        """
        names = path_names(key_path)
        by_path = self._by_path
        for k in range(min(max(map(len, by_path)), len(names)), 0, -1):
            p = by_path.get(tuple(names[-k:]))
            if p is not None and tuple(np.shape(leaf)) == p.stored_shape:
                return p
        return None

    @functools.cached_property
    def _by_path(self) -> dict[tuple, ParamInfo]:
        return {p.path: p for p in self.plan.trained}

    def abstract_state(self, tx: optax.GradientTransformation) -> TrainState:
        """The ``TrainState`` that ``init`` would return, as ``jax.ShapeDtypeStruct``s with their
        shardings: for ``lower_train_step`` (memory analysis, HLO) without building the model.

        Args:
          tx: the optimizer ``init`` would be given.

        Returns:
          A ``TrainState`` whose leaves are ``jax.ShapeDtypeStruct``s with shapes, dtypes and
          shardings as ``init`` makes them.
        """
        sds = jax.ShapeDtypeStruct
        master, quantized = {}, {}
        for p in self.plan.trained:
            master[p.name] = sds(p.stored_shape, jnp.float32, sharding=self.master_sharding(p))
        for p in self.plan.mxfp8_units:
            s = self.master_sharding(p)
            codes, row_scale, col_scale = (
                None if a is None else sds(p.tp_global(a), jnp.uint8, sharding=s) for a in p.unit.plane_shapes()
            )
            quantized[p.name] = UnitPlanes(
                rowwise_data=codes,
                rowwise_scale=row_scale,
                columnwise_data=None if col_scale is None else codes,
                columnwise_scale=col_scale,
            )
        rep = NamedSharding(self.plan.topology.mesh, PartitionSpec())
        frozen = {p.name: sds(p.stored_shape, p.dtype, sharding=self.master_sharding(p)) for p in self.plan.frozen}
        rest = tuple(sds(a.shape, a.dtype, sharding=rep) for a in self.plan.rest_avals)
        shapes = jax.eval_shape(tx.init, self.param_tree(master))
        opt_state = jax.tree.map(lambda a, s: sds(a.shape, a.dtype, sharding=s), shapes, self.opt_shardings(shapes))
        return TrainState(master, quantized, frozen, rest, opt_state, sds((), jnp.int32, sharding=rep))

    def check_state(self, state: Any, argname: str = "state") -> None:
        """Raises ``ValueError`` unless ``state`` is a ``TrainState`` of this plan: the same
        parameter names, stored shapes and dtypes, planes exactly for the MXFP8 units.

        Args:
          state: the value to check; ``TypeError`` when it is not a ``TrainState``.
          argname: the name the error messages give it.
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"{argname} must be a TrainState (from FSDP.init), got {type(state).__name__}")
        planes = sorted(state.quantized or {})
        if planes != sorted(p.name for p in self.plan.mxfp8_units):
            raise ValueError(
                f"{argname} has MXFP8 planes for {planes}, but this plan's MXFP8 units are "
                f"{sorted(p.name for p in self.plan.mxfp8_units)} (precision={self.plan.precision!r})"
            )
        for p in self.plan.mxfp8_units:
            tiled = getattr(state.quantized[p.name], "tiled", None)
            if tiled is not None and tiled != p.unit.tiled:
                raise ValueError(
                    f"{argname} holds {'one plane of 32x32' if tiled else 'two planes of 1x32'} blocks for {p.name}, "
                    f"but this plan's unit has {p.unit.blocks} blocks (weight_blocks): a state of another FSDP; "
                    "restore a checkpoint instead (its planes are made again from the master)"
                )
        want = {p.name: (p.stored_shape, jnp.dtype(jnp.float32)) for p in self.plan.trained}
        got = {k: (tuple(np.shape(v)), jnp.dtype(v.dtype)) for k, v in state.master.items()}
        want.update({p.name: (p.stored_shape, jnp.dtype(p.dtype)) for p in self.plan.frozen})
        got.update({k: (tuple(np.shape(v)), jnp.dtype(v.dtype)) for k, v in state.frozen.items()})
        if want != got:
            missing = sorted(want.keys() - got.keys())
            extra = sorted(got.keys() - want.keys())
            differ = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
            detail = "; ".join(
                part
                for part in (
                    f"missing {missing}" if missing else "",
                    f"not in this plan {extra}" if extra else "",
                    ", ".join(
                        f"{k}: {got[k][0]} {got[k][1]}, the plan stores {want[k][0]} {want[k][1]}" for k in differ
                    ),
                )
                if part
            )
            raise ValueError(f"{argname} is not a state of this FSDP plan (another model or mesh?): {detail}")

    def to_logical(self, info: ParamInfo, stored: jax.Array) -> jax.Array:
        """Any parameter's stored array (``TrainState.master`` entry, its gradient or an
        optimizer moment) in the parameter's own shape (a unit's padding rows dropped); works
        on sharded arrays.

        Args:
          info: the parameter (an entry of ``params``).
          stored: an array of ``info.stored_shape``.

        Returns:
          An array of ``info.shape`` in ``stored``'s dtype; ``stored`` itself for a parameter
          that is not a unit.
        """
        g = info.unit
        if g is None:
            return stored
        if info.tp is None:
            return g.from_master(stored)
        # a tensor-parallel Linear kernel [*stack, in, out]: W = kernel.T, tp slices side by side
        if info.tp == "column":  # [*stack, tp * out_padded, in]: each slice's padding dropped
            t = info.tp_size
            w = stored.reshape(*stored.shape[:-2], t, g.out_padded, stored.shape[-1])[..., : g.out_features, :]
            return jnp.swapaxes(w.reshape(*stored.shape[:-2], t * g.out_features, stored.shape[-1]), -1, -2)
        return jnp.swapaxes(stored[..., : g.out_features, :], -1, -2)

    def from_logical(self, info: ParamInfo, value: jax.Array, dtype=jnp.float32) -> jax.Array:
        """The inverse of ``to_logical``: a unit's parameter-shaped array as its padded master
        (zero rows), in ``dtype``.

        Args:
          info: the parameter (an entry of ``params``).
          value: an array of ``info.shape`` (anything ``jnp.asarray`` takes).
          dtype: the result's dtype.

        Returns:
          An array of ``info.stored_shape`` in ``dtype``, its padding rows zero; for a parameter
          that is not a unit, ``value`` in ``dtype``.
        """
        value = jnp.asarray(value, dtype)
        g = info.unit
        if g is None:
            return value
        if info.tp is None:
            return g.to_master(value)
        w = jnp.swapaxes(value, -1, -2)  # [*stack, out, in]
        stack, pad = len(info.stack), g.out_padded - g.out_features
        if info.tp == "column":  # each tp slice of rows padded on its own
            t = info.tp_size
            w = w.reshape(*w.shape[:-2], t, g.out_features, w.shape[-1])
            w = jnp.pad(w, [(0, 0)] * (stack + 1) + [(0, pad), (0, 0)])
            return w.reshape(*w.shape[:-3], t * g.out_padded, w.shape[-1])
        return jnp.pad(w, [(0, 0)] * stack + [(0, pad), (0, 0)])

    def check_live(self, state) -> None:
        if isinstance(state, TrainState) and any(
            isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(state)
        ):
            raise ValueError(
                "this state was consumed by an earlier step (a step donates its input state); "
                "use the state that step returned"
            )

    def check_opt_state(self, tx, params, opt_state) -> None:
        want = jax.eval_shape(tx.init, params)
        w_leaves, w_def = jax.tree.flatten(want)
        g_leaves, g_def = jax.tree.flatten(opt_state)
        same = w_def == g_def and all(
            tuple(a.shape) == tuple(np.shape(b)) and jnp.dtype(a.dtype) == jnp.dtype(b.dtype)
            for a, b in zip(w_leaves, g_leaves)
        )
        if not same:
            raise ValueError(
                "state.opt_state was not initialised by the tx given to train_step (its structure "
                f"differs: {g_def} vs {w_def}); build the state with fsdp.init(model, tx) using the "
                "same optimizer"
            )

    def spec(self, info: ParamInfo) -> PartitionSpec:
        """How the array of ``info`` in a ``TrainState`` is split over the mesh (its
        ``master_sharding``'s spec)."""
        topology = self.plan.topology
        stack, fsdp, tp = (None,) * len(info.stack), topology.fsdp_axes, topology.tp_axis
        if info.tp == "column":  # rows: tp slices, each split over the FSDP axes
            return PartitionSpec(*stack, (tp, *(fsdp if isinstance(fsdp, tuple) else (fsdp,))), None)
        if info.tp == "row":  # rows over the FSDP axes, columns over tp
            return PartitionSpec(*stack, fsdp, tp)
        if info.unit is not None:  # rows over the FSDP axes (under tp: the same on every tp rank)
            return PartitionSpec(*stack, fsdp, None)
        if info.shard_axis is None:
            return PartitionSpec()
        return PartitionSpec(*(None,) * info.shard_axis, fsdp)

    def tp_spec(self, info: ParamInfo) -> PartitionSpec:
        """The tp part of ``spec``: how a step's tp-manual ``shard_map`` takes the array."""
        stack, tp = (None,) * len(info.stack), self.plan.topology.tp_axis
        if info.tp == "column":
            return PartitionSpec(*stack, tp, None)
        if info.tp == "row":
            return PartitionSpec(*stack, None, tp)
        return PartitionSpec()

    @functools.cached_property
    def place_fn(self):
        trained, frozen_params = self.plan.trained, self.plan.frozen
        shardings = {p.name: self.master_sharding(p) for p in trained}
        rep = NamedSharding(self.plan.topology.mesh, PartitionSpec())
        frozen_shardings = {p.name: self.master_sharding(p) for p in frozen_params}

        def place(values, frozen, rest):  # the step counter too: made on the devices, not sent
            master = {p.name: self.from_logical(p, values[p.name]) for p in trained}
            frozen = {p.name: self.from_logical(p, frozen[p.name], p.dtype) for p in frozen_params}
            return master, frozen, [jnp.asarray(r) for r in rest], jnp.zeros((), jnp.int32)

        rest_shardings = [rep] * len(self.plan.rest_avals)
        return jax.jit(place, out_shardings=(shardings, frozen_shardings, rest_shardings, rep))

    @functools.cached_property
    def logical_fn(self):
        """``(master, frozen) -> values`` in parameter order, each whole (replicated), in the
        parameter's dtype."""
        rep = NamedSharding(self.plan.topology.mesh, PartitionSpec())

        def logical(master, frozen):
            values = []
            for p in self.plan.params:
                if not p.trained:
                    values.append(self.to_logical(p, frozen[p.name]))
                else:
                    values.append(self.to_logical(p, master[p.name]).astype(p.dtype))
            return values

        return jax.jit(logical, out_shardings=[rep] * len(self.plan.params))

    def quantize_local(self, units: tuple[ParamInfo, ...] | None = None) -> Callable:
        """``arrays -> {name: UnitPlanes}`` for the MXFP8 ``units`` (default: the trained ones,
        from ``TrainState.master``; a frozen unit's from its rows in ``TrainState.frozen``, in
        its own dtype): every device quantizes its own rows (no collective)."""
        rule = self.plan.scale_rule
        units = tuple(p for p in self.plan.mxfp8_units if p.trained) if units is None else units
        if not units:
            return lambda master: {}
        specs = {p.name: self.spec(p) for p in units}

        def local(master):  # [*stack, rows, K]: whole 32-row blocks of each layer
            return {p.name: UnitPlanes.encode(master[p.name], rule, p.unit.blocks) for p in units}

        planes_specs = {p.name: UnitPlanes.like(specs[p.name], p.unit.blocks) for p in units}
        fn = spmd.shard_map(local, self.plan.topology.mesh, (specs,), planes_specs)
        return lambda master: fn({p.name: master[p.name] for p in units})

    @functools.cached_property
    def quantize_fn(self):
        """``(master, frozen=None) -> {name: UnitPlanes}``, jitted: the trained MXFP8 units'
        planes from ``master`` and, given ``frozen``, the frozen ones' from their rows there."""
        trained = self.quantize_local()
        frozen_units = tuple(p for p in self.plan.mxfp8_units if not p.trained)
        frozen_fn = self.quantize_local(frozen_units) if frozen_units else None

        def quantize_all(master, frozen=None):
            planes = trained(master)
            if frozen is not None and frozen_fn is not None:
                planes.update(frozen_fn(frozen))
            return planes

        return jax.jit(quantize_all)

    def opt_shardings(self, shapes):
        """Optimizer leaves that belong to a parameter (``owner_of``) are sharded like it; the
        rest (step counts, scalars) replicated. Init and step agree, so the step compiles once."""
        replicated = NamedSharding(self.plan.topology.mesh, PartitionSpec())

        def sharding(key_path, leaf):
            p = self.owner_of(key_path, leaf)
            return replicated if p is None else self.master_sharding(p)

        return jax.tree_util.tree_map_with_path(sharding, shapes)

    def shardings(self, state: TrainState):
        master = {p.name: self.master_sharding(p) for p in self.plan.trained}
        quantized = {p.name: UnitPlanes.like(self.master_sharding(p), p.unit.blocks) for p in self.plan.mxfp8_units}
        replicated = NamedSharding(self.plan.topology.mesh, PartitionSpec())
        frozen = {p.name: self.master_sharding(p) for p in self.plan.frozen}
        rest = tuple(replicated for _ in state.rest)
        return TrainState(master, quantized, frozen, rest, self.opt_shardings(state.opt_state), replicated)
