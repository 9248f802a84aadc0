"""Flax NNX training with MXFP8 FSDP weights: per-unit gathers that compose with scan and remat.

One training step, with every mesh axis in the FSDP group and the batch split over it::

    master     per unit, fp32 rows of W = kernel.T [*stack, out_padded, in], sharded by 32-row blocks
      |  quantize after every optimizer update: each device its own rows, no communication
    planes     per unit, E4M3 codes + E8M0 scales, rowwise and columnwise, sharded like the master
      |  each GEMM of the model, when it runs (``fsdp_unit.unit_matmul``):
      |    forward:  all-gather this unit's rowwise planes (8-bit), y = x @ W.T, drop them
      |    backward: all-gather its columnwise planes (8-bit), dx = dy @ W; dW = dy.T @ x (fp32)
      |              leaves through one reduce-scatter into the unit's master rows
    optax update on the parameters' shards (elementwise: no communication)

A *unit* is the kernel of one ``flax.nnx.Linear`` or ``mxfp8_jax.flax.Linear`` whose two
dimensions are multiples of 32 (``flax_layers``). Kernels stacked with ``nnx.vmap``
(``[*stack, in, out]``, run with ``nnx.scan``) are units too: each scan iteration gathers one
layer's planes inside the loop, so the compiled step keeps the loop and holds one layer's
gathered weights at a time. Every unit is its own GEMM-level ``custom_vjp`` on local shards,
which is why scan, ``nnx.remat``/``jax.checkpoint`` (the recompute gathers again) and plain
Python loops all work: per-device memory is the shards, the unit being computed, and the
activations the model saves, flat in depth.

Every other floating parameter (biases, norms, embeddings, kernels with other sizes) is
*plain*: fp32, its own array with its logical shape, split over the mesh along its first axis
that the device count divides (replicated when none does, e.g. 0-D scalars). The step
all-gathers the split ones together as one fp32 gather at its start; autodiff turns that gather
into one reduce-scatter. Non-floating parameters are *frozen*: replicated, passed to the model,
never trained.

The optimizer sees the model's parameters: ``tx`` is initialised and applied on nested dicts
with the paths of ``nnx.state(model, nnx.Param).to_pure_dict()``, whose leaves are the
sharded fp32 arrays (a unit's leaf is its master ``W = kernel.T``, rows padded; a plain one has
the parameter's own shape). Masks and labels by path (``optax.adamw(mask=...)``,
``optax.multi_transform``, ``optax.masked``), elementwise transforms and global norms therefore
behave as on the unsharded model; the padding rows of a master hold zeros and receive zero
gradients. Elementwise updates run on each device's shard with no communication.

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
from mxfp8_jax._src.flax_layers import intercept, unit_kernel_shape
from mxfp8_jax._src.format import BLOCK, ScaleRule
from mxfp8_jax._src.fsdp_unit import PRECISIONS, ShardedKernel, UnitGeometry
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
    """Everything a step updates. Invariant: ``quantized`` is the quantization of the units'
    masters.

    ``master``: parameter name (its path joined by ``/``) -> fp32 array, for every trained
    parameter: a unit's ``W = kernel.T`` with its rows padded to ``out_padded``,
    ``[*stack, out_padded, in]``, rows sharded over the mesh; a plain parameter in its own shape,
    split along ``ParamInfo.shard_axis`` (or replicated).
    ``quantized``: unit name -> its ``UnitPlanes``, or None under ``precision="bf16"``.
    ``frozen``: name -> value of each non-floating parameter, replicated, never trained.
    ``opt_state``: the optax state of ``FSDP.param_tree(master)``, sharded like the parameters.
    """

    master: dict[str, jax.Array]
    quantized: dict[str, UnitPlanes] | None
    frozen: dict[str, jax.Array]
    opt_state: Any
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One model parameter as the plan sees it; ``path`` as in ``nnx.to_flat_state``.

    ``unit`` is the geometry of an MXFP8 unit (None otherwise) and ``stack`` the leading stack
    axes of its kernel ``[*stack, in, out]``. A plain parameter is split over the mesh along
    ``shard_axis`` (None: replicated). ``kind`` is ``"unit"``, ``"plain"`` or ``"frozen"``
    (non-floating: kept, not trained). Under tensor parallelism a unit's ``tp`` is
    ``"column"`` (``out`` split over the ``tp_size`` devices of the tp axis) or ``"row"``
    (``in`` split); its ``unit`` geometry is then that of one tp slice, FSDP-sharded over the
    other mesh axes.
    """

    path: tuple[str | int, ...]
    shape: tuple[int, ...]
    dtype: Any
    unit: UnitGeometry | None = None
    stack: tuple[int, ...] = ()
    shard_axis: int | None = None
    tp: str | None = None
    tp_size: int = 1

    @property
    def name(self) -> str:
        return "/".join(map(str, self.path))

    @property
    def eligible(self) -> bool:
        return self.unit is not None

    @property
    def kind(self) -> str:
        if self.unit is not None:
            return "unit"
        return "plain" if jnp.issubdtype(self.dtype, jnp.floating) else "frozen"

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of its array in ``TrainState`` (a unit's padded, transposed master; the tp
        slices side by side along rows for ``"column"``, along columns for ``"row"``)."""
        return self.shape if self.unit is None else self.tp_global(self.unit.padded_shape(self.stack))

    def tp_global(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """A unit array's shape for one tp slice -> for all of them."""
        if self.tp is None:
            return tuple(local)
        axis = len(local) - (2 if self.tp == "column" else 1)
        return tuple(d * self.tp_size if a == axis else d for a, d in enumerate(local))


# ------------------------------------------------------------------------------------------------
# The plan


class FSDP:
    """MXFP8 FSDP training of an NNX model over every axis of ``mesh``.

    ``FSDP(model, mesh)`` reads the model's structure (not its values): which kernels are units,
    their geometry, how the other parameters are split. Then::

        state = fsdp.init(model, tx)           # shard, quantize, optimizer state
        step = fsdp.train_step(loss_fn, tx)    # jitted; donates the state
        state, loss = step(state, batch)
        model = fsdp.gather(state)             # an ordinary nnx module again

    ``loss_fn(model, batch) -> scalar`` is the mean loss over the batch it is given (with
    ``has_aux=True``: ``-> (scalar, aux)``). Each device runs it on its slice of the batch (every
    leaf's leading axis is split over the mesh) and the step returns the mean over devices. The
    model may hold only ``nnx.Param`` state; it may use ``nnx.scan``, ``nnx.vmap``, ``nnx.remat``
    and Python loops freely. ``tx`` sees the parameters by path (``param_tree``).
    """

    def __init__(
        self,
        model: nnx.Module,
        mesh: Mesh,
        *,
        precision: str = "mxfp8",
        scale_rule: str = "rceil",
        tp_axis: str | None = None,
    ) -> None:
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
        self._axes = pl.partition_spec(self.mesh, self.master_placements)[0]  # collective axes
        n = self.mesh.size
        self.tp_axis = tp_axis
        self.tp_size = 1
        self._fsdp_axes, n_fsdp = self._axes, n
        if tp_axis is not None:
            if tp_axis not in mesh.axis_names or ndim < 2:
                raise ValueError(
                    f"tp_axis={tp_axis!r} must be one axis of a mesh with at least one other (FSDP) "
                    f"axis; the mesh has {tuple(mesh.axis_names)}"
                )
            self.tp_size = int(mesh.shape[tp_axis])
            fsdp = tuple(reversed([a for a in mesh.axis_names if a != tp_axis]))  # innermost first
            self._fsdp_axes = fsdp[0] if len(fsdp) == 1 else fsdp
            n_fsdp = n // self.tp_size
        owners = _unit_kernels(model)
        infos = []
        for path, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]:
            path = _path_names(path)
            shape, dtype = tuple(v.get_value().shape), jnp.dtype(v.get_value().dtype)
            unit, stack, shard_axis, role = None, (), None, None
            if path in owners and jnp.issubdtype(dtype, jnp.floating):
                stack, k_in, k_out, role = owners[path]
                role = role if tp_axis is not None else None
                if role is None:
                    unit = UnitGeometry.build(k_in, k_out, n, self._axes, precision)
                else:
                    k_in, k_out = self._tp_slice(path, role, k_in, k_out)
                    unit = UnitGeometry.build(k_in, k_out, n_fsdp, self._fsdp_axes, precision)
            elif jnp.issubdtype(dtype, jnp.floating):
                shard_axis = _split_axis(shape, n)
            tp_size = self.tp_size if role is not None else 1
            infos.append(ParamInfo(path, shape, dtype, unit, stack, shard_axis, role, tp_size))
        self.params = tuple(infos)
        self.eligible = tuple(j for j, p in enumerate(self.params) if p.eligible)
        self.others = tuple(j for j, p in enumerate(self.params) if p.kind == "plain")
        self.frozen_params = tuple(j for j, p in enumerate(self.params) if p.kind == "frozen")
        if not self.eligible:
            raise ValueError(
                f"model has no eligible weight: FSDP keeps as MXFP8 the kernels of flax.nnx.Linear "
                f"(default dot_general) and mxfp8_jax.flax.Linear layers whose in and out features "
                f"are both multiples of {BLOCK}, stacked or not; parameters found: "
                f"{[(p.name, p.shape) for p in self.params]}"
            )
        self._owner_paths = tuple(self.params[j].path[:-1] for j in self.eligible)

    def _tp_slice(self, path, role: str, k_in: int, k_out: int) -> tuple[int, int]:
        """A tensor-parallel kernel's ``(in, out)`` on one device of the tp axis."""
        name, t = "/".join(map(str, path)), self.tp_size
        if role not in ("column", "row"):
            raise ValueError(f"{name}: tensor_parallel={role!r} must be 'column' or 'row'")
        split = k_out if role == "column" else k_in
        if split % (t * BLOCK):
            raise ValueError(
                f"{name}: a {role}-parallel kernel [in={k_in}, out={k_out}] splits its "
                f"{'out' if role == 'column' else 'in'} features over the {t} devices of "
                f"{self.tp_axis!r}; they must be a multiple of {t} x {BLOCK}"
            )
        return (k_in, k_out // t) if role == "column" else (k_in // t, k_out)

    # -- what the plan holds ---------------------------------------------------------------------

    @property
    def units(self) -> tuple[ParamInfo, ...]:
        """The MXFP8 units (eligible kernels), in parameter order."""
        return tuple(self.params[j] for j in self.eligible)

    @property
    def plain(self) -> tuple[ParamInfo, ...]:
        """The plain (fp32, not MXFP8) trained parameters, in parameter order."""
        return tuple(self.params[j] for j in self.others)

    @property
    def trained(self) -> tuple[ParamInfo, ...]:
        """Every parameter the optimizer updates (units and plain), in parameter order."""
        return tuple(p for p in self.params if p.kind != "frozen")

    @property
    def weight_elements(self) -> int:
        """Elements of the units' kernels (what the model holds)."""
        return sum(int(np.prod(p.shape)) for p in self.units)

    @property
    def plain_elements(self) -> int:
        """Elements of the plain parameters."""
        return sum(int(np.prod(p.shape)) for p in self.plain)

    @property
    def stored_elements(self) -> int:
        """Elements of the units' masters as stored, rows padded so every device holds the same
        number of whole 32-row blocks (the bytes a gather moves per element of this)."""
        return sum(int(np.prod(p.stored_shape)) for p in self.units)

    def master_sharding(self, info: ParamInfo) -> NamedSharding:
        """A unit's master (and planes): the row axis (second to last) split over the mesh.
        A plain parameter: split along its ``shard_axis``, or replicated."""
        return NamedSharding(self.mesh, self._spec(info))

    def param_tree(self, arrays: dict[str, Any]) -> dict:
        """``{name: array}`` (like ``TrainState.master``) as nested dicts keyed by the parameter
        paths of ``nnx.state(model, nnx.Param)`` (its ``to_pure_dict()`` structure): the tree
        ``tx`` is initialised and applied on."""
        tree: dict = {}
        for p in self.trained:
            node = tree
            for key in p.path[:-1]:
                node = node.setdefault(key, {})
            node[p.path[-1]] = arrays[p.name]
        return tree

    def from_param_tree(self, tree: dict) -> dict[str, Any]:
        """The inverse of ``param_tree``."""
        out = {}
        for p in self.trained:
            node = tree
            for key in p.path:
                node = node[key]
            out[p.name] = node
        return out

    # -- state ---------------------------------------------------------------------------------

    def init(self, model: nnx.Module, tx: optax.GradientTransformation) -> TrainState:
        """Shards ``model``'s parameters, quantizes the units, initialises ``tx``.

        The parameters may be host arrays or ``jax.Array``s with any sharding (e.g. created
        under ``jax.jit`` with ``out_shardings``, across several processes): they are placed by
        one jitted program, device to device, with no host gather."""
        values = self._values_of(model)
        master, frozen, step = self._place_fn(
            {p.name: values[j] for j, p in enumerate(self.params) if p.kind != "frozen"},
            {self.params[j].name: values[j] for j in self.frozen_params},
        )
        return self._with_optimizer(master, frozen, tx, step)

    def _with_optimizer(self, master, frozen, tx, step) -> TrainState:
        quantized = self._quantize_fn(master) if self.precision == "mxfp8" else None
        params = self.param_tree(master)
        opt_shardings = self._opt_shardings(jax.eval_shape(tx.init, params))
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
        state = TrainState(master, quantized, frozen, opt_state, step)
        return jax.device_put(state, self._shardings(state))

    def abstract_state(self, tx: optax.GradientTransformation) -> TrainState:
        """The ``TrainState`` that ``init`` would return, as ``jax.ShapeDtypeStruct``s with their
        shardings: for ``lower_train_step`` (memory analysis, HLO) without building the model."""
        sds = jax.ShapeDtypeStruct
        master, quantized = {}, {}
        for p in self.trained:
            master[p.name] = sds(p.stored_shape, jnp.float32, sharding=self.master_sharding(p))
        for p in self.units:
            s = self.master_sharding(p)
            codes, row_scale, col_scale = (
                sds(p.tp_global(a), jnp.uint8, sharding=s) for a in p.unit.plane_shapes(p.stack)
            )
            quantized[p.name] = UnitPlanes(codes, row_scale, codes, col_scale)
        rep = NamedSharding(self.mesh, PartitionSpec())
        frozen = {
            self.params[j].name: sds(self.params[j].shape, self.params[j].dtype, sharding=rep)
            for j in self.frozen_params
        }
        shapes = jax.eval_shape(tx.init, self.param_tree(master))
        opt_state = jax.tree.map(lambda a, s: sds(a.shape, a.dtype, sharding=s), shapes, self._opt_shardings(shapes))
        step = sds((), jnp.int32, sharding=rep)
        return TrainState(master, quantized if self.precision == "mxfp8" else None, frozen, opt_state, step)

    def gather(self, state: TrainState) -> nnx.Module:
        """The model with the full fp32 master parameters (one all-gather per array)."""
        self.check_state(state, "state")
        return self._merge(self._logical_fn(state.master, state.frozen))

    def check_state(self, state: Any, argname: str = "state") -> None:
        """Raises ``ValueError`` unless ``state`` is a ``TrainState`` of this plan: the same
        parameter names, stored shapes and dtypes, planes present exactly for ``"mxfp8"``."""
        if not isinstance(state, TrainState):
            raise TypeError(f"{argname} must be a TrainState (from FSDP.init), got {type(state).__name__}")
        want = {p.name: (p.stored_shape, jnp.dtype(jnp.float32)) for p in self.trained}
        got = {k: (tuple(np.shape(v)), jnp.dtype(v.dtype)) for k, v in state.master.items()}
        want.update({self.params[j].name: (self.params[j].shape, self.params[j].dtype) for j in self.frozen_params})
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
        if (state.quantized is None) != (self.precision != "mxfp8"):
            raise ValueError(
                f"{argname} {'has no' if state.quantized is None else 'has'} MXFP8 planes, but this plan's "
                f"precision is {self.precision!r}"
            )

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, state: TrainState, directory, *, async_save: bool = False, overwrite: bool = False):
        """Writes ``state`` to ``directory`` as LOGICAL tensors, shard by shard (orbax).

        Stored: every trained parameter by its model path in its own shape (a unit as its
        kernel ``[*stack, in, out]``, padding dropped), every optimizer leaf that belongs to a
        parameter in that parameter's shape under ``opt/<optimizer path>/<parameter path>``
        (the others, e.g. step counts, as they are), the frozen parameters, the step, the
        precision and scale rule. Never the mesh, the padding or the planes (recomputed on
        ``restore``), so a checkpoint restores onto any mesh. Every process must call it.
        Returns a handle; with ``async_save`` call ``.wait()`` before relying on the files.
        """
        from mxfp8_jax._src import checkpoint

        self.check_state(state, "state")
        self._check_live(state)
        names, stored = self._checkpoint_names(state.opt_state)
        tensors = dict(zip(names, self._to_checkpoint(self._checkpoint_leaves(state), stored)))
        metadata = {
            "kind": "mxfp8_jax.flax.FSDP",
            "precision": self.precision,
            "scale_rule": self.scale_rule,
            "step": int(np.asarray(state.step.addressable_data(0))),
        }
        return checkpoint.save_logical(directory, tensors, metadata, async_save=async_save, overwrite=overwrite)

    def restore(self, directory, tx: optax.GradientTransformation) -> TrainState:
        """The ``TrainState`` saved in ``directory``, placed on this plan's mesh: parameters and
        optimizer moments read shard by shard into their shardings, planes re-quantized.

        Before any data moves, a ``ValueError`` names every path that does not fit this plan
        and ``tx``: a missing or extra parameter, another shape or dtype, another optimizer
        structure; a checkpoint saved with another precision or scale rule is refused too."""
        from mxfp8_jax._src import checkpoint

        info = checkpoint.read_metadata(directory)
        meta = info.metadata
        if meta.get("kind") != "mxfp8_jax.flax.FSDP":
            raise ValueError(f"{directory} holds no FSDP training state (kind {meta.get('kind')!r})")
        for key, mine in (("precision", self.precision), ("scale_rule", self.scale_rule)):
            if meta.get(key) != mine:
                raise ValueError(
                    f"{directory} was saved with {key}={meta.get(key)!r}; this plan has {key}={mine!r} "
                    f"(build FSDP(..., {key}={meta.get(key)!r}) to resume it)"
                )
        abstract = self.abstract_state(tx)
        names, stored = self._checkpoint_names(abstract.opt_state)
        leaves = self._checkpoint_leaves(abstract)
        rep = NamedSharding(self.mesh, PartitionSpec())
        targets = {}
        for name, leaf, info_p in zip(names, leaves, stored):
            shape = info_p.shape if info_p is not None else leaf.shape
            sharding = rep if info_p is None else self._logical_sharding(info_p)
            targets[name] = jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding)
        values = checkpoint.restore_logical(directory, targets)
        physical = self._from_checkpoint([values[n] for n in names], stored)
        treedef = jax.tree.structure(self._checkpoint_leaves(abstract, tree=True))
        master, frozen, opt_state, step = jax.tree.unflatten(treedef, physical)
        quantized = self._quantize_fn(master) if self.precision == "mxfp8" else None
        state = TrainState(master, quantized, frozen, opt_state, step)
        return jax.device_put(state, self._shardings(state))

    def _checkpoint_leaves(self, state, tree: bool = False):
        """``(master, frozen, opt_state, step)`` of ``state``: its leaves, or the tuple itself."""
        parts = (state.master, state.frozen, state.opt_state, state.step)
        return parts if tree else jax.tree.leaves(parts)

    def _checkpoint_names(self, opt_state) -> tuple[list[str], list[ParamInfo | None]]:
        """The stored name of every leaf of ``_checkpoint_leaves`` and, for those kept in a
        parameter's logical shape, that parameter (None: stored as it is)."""
        names: list[str] = []
        owners: list[ParamInfo | None] = []
        for name in sorted(p.name for p in self.trained):
            names.append(f"params/{name}")
            owners.append(self._by_name[name])
        for name in sorted(self.params[j].name for j in self.frozen_params):
            names.append(f"frozen/{name}")
            owners.append(None)
        for key_path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
            p = self._owner_of(key_path, leaf)
            names.append("opt/" + "/".join(map(str, _path_names(key_path))))
            owners.append(p)
        names.append("step")
        owners.append(None)
        return names, owners

    @functools.cached_property
    def _by_name(self) -> dict[str, ParamInfo]:
        return {p.name: p for p in self.params}

    def _owner_of(self, key_path, leaf) -> ParamInfo | None:
        """The parameter an optimizer leaf belongs to: its key path ends with the parameter's
        path and it has the parameter's stored shape (adam's moments, masked or labelled)."""
        names = _path_names(key_path)
        by_path = self._by_path
        for k in range(min(max(map(len, by_path)), len(names)), 0, -1):
            p = by_path.get(tuple(names[-k:]))
            if p is not None and tuple(np.shape(leaf)) == p.stored_shape:
                return p
        return None

    @functools.cached_property
    def _by_path(self) -> dict[tuple, ParamInfo]:
        return {p.path: p for p in self.trained}

    def _logical_sharding(self, info: ParamInfo) -> NamedSharding:
        """A parameter in its own shape: split along the first axis the device count divides
        (a plain parameter's own sharding; a unit's kernel by the same rule)."""
        if info.unit is None:
            return self.master_sharding(info)
        axis = _split_axis(info.shape, self.mesh.size)
        if axis is None:
            return NamedSharding(self.mesh, PartitionSpec())
        return NamedSharding(self.mesh, PartitionSpec(*(None,) * axis, self._axes))

    def _to_checkpoint(self, leaves, owners):
        """Stored leaves -> logical ones (device to device: slices and transposes)."""
        rep = NamedSharding(self.mesh, PartitionSpec())
        shardings = [rep if p is None else self._logical_sharding(p) for p in owners]
        convert = lambda xs: [x if p is None else self.to_logical(p, x) for x, p in zip(xs, owners)]
        return jax.jit(convert, out_shardings=shardings)(leaves)

    def _from_checkpoint(self, values, owners):
        """Logical leaves -> stored ones, placed in this plan's shardings."""
        rep = NamedSharding(self.mesh, PartitionSpec())
        shardings = [rep if p is None else self.master_sharding(p) for p in owners]
        convert = lambda xs: [x if p is None else self.from_logical(p, x, x.dtype) for x, p in zip(xs, owners)]
        return jax.jit(convert, out_shardings=shardings)(values)

    # -- steps ---------------------------------------------------------------------------------

    def place_batch(self, batch: Any) -> Any:
        """``batch`` with every leaf's leading axis split over the mesh (as a step takes it);
        under tensor parallelism the leading axis over the FSDP axes and the second (sequence)
        over the tp axis.

        ``jax.ShapeDtypeStruct`` leaves get the sharding attached (for lowering only)."""
        n_batch = self.mesh.size // self.tp_size
        for leaf in jax.tree.leaves(batch):
            shape = np.shape(leaf)
            if len(shape) == 0 or shape[0] % n_batch:
                raise ValueError(
                    f"batch leaf of shape {shape}: its leading (batch) axis must be divisible by the "
                    f"{n_batch} devices it is split over"
                )
            if self.tp_axis is not None and (len(shape) < 2 or shape[1] % self.tp_size):
                raise ValueError(
                    f"batch leaf of shape {shape}: under tp_axis={self.tp_axis!r} its second (sequence) "
                    f"axis is split over {self.tp_size} devices and must be divisible by them"
                )
        sharding = NamedSharding(self.mesh, self._batch_spec)
        if all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(batch)):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), batch)
        return jax.device_put(batch, sharding)

    @functools.cached_property
    def _batch_spec(self) -> PartitionSpec:
        if self.tp_axis is None:
            return PartitionSpec(self._axes)
        return PartitionSpec(self._fsdp_axes, self.tp_axis)

    def loss_and_grads(self, loss_fn: Callable, *, has_aux: bool = False) -> Callable:
        """``fn(state, batch) -> (loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``),
        jitted: the step's gradients, a dict like ``state.master`` (a unit's is
        ``[*stack, out_padded, in]`` fp32, rows sharded; a plain parameter's its own shape)."""
        grads_fn = self._grads_fn(loss_fn, has_aux)

        def fn(state, batch):
            loss, aux, grads = grads_fn(state, batch)
            return ((loss, aux), grads) if has_aux else (loss, grads)

        jitted = jax.jit(fn)

        def call(state, batch):
            self._check_live(state)
            return jitted(state, self.place_batch(batch))

        return call

    def train_step(self, loss_fn: Callable, tx: optax.GradientTransformation, *, has_aux: bool = False) -> Callable:
        """``step(state, batch) -> (state, loss)`` (``(state, loss, aux)`` with ``has_aux``):
        gradients, the ``tx`` update on the shards, re-quantization. Jitted; the input state is
        donated, and calling it again with a consumed state is a ``ValueError``. ``aux`` leaves
        are floating and averaged over devices, like the loss."""
        jitted = jax.jit(self._step(loss_fn, tx, has_aux), donate_argnums=0)

        def call(state, batch):
            self._check_live(state)
            return jitted(state, self.place_batch(batch))

        return call

    def lower_train_step(
        self,
        loss_fn: Callable,
        tx: optax.GradientTransformation,
        state: TrainState,
        batch: Any,
        *,
        has_aux: bool = False,
    ) -> jax.stages.Lowered:
        """``train_step`` lowered for ``state`` and ``batch`` (arrays, or ``abstract_state`` and
        ``jax.ShapeDtypeStruct`` leaves). ``.compile()`` gives a step to call as
        ``compiled(state, fsdp.place_batch(batch))`` (donating ``state``), its HLO text and its
        ``memory_analysis()``."""
        return jax.jit(self._step(loss_fn, tx, has_aux), donate_argnums=0).lower(state, self.place_batch(batch))

    def to_kernel(self, info: ParamInfo, master: jax.Array) -> jax.Array:
        """A unit's master (or its gradient) ``[*stack, out_padded, in]`` as the kernel's
        logical ``[*stack, in, out]`` (padding rows dropped); works on sharded arrays."""
        g = info.unit
        if info.tp == "column":  # [*stack, tp * out_padded, in]: each slice's padding dropped
            t = info.tp_size
            w = master.reshape(*master.shape[:-2], t, g.out_padded, master.shape[-1])[..., : g.out_features, :]
            return jnp.swapaxes(w.reshape(*master.shape[:-2], t * g.out_features, master.shape[-1]), -1, -2)
        return jnp.swapaxes(master[..., : g.out_features, :], -1, -2)

    def to_logical(self, info: ParamInfo, stored: jax.Array) -> jax.Array:
        """Any parameter's stored array (``TrainState.master`` entry, its gradient or an
        optimizer moment) in the parameter's own shape: ``to_kernel`` for a unit."""
        return self.to_kernel(info, stored) if info.unit is not None else stored

    def from_logical(self, info: ParamInfo, value: jax.Array, dtype=jnp.float32) -> jax.Array:
        """The inverse of ``to_logical``: a unit's kernel-shaped array as its padded master
        (zero rows), in ``dtype``."""
        value = jnp.asarray(value, dtype)
        if info.unit is None:
            return value
        w = jnp.swapaxes(value, -1, -2)  # [*stack, out, in]
        g, stack = info.unit, len(info.stack)
        pad = g.out_padded - g.out_features
        if info.tp == "column":  # each tp slice of rows padded on its own
            t = info.tp_size
            w = w.reshape(*w.shape[:-2], t, g.out_features, w.shape[-1])
            w = jnp.pad(w, [(0, 0)] * (stack + 1) + [(0, pad), (0, 0)])
            return w.reshape(*w.shape[:-3], t * g.out_padded, w.shape[-1])
        return jnp.pad(w, [(0, 0)] * stack + [(0, pad), (0, 0)])

    # -- internals -----------------------------------------------------------------------------

    def _check_live(self, state) -> None:
        if isinstance(state, TrainState) and any(
            isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(state)
        ):
            raise ValueError(
                "this state was consumed by an earlier step (a step donates its input state); "
                "use the state that step returned"
            )

    def _check_opt_state(self, tx, params, opt_state) -> None:
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

    def _step(self, loss_fn: Callable, tx, has_aux: bool) -> Callable:
        grads_fn = self._grads_fn(loss_fn, has_aux)
        quantize_local = self._quantize_local()

        def step(state: TrainState, batch):
            self.check_state(state, "state")
            loss, aux, grads = grads_fn(state, batch)
            params = self.param_tree(state.master)
            self._check_opt_state(tx, params, state.opt_state)
            updates, opt_state = tx.update(self.param_tree(grads), state.opt_state, params)
            master = self.from_param_tree(optax.apply_updates(params, updates))
            master = {k: v.astype(jnp.float32) for k, v in master.items()}
            quantized = quantize_local(master) if self.precision == "mxfp8" else None
            new_state = TrainState(master, quantized, state.frozen, opt_state, state.step + 1)
            new_state = lax.with_sharding_constraint(new_state, self._shardings(new_state))
            return (new_state, loss, aux) if has_aux else (new_state, loss)

        return step

    def _grads_fn(self, loss_fn: Callable, has_aux: bool) -> Callable:
        """Loss, aux and gradients of one step: a single shard_map over the mesh."""
        mesh, axes, n = self.mesh, self._axes, self.mesh.size
        master_specs = {p.name: self._spec(p) for p in self.trained}
        planes_specs = {p.name: UnitPlanes(*(self._spec(p),) * 4) for p in self.units}
        frozen_specs = {self.params[j].name: PartitionSpec() for j in self.frozen_params}
        replicated = [p.name for p in self.plain if p.shard_axis is None]

        def local(master, planes, frozen, batch):
            def loss_of(master):
                out = loss_fn(self._model_in_step(master, planes, frozen), batch)
                loss, aux = _split_loss(out, has_aux)
                return loss.astype(jnp.float32) / n, aux

            (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(master)
            for name in replicated:  # used whole on every device: sum the devices' parts
                grads[name] = lax.psum(grads[name], axes)
            aux = jax.tree.map(lambda a: lax.pmean(a, axes), aux)
            return lax.psum(loss, axes), aux, grads

        def grads_fn(state: TrainState, batch):
            planes = state.quantized
            fn = spmd.shard_map(
                local,
                mesh,
                (
                    master_specs,
                    None if planes is None else planes_specs,
                    frozen_specs,
                    jax.tree.map(lambda _: self._batch_spec, batch),
                ),
                (PartitionSpec(), PartitionSpec(), master_specs),
            )
            return fn(state.master, planes, state.frozen, batch)

        return grads_fn

    def _model_in_step(self, master, planes, frozen) -> nnx.Module:
        """The model as one device sees it inside the step: units hold ``ShardedKernel``s of this
        device's shards, plain parameters their gathered values, frozen ones their values."""
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
        full = self._gather_plain(master)
        for j in self.others:
            values[j] = full[self.params[j].name].astype(self.params[j].dtype)
        for j in self.frozen_params:
            values[j] = frozen[self.params[j].name]
        model = self._merge(values)
        nodes = dict(nnx.iter_graph(model))
        for path in self._owner_paths:
            intercept(nodes[path])
        return model

    def _gather_plain(self, master) -> dict[str, jax.Array]:
        """Every plain parameter whole on this device: the split ones by ONE fp32 all-gather of
        their concatenated local shards (its VJP: one reduce-scatter of their gradients)."""
        n = self.mesh.size
        out = {p.name: master[p.name] for p in self.plain if p.shard_axis is None}
        split = [p for p in self.plain if p.shard_axis is not None]
        if not split:
            return out
        flat = jnp.concatenate([master[p.name].reshape(-1) for p in split])
        full = lax.all_gather(flat, self._axes, tiled=True).reshape(n, -1)  # [device, local parts]
        offset = 0
        for p in split:
            local = master[p.name].shape
            size = int(np.prod(local))
            piece = full[:, offset : offset + size].reshape(n, *local)
            out[p.name] = jnp.moveaxis(piece, 0, p.shard_axis).reshape(p.shape)  # device-major
            offset += size
        return out

    def _spec(self, info: ParamInfo) -> PartitionSpec:
        stack = (None,) * len(info.stack)
        if info.tp == "column":  # rows: tp slices, each split over the FSDP axes
            fsdp = self._fsdp_axes if isinstance(self._fsdp_axes, tuple) else (self._fsdp_axes,)
            return PartitionSpec(*stack, (self.tp_axis, *fsdp), None)
        if info.tp == "row":  # rows over the FSDP axes, columns over tp
            return PartitionSpec(*stack, self._fsdp_axes, self.tp_axis)
        if info.unit is not None:
            return PartitionSpec(*stack, self._axes, None)
        if info.shard_axis is None:
            return PartitionSpec()
        return PartitionSpec(*(None,) * info.shard_axis, self._axes)

    _row_spec = _spec

    @functools.cached_property
    def _place_fn(self):
        trained = self.trained
        shardings = {p.name: self.master_sharding(p) for p in trained}
        rep = NamedSharding(self.mesh, PartitionSpec())
        frozen_shardings = {self.params[j].name: rep for j in self.frozen_params}

        def place(values, frozen):  # the step counter too: made on the devices, not sent
            master = {p.name: self.from_logical(p, values[p.name]) for p in trained}
            return master, {k: jnp.asarray(v) for k, v in frozen.items()}, jnp.zeros((), jnp.int32)

        return jax.jit(place, out_shardings=(shardings, frozen_shardings, rep))

    @functools.cached_property
    def _logical_fn(self):
        """``(master, frozen) -> values`` in parameter order, each whole (replicated), in the
        parameter's dtype."""
        rep = NamedSharding(self.mesh, PartitionSpec())

        def logical(master, frozen):
            values = []
            for p in self.params:
                if p.kind == "frozen":
                    values.append(frozen[p.name])
                else:
                    values.append(self.to_logical(p, master[p.name]).astype(p.dtype))
            return values

        return jax.jit(logical, out_shardings=[rep] * len(self.params))

    def _quantize_local(self) -> Callable:
        """``master -> {name: UnitPlanes}``: every device quantizes its own rows (no collective)."""
        units, rule = self.units, self.scale_rule
        specs = {p.name: self._spec(p) for p in units}

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
        fn = spmd.shard_map(local, self.mesh, (specs,), planes_specs)
        return lambda master: fn({p.name: master[p.name] for p in units})

    @functools.cached_property
    def _quantize_fn(self):
        return jax.jit(self._quantize_local())

    def _opt_shardings(self, shapes):
        """Optimizer leaves that belong to a parameter (``_owner_of``) are sharded like it; the
        rest (step counts, scalars) replicated. Init and step agree, so the step compiles once."""
        replicated = NamedSharding(self.mesh, PartitionSpec())

        def sharding(key_path, leaf):
            p = self._owner_of(key_path, leaf)
            return replicated if p is None else self.master_sharding(p)

        return jax.tree_util.tree_map_with_path(sharding, shapes)

    def _shardings(self, state: TrainState):
        master = {p.name: self.master_sharding(p) for p in self.trained}
        quantized = None
        if state.quantized is not None:
            quantized = {p.name: UnitPlanes(*(self.master_sharding(p),) * 4) for p in self.units}
        replicated = NamedSharding(self.mesh, PartitionSpec())
        frozen = {k: replicated for k in state.frozen}
        return TrainState(master, quantized, frozen, self._opt_shardings(state.opt_state), replicated)

    def _values_of(self, model: nnx.Module) -> list:
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
        _, params, _ = nnx.split(model, nnx.Param, ...)
        variables = jax.tree.leaves(params, is_leaf=_is_variable)
        found = tuple(
            (_path_names(k), tuple(v.get_value().shape))
            for k, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
        )
        want = tuple((p.path, p.shape) for p in self.params)
        if found != want:
            raise ValueError(f"model has parameters {found}, but this FSDP plan was built for {want}")
        return [v.get_value() for v in variables]

    def _merge(self, values) -> nnx.Module:
        return nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, values), self._rest)


def _split_axis(shape: tuple[int, ...], n: int) -> int | None:
    """The first axis of ``shape`` that ``n`` devices split evenly (None: none does)."""
    return next((a for a, d in enumerate(shape) if d > 0 and d % n == 0), None)


def _split_loss(out, has_aux: bool):
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"loss_fn must return (loss, aux) with has_aux=True, got {type(out).__name__}")
        loss, aux = out
        for leaf in jax.tree.leaves(aux):
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                raise ValueError(
                    "loss_fn's aux leaves must be floating (they are averaged over devices), "
                    f"got {jnp.result_type(leaf)}"
                )
    else:
        if isinstance(out, tuple):
            raise ValueError(
                "loss_fn returned a tuple; for (loss, aux) pass has_aux=True to train_step / loss_and_grads"
            )
        loss, aux = out, None
    if jnp.ndim(loss) != 0:
        raise ValueError(f"loss_fn must return a scalar (the mean loss of its batch), got shape {jnp.shape(loss)}")
    if not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
        raise ValueError(f"loss_fn must return a floating scalar, got {jnp.result_type(loss)}")
    return loss, aux


def _unit_kernels(model: nnx.Module) -> dict[tuple, tuple[tuple[int, ...], int, int, str | None]]:
    """Kernel path -> ``(stack, in, out, tensor-parallel role)`` for every layer whose kernel can
    be a unit (the role: the layer's ``tensor_parallel`` attribute, see ``flax_layers``)."""
    found = {}
    for path, node in nnx.iter_graph(model):
        kernel = getattr(node, "kernel", None) if isinstance(node, nnx.Module) else None
        if not isinstance(kernel, nnx.Variable):
            continue
        spec = unit_kernel_shape(node, tuple(kernel.get_value().shape))
        if spec is not None:
            found[(*tuple(path), "kernel")] = (*spec, getattr(node, "tensor_parallel", None))
    return found


def _path_names(path) -> tuple[str | int, ...]:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)
