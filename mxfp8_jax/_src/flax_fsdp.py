"""Flax NNX training with MXFP8 FSDP weights: per-unit gathers that compose with scan and remat.

One training step, with every mesh axis in the FSDP group and the batch split over it::

    master     per unit, fp32 rows of W = kernel.T [*stack, out_padded, in], sharded by 32-row blocks
      |  quantize after every optimizer update: each device its own rows, no communication
    planes     per unit, E4M3 codes + E8M0 scales, rowwise and columnwise, sharded like the master
      |  each GEMM of the model, when it runs (``fsdp_unit.unit_matmul``):
      |    forward:  all-gather this unit's rowwise planes (8-bit), y = x @ W.T, drop them
      |    backward: all-gather its columnwise planes (8-bit), dx = dy @ W; dW = dy.T @ x (fp32)
      |              leaves through one reduce-scatter into the unit's master rows
    optax update on the shards (elementwise, no communication)

A *unit* is the kernel of one ``flax.nnx.Linear`` or ``mxfp8_jax.flax.Linear`` whose two
dimensions are multiples of 32 (``flax_layers``). Kernels stacked with ``nnx.vmap``
(``[*stack, in, out]``, run with ``nnx.scan``) are units too: each scan iteration gathers one
layer's planes inside the loop, so the compiled step keeps the loop and holds one layer's
gathered weights at a time. Every unit is its own GEMM-level ``custom_vjp`` on local shards,
which is why scan, ``nnx.remat``/``jax.checkpoint`` (the recompute gathers again) and plain
Python loops all work: per-device memory is the shards, the unit being computed, and the
activations the model saves, flat in depth.

Every other parameter (biases, norms, embeddings, kernels with other sizes) lives in one plain
fp32 ``DBuffer`` (RowAtomic), all-gathered in fp32 at the start of the step; autodiff turns that
gather into a reduce-scatter.

``precision="bf16"`` is the baseline with the same structure: each unit's master rows are cast
to bf16 and gathered as 16-bit words, once for the forward and once for the backward.

Overlap: a unit's gather depends only on its own shards, so XLA may issue it ahead of the GEMM
that needs it. On GPUs, ``--xla_gpu_enable_latency_hiding_scheduler=true`` overlaps the gathers
of one step with compute, and ``--xla_gpu_enable_pipelined_all_gather=true`` with
``--xla_gpu_enable_pipelined_reduce_scatter=true`` (XLA's collective pipeliner) moves the next
scan iteration's gather (and the previous one's reduce-scatter) into the current iteration;
``--xla_gpu_all_gather_combine_threshold_bytes`` / ``--xla_gpu_reduce_scatter_combine_threshold_bytes``
let XLA merge the units of one iteration into one collective (set them through ``XLA_FLAGS``).
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
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxfp8_jax._src import placement as pl
from mxfp8_jax._src import spmd
from mxfp8_jax._src.dbuffer import DBuffer
from mxfp8_jax._src.flax_layers import intercept, unit_kernel_shape
from mxfp8_jax._src.format import BLOCK, ScaleRule
from mxfp8_jax._src.fsdp_unit import PRECISIONS, ShardedKernel, UnitGeometry
from mxfp8_jax._src.layout import GlobalLayout
from mxfp8_jax._src.quantize import quantize

# ------------------------------------------------------------------------------------------------
# State


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnitPlanes:
    """The MXFP8 planes of one unit's master ``[*stack, out_padded, in]``, sharded like it.

    ``rowwise_data``/``columnwise_data``: E4M3 bit patterns as uint8 ``[*stack, out_padded, in]``
    (XLA:CPU widens float8 arrays that cross a loop to f16, twice the bytes; codes are bitcast
    to ``float8_e4m3fn`` where they are dequantized);
    ``rowwise_scale``: uint8 ``[*stack, out_padded, in/32]``; ``columnwise_scale``: uint8
    ``[*stack, out_padded/32, in]``. Every device's rows are whole 32-row blocks of each layer.
    """

    rowwise_data: jax.Array
    rowwise_scale: jax.Array
    columnwise_data: jax.Array
    columnwise_scale: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step updates. Invariant: ``quantized`` is the quantization of ``master``.

    ``master``: unit name (the kernel's parameter path) -> fp32 ``W = kernel.T`` with its rows
    padded to ``out_padded``, ``[*stack, out_padded, in]``, rows sharded over the mesh.
    ``quantized``: unit name -> its ``UnitPlanes``, or None under ``precision="bf16"``.
    ``plain``: fp32 DBuffer of the other parameters (RowAtomic), or None when there are none.
    ``opt_state``: the optax state of ``(master, plain.data)``, sharded like them.
    """

    master: dict[str, jax.Array]
    quantized: dict[str, UnitPlanes] | None
    plain: DBuffer | None
    opt_state: Any
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One model parameter as the plan sees it; ``path`` as in ``nnx.to_flat_state``.

    ``unit`` is the geometry of an MXFP8 unit (None for a plain parameter) and ``stack`` the
    leading stack axes of its kernel ``[*stack, in, out]``.
    """

    path: tuple[str | int, ...]
    shape: tuple[int, ...]
    dtype: Any
    unit: UnitGeometry | None = None
    stack: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return "/".join(map(str, self.path))

    @property
    def eligible(self) -> bool:
        return self.unit is not None


# ------------------------------------------------------------------------------------------------
# The plan


class FSDP:
    """MXFP8 FSDP training of an NNX model over every axis of ``mesh``.

    ``FSDP(model, mesh)`` reads the model's structure (not its values): which kernels are units,
    their geometry, the plain parameters' layout. Then::

        state = fsdp.init(model, tx)           # shard, quantize, optimizer state
        step = fsdp.train_step(loss_fn, tx)    # jitted; donates the state
        state, loss = step(state, batch)
        model = fsdp.gather(state)             # an ordinary nnx module again

    ``loss_fn(model, batch) -> scalar`` is the mean loss over the batch it is given. Each device
    runs it on its slice of the batch (every leaf's leading axis is split over the mesh) and the
    step returns the mean over devices. The model may hold only ``nnx.Param`` state; it may use
    ``nnx.scan``, ``nnx.vmap``, ``nnx.remat`` and Python loops freely.
    """

    def __init__(self, model: nnx.Module, mesh: Mesh, *, precision: str = "mxfp8", scale_rule: str = "rceil") -> None:
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
        self.mesh = Mesh(mesh.devices, mesh.axis_names)  # Auto axes: shard_map does the placing
        self.precision = precision
        self.scale_rule = ScaleRule.parse(scale_rule).value
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError(
                "model holds state other than nnx.Param (e.g. batch statistics or RNG streams); "
                "FSDP trains Param-only models"
            )
        self._graphdef, self._rest = graphdef, rest
        self._treedef = jax.tree.structure(params)  # one leaf per Variable: its value
        ndim = len(mesh.axis_names)
        self.master_placements = (pl.BlockAtomic(BLOCK),) * ndim
        self.plain_placements = (pl.RowAtomic(),) * ndim
        self._axes = pl.partition_spec(self.mesh, self.master_placements)[0]  # collective axes
        owners = _unit_kernels(model)
        infos = []
        for path, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]:
            path = _path_names(path)
            shape, dtype = tuple(v.get_value().shape), v.get_value().dtype
            unit, stack = None, ()
            if path in owners and jnp.issubdtype(dtype, jnp.floating):
                stack, k_in, k_out = owners[path]
                unit = UnitGeometry.build(k_in, k_out, self.mesh.size, self._axes, precision)
            infos.append(ParamInfo(path, shape, dtype, unit, stack))
        self.params = tuple(infos)
        self.eligible = tuple(j for j, p in enumerate(self.params) if p.eligible)
        self.others = tuple(j for j, p in enumerate(self.params) if not p.eligible)
        if not self.eligible:
            raise ValueError(
                f"model has no eligible weight: FSDP keeps as MXFP8 the kernels of flax.nnx.Linear "
                f"(default dot_general) and mxfp8_jax.flax.Linear layers whose in and out features "
                f"are both multiples of {BLOCK}, stacked or not; parameters found: "
                f"{[(p.name, p.shape) for p in self.params]}"
            )
        self._owner_paths = tuple(self.params[j].path[:-1] for j in self.eligible)
        self.plain_layout: GlobalLayout | None = (
            GlobalLayout.build([self.params[j].shape or (1,) for j in self.others], self.mesh.size)
            if self.others
            else None
        )

    # -- what the plan holds ---------------------------------------------------------------------

    @property
    def units(self) -> tuple[ParamInfo, ...]:
        """The MXFP8 units (eligible kernels), in parameter order."""
        return tuple(self.params[j] for j in self.eligible)

    @property
    def weight_elements(self) -> int:
        """Elements of the units' kernels (what the model holds)."""
        return sum(int(np.prod(p.shape)) for p in self.units)

    @property
    def stored_elements(self) -> int:
        """Elements of the units' masters as stored, rows padded so every device holds the same
        number of whole 32-row blocks (the bytes a gather moves per element of this)."""
        return sum(int(np.prod(p.unit.padded_shape(p.stack))) for p in self.units)

    def master_sharding(self, info: ParamInfo) -> NamedSharding:
        """A unit's master (and planes): the row axis (second to last) split over the mesh."""
        return NamedSharding(self.mesh, self._row_spec(info))

    # -- state ---------------------------------------------------------------------------------

    def init(self, model: nnx.Module, tx: optax.GradientTransformation) -> TrainState:
        """Shards ``model``'s parameters, quantizes the units, initialises ``tx``."""
        values = self._values_of(model)
        master = self._masters_fn({p.name: values[j] for j, p in zip(self.eligible, self.units)})
        plain = None
        if self.others:
            plain = DBuffer.distribute_tensors(
                [np.asarray(values[j], np.float32).reshape(self.params[j].shape or (1,)) for j in self.others],
                self.mesh,
                self.plain_placements,
                dtype=jnp.float32,
                layout=self.plain_layout,
            )
        quantized = self._quantize_fn(master) if self.precision == "mxfp8" else None
        params = _opt_params(master, plain)
        opt_shardings = self._opt_shardings(jax.eval_shape(tx.init, params))
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
        state = TrainState(master, quantized, plain, opt_state, jnp.zeros((), jnp.int32))
        return jax.device_put(state, self._shardings(state))

    def abstract_state(self, tx: optax.GradientTransformation) -> TrainState:
        """The ``TrainState`` that ``init`` would return, as ``jax.ShapeDtypeStruct``s with their
        shardings: for ``lower_train_step`` (memory analysis, HLO) without building the model."""
        sds = jax.ShapeDtypeStruct
        master, quantized = {}, {}
        for p in self.units:
            s = self.master_sharding(p)
            master[p.name] = sds(p.unit.padded_shape(p.stack), jnp.float32, sharding=s)
            codes, row_scale, col_scale = (sds(a, jnp.uint8, sharding=s) for a in p.unit.plane_shapes(p.stack))
            quantized[p.name] = UnitPlanes(codes, row_scale, codes, col_scale)
        plain = None
        if self.plain_layout is not None:
            plain = DBuffer(
                sds((self.plain_layout.physical_size,), jnp.float32, sharding=self._flat_sharding),
                self.mesh,
                self.plain_placements,
                self.plain_layout,
            )
        shapes = jax.eval_shape(tx.init, _opt_params(master, plain))
        opt_state = jax.tree.map(lambda a, s: sds(a.shape, a.dtype, sharding=s), shapes, self._opt_shardings(shapes))
        step = sds((), jnp.int32, sharding=NamedSharding(self.mesh, PartitionSpec()))
        return TrainState(master, quantized if self.precision == "mxfp8" else None, plain, opt_state, step)

    def gather(self, state: TrainState) -> nnx.Module:
        """The model with the full fp32 master parameters (one all-gather per array)."""
        values = [None] * len(self.params)
        kernels = self._kernels_fn(state.master)
        for j, p in zip(self.eligible, self.units):
            values[j] = kernels[p.name]
        if state.plain is not None:
            for j, t in zip(self.others, state.plain.get_tensors()):
                values[j] = t.reshape(self.params[j].shape).astype(self.params[j].dtype)
        return self._merge(values)

    # -- steps ---------------------------------------------------------------------------------

    def place_batch(self, batch: Any) -> Any:
        """``batch`` with every leaf's leading axis split over the mesh (as a step takes it).

        ``jax.ShapeDtypeStruct`` leaves get the sharding attached (for lowering only)."""
        for leaf in jax.tree.leaves(batch):
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] % self.mesh.size:
                raise ValueError(
                    f"batch leaf of shape {np.shape(leaf)}: its leading (batch) axis must be "
                    f"divisible by the mesh's {self.mesh.size} devices"
                )
        sharding = self._flat_sharding
        if all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(batch)):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), batch)
        return jax.device_put(batch, sharding)

    def loss_and_grads(self, loss_fn: Callable) -> Callable:
        """``fn(state, batch) -> (loss, master_grad, plain_grad)``, jitted: the step's gradients,
        ``master_grad`` a dict like ``state.master`` (fp32 ``[*stack, out_padded, in]``, rows
        sharded), ``plain_grad`` a DBuffer with the plain placements (None without plain params)."""
        jitted = jax.jit(self._grads_fn(loss_fn))
        return lambda state, batch: jitted(state, self.place_batch(batch))

    def train_step(self, loss_fn: Callable, tx: optax.GradientTransformation) -> Callable:
        """``step(state, batch) -> (state, loss)``: gradients, the ``tx`` update on the shards,
        re-quantization. Jitted; the input state is donated."""
        jitted = jax.jit(self._step(loss_fn, tx), donate_argnums=0)
        return lambda state, batch: jitted(state, self.place_batch(batch))

    def lower_train_step(
        self, loss_fn: Callable, tx: optax.GradientTransformation, state: TrainState, batch: Any
    ) -> jax.stages.Lowered:
        """``train_step`` lowered for ``state`` and ``batch`` (arrays, or ``abstract_state`` and
        ``jax.ShapeDtypeStruct`` leaves). ``.compile()`` gives a step to call as
        ``compiled(state, fsdp.place_batch(batch))`` (donating ``state``), its HLO text and its
        ``memory_analysis()``."""
        return jax.jit(self._step(loss_fn, tx), donate_argnums=0).lower(state, self.place_batch(batch))

    def to_kernel(self, info: ParamInfo, master: jax.Array) -> jax.Array:
        """A unit's master (or its gradient) ``[*stack, out_padded, in]`` as the kernel's
        logical ``[*stack, in, out]`` (padding rows dropped); works on sharded arrays."""
        return jnp.swapaxes(master[..., : info.unit.out_features, :], -1, -2)

    # -- internals -----------------------------------------------------------------------------

    def _step(self, loss_fn: Callable, tx) -> Callable:
        grads_fn = self._grads_fn(loss_fn)
        quantize_local = self._quantize_local()

        def step(state: TrainState, batch):
            loss, g_master, g_plain = grads_fn(state, batch)
            params = _opt_params(state.master, state.plain)
            grads = (g_master, None if g_plain is None else g_plain.data)
            updates, opt_state = tx.update(grads, state.opt_state, params)
            master, plain_data = jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, updates)
            plain = None if state.plain is None else dataclasses.replace(state.plain, data=plain_data)
            quantized = quantize_local(master) if self.precision == "mxfp8" else None
            new_state = TrainState(master, quantized, plain, opt_state, state.step + 1)
            return lax.with_sharding_constraint(new_state, self._shardings(new_state)), loss

        return step

    def _grads_fn(self, loss_fn: Callable) -> Callable:
        """Loss and gradients of one step: a single shard_map over the mesh."""
        mesh, axes, n = self.mesh, self._axes, self.mesh.size
        flat = PartitionSpec(axes)
        master_specs = {p.name: self._row_spec(p) for p in self.units}
        planes_specs = {p.name: UnitPlanes(*(self._row_spec(p),) * 4) for p in self.units}

        def local(master, planes, plain, batch):
            def loss_of(master, plain):
                loss = loss_fn(self._model_in_step(master, planes, plain), batch)
                if jnp.ndim(loss) != 0:
                    raise ValueError(
                        f"loss_fn must return a scalar (the mean loss of its batch), got shape {jnp.shape(loss)}"
                    )
                return loss.astype(jnp.float32) / n

            loss, (g_master, g_plain) = jax.value_and_grad(loss_of, argnums=(0, 1))(master, plain)
            return lax.psum(loss, axes), g_master, g_plain

        def grads_fn(state: TrainState, batch):
            plain = None if state.plain is None else state.plain.data
            plain_spec = None if plain is None else flat
            planes = state.quantized
            fn = spmd.shard_map(
                local,
                mesh,
                (
                    master_specs,
                    None if planes is None else planes_specs,
                    plain_spec,
                    jax.tree.map(lambda _: flat, batch),
                ),
                (PartitionSpec(), master_specs, plain_spec),
            )
            loss, g_master, g_plain = fn(state.master, planes, plain, batch)
            if g_plain is not None:
                g_plain = DBuffer(g_plain, mesh, self.plain_placements, self.plain_layout)
            return loss, g_master, g_plain

        return grads_fn

    def _model_in_step(self, master, planes, plain) -> nnx.Module:
        """The model as one device sees it inside the step: units hold ``ShardedKernel``s of this
        device's shards, plain parameters their gathered values."""
        values = [None] * len(self.params)
        for j, p in zip(self.eligible, self.units):
            q = None if planes is None else planes[p.name]
            values[j] = ShardedKernel(
                master[p.name],
                None if q is None else (q.rowwise_data, q.rowwise_scale),
                None if q is None else (q.columnwise_data, q.columnwise_scale),
                p.unit,
                p.dtype,
            )
        if plain is not None:
            full = lax.all_gather(plain, self._axes, tiled=True)  # its VJP is the reduce-scatter
            rep = (pl.Replicate(),) * len(self.mesh.axis_names)
            for j, t in zip(self.others, DBuffer(full, self.mesh, rep, self.plain_layout).get_tensors()):
                values[j] = t.reshape(self.params[j].shape).astype(self.params[j].dtype)
        model = self._merge(values)
        nodes = dict(nnx.iter_graph(model))
        for path in self._owner_paths:
            intercept(nodes[path])
        return model

    @functools.cached_property
    def _flat_sharding(self) -> NamedSharding:
        """Leading axis split over every mesh axis: the batch and the plain buffer."""
        return NamedSharding(self.mesh, PartitionSpec(self._axes))

    def _row_spec(self, info: ParamInfo) -> PartitionSpec:
        return PartitionSpec(*(None,) * len(info.stack), self._axes, None)

    @functools.cached_property
    def _masters_fn(self):
        units = self.units
        shardings = {p.name: self.master_sharding(p) for p in units}

        def masters(values):
            out = {}
            for p in units:
                w = jnp.swapaxes(jnp.asarray(values[p.name], jnp.float32), -1, -2)  # [*stack, out, in]
                pad = p.unit.out_padded - p.unit.out_features
                out[p.name] = jnp.pad(w, [(0, 0)] * len(p.stack) + [(0, pad), (0, 0)])
            return out

        return jax.jit(masters, out_shardings=shardings)

    @functools.cached_property
    def _kernels_fn(self):
        units = self.units
        rep = NamedSharding(self.mesh, PartitionSpec())

        def kernels(master):
            return {p.name: self.to_kernel(p, master[p.name]).astype(p.dtype) for p in units}

        return jax.jit(kernels, out_shardings={p.name: rep for p in units})

    def _quantize_local(self) -> Callable:
        """``master -> {name: UnitPlanes}``: every device quantizes its own rows (no collective)."""
        units, rule = self.units, self.scale_rule
        specs = {p.name: self._row_spec(p) for p in units}

        def local(master):
            out = {}
            for p in units:
                w = master[p.name]  # [*stack, rows, in]: whole 32-row blocks of each layer
                codes, row_scale, col_scale = p.unit.plane_shapes(p.stack, rows=w.shape[-2])
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
        return spmd.shard_map(local, self.mesh, (specs,), planes_specs)

    @functools.cached_property
    def _quantize_fn(self):
        return jax.jit(self._quantize_local())

    def _opt_shardings(self, shapes):
        """Optimizer leaves shaped like a master (or the plain buffer) are sharded like it; the
        rest (step counters, scalars) replicated. Init and step agree, so the step compiles once."""
        by_shape = {p.unit.padded_shape(p.stack): self.master_sharding(p) for p in self.units}
        if self.plain_layout is not None:
            by_shape[(self.plain_layout.physical_size,)] = self._flat_sharding
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda a: by_shape.get(tuple(np.shape(a)), replicated), shapes)

    def _shardings(self, state: TrainState):
        master = {p.name: self.master_sharding(p) for p in self.units}
        quantized = None if state.quantized is None else {name: UnitPlanes(*(s,) * 4) for name, s in master.items()}
        plain = None
        if state.plain is not None:
            plain = dataclasses.replace(state.plain, data=self._flat_sharding)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return TrainState(master, quantized, plain, self._opt_shardings(state.opt_state), replicated)

    def _values_of(self, model: nnx.Module) -> list:
        _, params, _ = nnx.split(model, nnx.Param, ...)
        variables = jax.tree.leaves(params, is_leaf=_is_variable)
        shapes = tuple(tuple(v.get_value().shape) for v in variables)
        if shapes != tuple(p.shape for p in self.params):
            raise ValueError(
                f"model has parameter shapes {shapes}, but this FSDP plan was built for "
                f"{tuple(p.shape for p in self.params)}"
            )
        return [v.get_value() for v in variables]

    def _merge(self, values) -> nnx.Module:
        return nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, values), self._rest)


def _unit_kernels(model: nnx.Module) -> dict[tuple, tuple[tuple[int, ...], int, int]]:
    """Kernel path -> ``(stack, in, out)`` for every layer whose kernel can be a unit."""
    found = {}
    for path, node in nnx.iter_graph(model):
        kernel = getattr(node, "kernel", None) if isinstance(node, nnx.Module) else None
        if not isinstance(kernel, nnx.Variable):
            continue
        spec = unit_kernel_shape(node, tuple(kernel.get_value().shape))
        if spec is not None:
            found[(*tuple(path), "kernel")] = spec
    return found


def _path_names(path) -> tuple[str | int, ...]:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _opt_params(master, plain: DBuffer | None):
    return (master, None if plain is None else plain.data)
