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
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxfp8_jax._src.core import spmd
from mxfp8_jax._src.fsdp import fsdp_checkpoint
from mxfp8_jax._src.fsdp.fsdp_plan import ParamInfo, split_axis
from mxfp8_jax._src.ops.quantize import quantize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnitPlanes:
    """The MXFP8 planes of one unit's master ``[*stack, N_padded, K]``, sharded like it.

    ``rowwise_data``/``columnwise_data``: E4M3 bit patterns as uint8 ``[*stack, N_padded, K]``
    (XLA:CPU widens float8 arrays that cross a loop to f16, twice the bytes; codes are bitcast
    to ``float8_e4m3fn`` where they are dequantized);
    ``rowwise_scale``: uint8 ``[*stack, N_padded, K/32]``; ``columnwise_scale``: uint8
    ``[*stack, N_padded/32, K]``. Every device's rows are whole 32-row blocks of each layer.
    """

    rowwise_data: jax.Array
    rowwise_scale: jax.Array
    columnwise_data: jax.Array
    columnwise_scale: jax.Array


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
    """How a plan's parameters (``params``) are stored over ``mesh``: ``axes`` every mesh axis
    (innermost first, the order shard indices count in), ``fsdp_axes`` those the units' rows and
    the batch are split over (all but ``tp_axis``), ``rest_avals`` the model's other state."""

    def __init__(
        self,
        params: tuple[ParamInfo, ...],
        mesh: Mesh,
        *,
        axes,
        fsdp_axes,
        tp_axis: str | None,
        tp_size: int,
        rest_avals: tuple,
        precision: str,
        scale_rule: int,
    ) -> None:
        self.params, self.mesh = params, mesh
        self._axes, self._fsdp_axes = axes, fsdp_axes
        self.tp_axis, self.tp_size = tp_axis, tp_size
        self._rest_avals = rest_avals
        self.precision, self.scale_rule = precision, scale_rule

    @property
    def trained(self) -> tuple[ParamInfo, ...]:
        return tuple(p for p in self.params if p.trained)

    @property
    def frozen(self) -> tuple[ParamInfo, ...]:
        """The parameters in ``TrainState.frozen``: frozen units and kind ``"frozen"``."""
        return tuple(p for p in self.params if not p.trained)

    @property
    def mxfp8_units(self) -> tuple[ParamInfo, ...]:
        return tuple(p for p in self.params if p.kind == "mxfp8")

    def master_sharding(self, info: ParamInfo) -> NamedSharding:
        """``FSDP.master_sharding`` (documented there)."""
        return NamedSharding(self.mesh, self.spec(info))

    def logical_sharding(self, info: ParamInfo) -> NamedSharding:
        """``FSDP.logical_sharding`` (documented there)."""
        if info.unit is None:
            return self.master_sharding(info)
        axis = split_axis(info.shape, self.mesh.size)
        if axis is None:
            return NamedSharding(self.mesh, PartitionSpec())
        return NamedSharding(self.mesh, PartitionSpec(*(None,) * axis, self._axes))

    def param_tree(self, arrays: dict[str, Any]) -> dict:
        """``FSDP.param_tree`` (documented there)."""
        tree: dict = {}
        for p in self.trained:
            node = tree
            for key in p.path[:-1]:
                node = node.setdefault(key, {})
            node[p.path[-1]] = arrays[p.name]
        return tree

    def from_param_tree(self, tree: dict) -> dict[str, Any]:
        """``FSDP.from_param_tree`` (documented there)."""
        out = {}
        for p in self.trained:
            node = tree
            for key in p.path:
                node = node[key]
            out[p.name] = node
        return out

    def owner_of(self, key_path, leaf) -> ParamInfo | None:
        """``FSDP.owner_of`` (documented there)."""
        names = fsdp_checkpoint.path_names(key_path)
        by_path = self._by_path
        for k in range(min(max(map(len, by_path)), len(names)), 0, -1):
            p = by_path.get(tuple(names[-k:]))
            if p is not None and tuple(np.shape(leaf)) == p.stored_shape:
                return p
        return None

    @functools.cached_property
    def _by_path(self) -> dict[tuple, ParamInfo]:
        return {p.path: p for p in self.trained}

    def abstract_state(self, tx: optax.GradientTransformation) -> TrainState:
        """``FSDP.abstract_state`` (documented there)."""
        sds = jax.ShapeDtypeStruct
        master, quantized = {}, {}
        for p in self.trained:
            master[p.name] = sds(p.stored_shape, jnp.float32, sharding=self.master_sharding(p))
        for p in self.mxfp8_units:
            s = self.master_sharding(p)
            codes, row_scale, col_scale = (sds(p.tp_global(a), jnp.uint8, sharding=s) for a in p.unit.plane_shapes())
            quantized[p.name] = UnitPlanes(codes, row_scale, codes, col_scale)
        rep = NamedSharding(self.mesh, PartitionSpec())
        frozen = {p.name: sds(p.stored_shape, p.dtype, sharding=self.master_sharding(p)) for p in self.frozen}
        rest = tuple(sds(a.shape, a.dtype, sharding=rep) for a in self._rest_avals)
        shapes = jax.eval_shape(tx.init, self.param_tree(master))
        opt_state = jax.tree.map(lambda a, s: sds(a.shape, a.dtype, sharding=s), shapes, self.opt_shardings(shapes))
        return TrainState(master, quantized, frozen, rest, opt_state, sds((), jnp.int32, sharding=rep))

    def check_state(self, state: Any, argname: str = "state") -> None:
        """``FSDP.check_state`` (documented there)."""
        if not isinstance(state, TrainState):
            raise TypeError(f"{argname} must be a TrainState (from FSDP.init), got {type(state).__name__}")
        planes = sorted(state.quantized or {})
        if planes != sorted(p.name for p in self.mxfp8_units):
            raise ValueError(
                f"{argname} has MXFP8 planes for {planes}, but this plan's MXFP8 units are "
                f"{sorted(p.name for p in self.mxfp8_units)} (precision={self.precision!r})"
            )
        want = {p.name: (p.stored_shape, jnp.dtype(jnp.float32)) for p in self.trained}
        got = {k: (tuple(np.shape(v)), jnp.dtype(v.dtype)) for k, v in state.master.items()}
        want.update({p.name: (p.stored_shape, jnp.dtype(p.dtype)) for p in self.frozen})
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
        """``FSDP.to_logical`` (documented there)."""
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
        """``FSDP.from_logical`` (documented there)."""
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
        stack = (None,) * len(info.stack)
        if info.tp == "column":  # rows: tp slices, each split over the FSDP axes
            fsdp = self._fsdp_axes if isinstance(self._fsdp_axes, tuple) else (self._fsdp_axes,)
            return PartitionSpec(*stack, (self.tp_axis, *fsdp), None)
        if info.tp == "row":  # rows over the FSDP axes, columns over tp
            return PartitionSpec(*stack, self._fsdp_axes, self.tp_axis)
        if info.unit is not None:  # rows over the FSDP axes (under tp: the same on every tp rank)
            return PartitionSpec(*stack, self._fsdp_axes, None)
        if info.shard_axis is None:
            return PartitionSpec()
        return PartitionSpec(*(None,) * info.shard_axis, self._fsdp_axes)

    def tp_spec(self, info: ParamInfo) -> PartitionSpec:
        """The tp part of ``_spec``: how a step's tp-manual ``shard_map`` takes the array."""
        stack = (None,) * len(info.stack)
        if info.tp == "column":
            return PartitionSpec(*stack, self.tp_axis, None)
        if info.tp == "row":
            return PartitionSpec(*stack, None, self.tp_axis)
        return PartitionSpec()

    @functools.cached_property
    def place_fn(self):
        trained, frozen_params = self.trained, self.frozen
        shardings = {p.name: self.master_sharding(p) for p in trained}
        rep = NamedSharding(self.mesh, PartitionSpec())
        frozen_shardings = {p.name: self.master_sharding(p) for p in frozen_params}

        def place(values, frozen, rest):  # the step counter too: made on the devices, not sent
            master = {p.name: self.from_logical(p, values[p.name]) for p in trained}
            frozen = {p.name: self.from_logical(p, frozen[p.name], p.dtype) for p in frozen_params}
            return master, frozen, [jnp.asarray(r) for r in rest], jnp.zeros((), jnp.int32)

        rest_shardings = [rep] * len(self._rest_avals)
        return jax.jit(place, out_shardings=(shardings, frozen_shardings, rest_shardings, rep))

    @functools.cached_property
    def logical_fn(self):
        """``(master, frozen) -> values`` in parameter order, each whole (replicated), in the
        parameter's dtype."""
        rep = NamedSharding(self.mesh, PartitionSpec())

        def logical(master, frozen):
            values = []
            for p in self.params:
                if not p.trained:
                    values.append(self.to_logical(p, frozen[p.name]))
                else:
                    values.append(self.to_logical(p, master[p.name]).astype(p.dtype))
            return values

        return jax.jit(logical, out_shardings=[rep] * len(self.params))

    def quantize_local(self, units: tuple[ParamInfo, ...] | None = None) -> Callable:
        """``arrays -> {name: UnitPlanes}`` for the MXFP8 ``units`` (default: the trained ones,
        from ``TrainState.master``; a frozen unit's from its rows in ``TrainState.frozen``, in
        its own dtype): every device quantizes its own rows (no collective)."""
        rule = self.scale_rule
        units = tuple(p for p in self.mxfp8_units if p.trained) if units is None else units
        if not units:
            return lambda master: {}
        specs = {p.name: self.spec(p) for p in units}

        def local(master):
            out = {}
            for p in units:
                w = master[p.name].astype(jnp.float32)  # [*stack, rows, K]: whole 32-row blocks of each layer
                codes, row_scale, col_scale = p.unit.plane_shapes(rows=w.shape[-2], stack=w.shape[:-2])
                t = quantize(w.reshape(-1, w.shape[-1]), scale_rule=rule)
                as_bytes = lambda q: lax.bitcast_convert_type(q, jnp.uint8).reshape(codes)
                out[p.name] = UnitPlanes(
                    as_bytes(t.rowwise_data),
                    t.rowwise_scale.reshape(row_scale),
                    as_bytes(t.columnwise_data),
                    t.columnwise_scale.reshape(col_scale),
                )
            return out

        planes_specs = {name: UnitPlanes(*(s,) * 4) for name, s in specs.items()}
        fn = spmd.shard_map(local, self.mesh, (specs,), planes_specs)
        return lambda master: fn({p.name: master[p.name] for p in units})

    @functools.cached_property
    def quantize_fn(self):
        """``(master, frozen=None) -> {name: UnitPlanes}``, jitted: the trained MXFP8 units'
        planes from ``master`` and, given ``frozen``, the frozen ones' from their rows there."""
        trained = self.quantize_local()
        frozen_units = tuple(p for p in self.mxfp8_units if not p.trained)
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
        replicated = NamedSharding(self.mesh, PartitionSpec())

        def sharding(key_path, leaf):
            p = self.owner_of(key_path, leaf)
            return replicated if p is None else self.master_sharding(p)

        return jax.tree_util.tree_map_with_path(sharding, shapes)

    def shardings(self, state: TrainState):
        master = {p.name: self.master_sharding(p) for p in self.trained}
        quantized = {p.name: UnitPlanes(*(self.master_sharding(p),) * 4) for p in self.mxfp8_units}
        replicated = NamedSharding(self.mesh, PartitionSpec())
        frozen = {p.name: self.master_sharding(p) for p in self.frozen}
        rest = tuple(replicated for _ in state.rest)
        return TrainState(master, quantized, frozen, rest, self.opt_shardings(state.opt_state), replicated)
