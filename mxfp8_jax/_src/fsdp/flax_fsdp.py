"""Flax NNX training with MXFP8 FSDP weights: per-unit gathers, just in time, for any model.

One training step, with every mesh axis in the FSDP group and the batch split over it::

    master     per unit, fp32 rows of W [*stack, N_padded, K], sharded over the mesh
      |  quantize after every optimizer update: each device its own rows, no communication
    planes     per MXFP8 unit, E4M3 codes + E8M0 scales, rowwise and columnwise, sharded like it
      |  the loss on the WHOLE batch (``fsdp_eval``): every op as traced, on global arrays under
      |  jit (XLA's partitioner adds what the sharded batch needs); each op that reads a unit
      |  runs in a shard_map island on each device's part of the batch:
      |    forward:  all-gathers the unit's planes blocked along its contraction (8-bit),
      |              runs on the dequantized weight, drops it
      |    backward: all-gathers the other planes for the dgrad; dW (fp32) leaves through one
      |              reduce-scatter into the unit's master rows
      |  a plain parameter is gathered by the op that combines it with an activation (its
      |  gradient reduce-scattered back)
    optax update on the parameters' shards (elementwise: no communication)

What each parameter becomes is the plan's (``fsdp_plan``): with ``loss_fn`` and an
``example_batch``, the loss is traced and every parameter that a GEMM contracts or a lookup
reads is a unit, whatever layer holds it (``nnx.Linear``, ``nnx.LinearGeneral`` and so
``nnx.MultiHeadAttention``, ``nnx.Einsum``, ``nnx.Embed``, an ``nnx.Param`` under
``jnp.einsum`` / ``lax.dot_general`` / ``@``); without one, units are ``nnx.Linear`` and
``mxfp8_jax.flax.Linear`` kernels, found by class. Kernels stacked with ``nnx.vmap`` and run
by ``nnx.scan`` are gathered one layer per iteration inside the loop; a Python loop over an
``nnx.List`` gathers each layer's units when the layer runs (each gather waits for the layer's
input), so per-device memory is the shards, a unit or two being computed and the activations
the model saves, flat in depth either way. ``nnx.remat`` recomputes the gathers in the
backward.

The optimizer sees the model's trained parameters: ``tx`` is initialised and applied on nested
dicts with the paths of ``nnx.state(model, trainable).to_pure_dict()`` (``trainable``:
``nnx.Param`` by default), whose leaves are the sharded fp32 arrays (a unit's leaf is its
master ``W``, rows padded; a plain one has the parameter's own shape). Parameters ``trainable``
leaves out (a LoRA model's base kernels) are frozen: gathered like any unit, never updated,
no gradient computed or reduce-scattered for them. Masks and labels by path (``optax.adamw(mask=...)``,
``optax.multi_transform``, ``optax.masked``), elementwise transforms and global norms therefore
behave as on the unsharded model; the padding rows of a master hold zeros and receive zero
gradients. Elementwise updates run on each device's shard with no communication.

The loss, its gradients and ``aux`` are those of ``loss_fn(model, batch)`` on the whole
batch, as ``jax.jit`` gives them with a sharded batch: masked means, counts, batch statistics
and per-example metrics included. The model's other state (the RNG streams of
``nnx.Dropout``, BatchNorm's running averages) travels in the state: draws have the whole
batch's shapes (the unsharded model's masks, jax's threefry being partitionable), the counts
advance and the averages update as in the unsharded model.

Overlap (``prefetch=1``): a layer's gathers in a Python loop wait for the input of the layer
before it, not for their own op's, and a layer a scan slices is gathered without waiting for
the carried activation, so the gathers can run beside the compute of the layer before (on GPUs
with the latency-hiding scheduler and the collective pipeliner, flags the user sets in
``XLA_FLAGS``: docs/fsdp.md). The backward gathers of a Python loop still wait for their op's
cotangent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import filterlib
from jax.sharding import Mesh, NamedSharding

from mxfp8_jax._src.core import jaxprs, platforms, spmd
from mxfp8_jax._src.fsdp import fsdp_checkpoint
from mxfp8_jax._src.fsdp.flax_layers import unit_kernel_shape
from mxfp8_jax._src.fsdp.fsdp_plan import (
    Mesh1D,
    ParamInfo,
    check_rule,
    check_rule_matches,
    describe,
    plan_from_uses,
    uses_from_layers,
)
from mxfp8_jax._src.fsdp.fsdp_state import StateLayout, TrainState
from mxfp8_jax._src.fsdp.fsdp_step import Partition, Steps, check_loss_shape, dtype_of
from mxfp8_jax._src.fsdp.fsdp_trace import analyse, trace
from mxfp8_jax._src.fsdp.fsdp_unit import PRECISIONS, Gemms
from mxfp8_jax._src.numerics.format import BLOCK, ScaleRule
from mxfp8_jax._src.ops import mxfp8_gemm

# ------------------------------------------------------------------------------------------------
# State


# ------------------------------------------------------------------------------------------------
# The plan


class FSDP:
    """MXFP8 FSDP training of an NNX model over every axis of ``mesh``.

    ``FSDP(model, mesh, loss_fn=..., example_batch=...)`` traces the loss on the example to
    find how each parameter is read (its values are not used), and plans what each becomes
    (``print(fsdp)`` shows it). Then::

        state = fsdp.init(model, tx)           # shard, quantize, optimizer state
        step = fsdp.train_step(loss_fn, tx)    # jitted; donates the state
        state, loss = step(state, batch)
        model = fsdp.gather(state)             # an ordinary nnx module again

    Args:
      model: the ``nnx.Module`` (concrete or from ``nnx.eval_shape``).
      mesh: every axis is an FSDP axis (but ``tp_axis``); the batch is split over all of them.
      precision: ``"mxfp8"`` or ``"bf16"``: the units' default precision (projections;
        embeddings and output heads are bf16 by default).
      scale_rule: the MXFP8 scale rule (``"rceil"``, ``"floor"``).
      tp_axis: a mesh axis for tensor parallelism of the layers marked by ``tensor_parallel``.
      loss_fn: ``loss_fn(model, batch)``, traced on ``example_batch`` to find the units by
        operation (with ``example_batch``; the same loss the steps run).
      example_batch: a batch as the steps take it (arrays or ``jax.ShapeDtypeStruct``s; only
        shapes and dtypes are read), every leaf's leading axis split over the mesh; the steps
        take batches of its structure.
      precision_by_path: per-parameter precision, overriding the defaults: a mapping of
        regular expressions on the parameter name (``"blocks/attn/q/kernel"``) to
        ``"mxfp8"``, ``"bf16"`` or ``"plain"`` (the first that matches wins), or a callable
        ``(name, role) -> precision | None`` (role: ``"projection"``, ``"embedding"``,
        ``"head"``).
      trainable: an nnx filter naming the variables the optimizer trains, as
        ``nnx.Optimizer(wrt=)`` takes it (a Variable type such as ``nnx.LoRAParam``, a tuple,
        ``nnx.Any(...)``, a predicate ``(path, variable) -> bool``); it must match a floating
        variable. Every other ``nnx.Param``, and every other floating variable that a GEMM or
        lookup of the traced loss reads and the loss does not assign (a frozen base kernel held
        in a custom ``nnx.Variable``), is a frozen parameter: a frozen unit when the loss reads
        it as one (stored in its own dtype, rows sharded, MXFP8 planes quantized once, no
        gradient, no optimizer state), else kept whole. Variables the loss assigns (BatchNorm's
        statistics, RNG counts) stay the model's other state.
      prefetch: how many layers ahead each unit's forward gather starts: with ``1`` (default)
        the gathers of layer ``l`` of a Python loop over layers (``blocks/3/...``) wait for the
        input of layer ``l - 1``, so they run while it computes, and a layer a scan slices is
        gathered with no wait on the loop's activation (XLA may run it beside the iteration's
        GEMMs; XLA:GPU's collective pipeliner can move it one iteration ahead). ``0``: each
        gather waits for the input of the op that reads it. Values and gradients are the same
        either way (docs/fsdp.md, "Overlap").
      gemm: how MXFP8 units multiply: ``"dequantized"`` (default: the gathered planes are
        dequantized exactly and the layer's own GEMM runs in its dtype) or ``"mxfp8"``
        (Transformer Engine's MXFP8BlockScaling recipe: the forward, dgrad and wgrad GEMMs take
        E4M3 operands blocked along their own contraction, the weight's the gathered planes;
        bf16 units keep their bf16 GEMMs).
      gemm_path: with ``gemm="mxfp8"``: ``"auto"`` (the native block-scaled GEMM on GPUs that
        multiply MXFP8 blocks, CUDA 10.0+ and gfx950; ``"bf16"`` on other GPUs; ``"exact"`` on
        CPUs), ``"native"`` (an error where the platform has none), ``"bf16"`` (operands
        dequantized exactly to bf16, fp32 accumulation) or ``"exact"`` (the same in fp32).
        ``gemm_paths()`` lists what ``"auto"`` takes where the devices are not known.
      backward_gemm: how the dgrad and wgrad GEMMs of units multiply (but MXFP8 GEMMs):
        ``"layer"``: operands in the forward's dtype (a bf16 layer's: bf16, the cotangent
        rounded to it), fp32 accumulation, as XLA's own backward; ``"fp32"``: fp32 operands
        (exact products of bf16 and dequantized MXFP8 values); ``"auto"`` (default): fp32
        where the step is lowered for CPUs, ``"layer"`` for GPUs.

    Platform-dependent choices follow the program, never this process's default backend: they
    are made where the step is lowered for its platform (``lax.platform_dependent``), or from
    the mesh's devices (the MXFP8 GEMM path on GPUs, by their compute capability). A mesh of
    CUDA devices, real or the compile-only devices of ``jax.experimental.topologies``, gets the
    GPU step from a CPU host too (``mxfp8-jax gpu-compile``).

    ``loss_fn(model, batch) -> scalar`` (with ``has_aux=True``: ``-> (scalar, aux)``, any
    pytree) is evaluated on the whole batch: the step's loss, gradients and ``aux`` are the
    unsharded model's (to summation order), whatever the loss does with the batch. It must not
    name the FSDP axes (``lax.psum``, ``axis_name=``): statistics are global already. The model
    may use ``nnx.scan``, ``nnx.vmap``, ``nnx.remat`` and Python loops freely. ``tx`` sees the
    parameters by path (``param_tree``).
    """

    def __init__(
        self,
        model: nnx.Module,
        mesh: Mesh,
        *,
        precision: str = "mxfp8",
        scale_rule: str = "rceil",
        tp_axis: str | None = None,
        loss_fn: Callable | None = None,
        example_batch: Any = None,
        precision_by_path=None,
        gemm: str = "dequantized",
        gemm_path: str = "auto",
        trainable: Any = nnx.Param,
        prefetch: int = 1,
        backward_gemm: str = "auto",
    ) -> None:
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
        if (loss_fn is None) != (example_batch is None):
            raise ValueError(
                "loss_fn and example_batch go together: the plan traces loss_fn(model, example_batch) "
                "to find the parameters GEMMs and lookups read (give both, or neither for units by layer class)"
            )
        check_rule(precision_by_path)
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(
                f"prefetch={prefetch!r} must be an int >= 0 (layers ahead; 0: each gather waits for its op)"
            )
        jaxprs.warn_if_untested()
        self.mesh = Mesh(mesh.devices, mesh.axis_names)  # Auto axes: shard_map does the placing
        self.platform = platforms.of_mesh(self.mesh)
        self.precision = precision
        self.scale_rule = ScaleRule.parse(scale_rule).value
        self.gemm, self.gemm_path = gemm, gemm_path
        capability = platforms.of_mesh_capability(self.mesh)
        mode = mxfp8_gemm.check_mode(gemm, gemm_path, scale_rule, self.platform, capability)
        gemms = Gemms(backward_gemm, mode)
        self.backward_gemm, self._gemms, self._capability = backward_gemm, gemms, capability
        self.precision_by_path = precision_by_path
        self.trainable = trainable
        trained_paths, params_paths, candidates, loose = _select(model, trainable, traced=loss_fn is not None)
        partition = Partition(model, params_paths | candidates)
        self._axes = spmd.axis_group(self.mesh.axis_names)  # all axes, innermost first
        n = self.mesh.size
        self.tp_axis, self.tp_size = tp_axis, 1
        self._fsdp_axes, n_fsdp = self._axes, n
        if tp_axis is not None:
            if tp_axis not in mesh.axis_names or len(mesh.axis_names) < 2:
                raise ValueError(
                    f"tp_axis={tp_axis!r} must be one axis of a mesh with at least one other (FSDP) "
                    f"axis; the mesh has {tuple(mesh.axis_names)}"
                )
            self.tp_size = int(mesh.shape[tp_axis])
            self._fsdp_axes = spmd.axis_group([a for a in mesh.axis_names if a != tp_axis])
            n_fsdp = n // self.tp_size
        found, rest_avals = self._found(model, partition)
        self._steps = Steps(
            self.mesh,
            axes=self._axes,
            fsdp_axes=self._fsdp_axes,
            tp_axis=tp_axis,
            tp_size=self.tp_size,
            partition=partition,
            rest_avals=rest_avals,
            gemms=gemms,
        )
        self.traced = loss_fn is not None
        self._jitted: dict[tuple, Callable] = {}
        if self.traced:
            self._steps.check_batch(example_batch, "example_batch")
            batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), dtype_of(a)), example_batch)
            forbidden = self._steps.fsdp_axis_sizes

            def uses_of(partition, found, rest_avals, assigned=None):
                avals = [jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype in found]
                traceable = self._steps.traceable(loss_fn, partition, assigned)
                closed, out_shape = trace(traceable, avals, list(rest_avals), batch, forbidden=forbidden)
                check_loss_shape(out_shape[0])
                return analyse(closed, len(avals))

            assigned: list[bool] = []
            uses = uses_of(partition, found, rest_avals, assigned)
            kept = _read_as_weights(found, uses, assigned, trainable, loose, candidates)
            if kept != candidates:  # the other candidates are the model's other state: plan without them
                partition = Partition(model, params_paths | kept)
                found, rest_avals = self._found(model, partition)
                self._steps.partition, self._steps.rest_avals = partition, rest_avals
                uses = uses_of(partition, found, rest_avals)
            self._steps.example_tree = jax.tree.structure(example_batch)
        else:
            uses = uses_from_layers(found, _unit_kernels(model))
        rest = jax.tree_util.tree_flatten_with_path(partition.split(model)[2])[0]
        self.rest_names = tuple("/".join(map(str, fsdp_checkpoint.path_names(k))) for k, _ in rest)
        self._rest_avals = rest_avals
        tp = (tp_axis, self.tp_size, Mesh1D(n_fsdp, self._fsdp_axes)) if tp_axis is not None else None
        self.params = plan_from_uses(
            found,
            uses,
            Mesh1D(n_fsdp, self._fsdp_axes),  # under tp, units outside tp layers live in the FSDP group
            precision=precision,
            rule=precision_by_path,
            tp_roles=_tp_roles(model),
            tp=tp,
            frozen=frozenset(j for j, (path, _, _) in enumerate(found) if path not in trained_paths),
        )
        check_rule_matches(precision_by_path, [p.name for p in self.params])
        self._layout = StateLayout(
            self.params,
            self.mesh,
            axes=self._axes,
            fsdp_axes=self._fsdp_axes,
            tp_axis=tp_axis,
            tp_size=self.tp_size,
            rest_avals=self._rest_avals,
            precision=precision,
            scale_rule=self.scale_rule,
        )
        self._steps.layout, self._steps.traced = self._layout, self.traced
        self.prefetch = self._steps.prefetch = prefetch
        if not self.units:
            raise ValueError(
                "model has no eligible weight: "
                + (
                    "the loss contracts no parameter in a GEMM and looks none up"
                    if self.traced
                    else f"without an example batch FSDP keeps as units the kernels of flax.nnx.Linear (default "
                    f"dot_general) and mxfp8_jax.flax.Linear layers whose in and out features are both multiples "
                    f"of {BLOCK}; give loss_fn= and example_batch= to find units by operation"
                )
                + f"; parameters found: {[(p.name, p.shape) for p in self.params]}"
            )

    # -- what the plan holds ---------------------------------------------------------------------

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        """The plan as a table: every parameter, what it became and why, its stored bytes per
        device and bytes gathered per step; totals.

        Returns:
          The table as a multi-line ``str`` (what ``print(fsdp)`` prints).
        """
        table = describe(self.params, self.mesh.size // self.tp_size, traced=self.traced, trainable=self.trainable)
        return f"{table}\n{self._gemm_line()}"

    def _gemm_line(self) -> str:
        """How the units multiply on this mesh's platform (the last line of ``print(fsdp)``)."""
        where = f"{self.platform} mesh" + (f", compute capability {self._capability}" if self._capability else "")
        backward = {
            "auto": "fp32 where lowered for CPUs, the layer's dtype (fp32 accumulation) for GPUs",
            "fp32": "fp32 operands",
            "layer": "the layer's dtype, fp32 accumulation",
        }[self.backward_gemm]
        line = f"GEMMs ({where}): forward in the layer's dtype; dgrad and wgrad: {backward}"
        if self._gemms.mxfp8 is not None:
            path = self._gemms.mxfp8.path
            line += f"; MXFP8 units' GEMMs in MXFP8, path {path}" + (
                " (by lowering platform)" if path == "auto" else ""
            )
        return line

    @property
    def units(self) -> tuple[ParamInfo, ...]:
        """The units (MXFP8 and bf16), in parameter order."""
        return tuple(p for p in self.params if p.is_unit)

    @property
    def mxfp8_units(self) -> tuple[ParamInfo, ...]:
        """The MXFP8 units, in parameter order."""
        return tuple(p for p in self.params if p.kind == "mxfp8")

    @property
    def plain(self) -> tuple[ParamInfo, ...]:
        """The plain (fp32, not units) trained parameters, in parameter order."""
        return tuple(p for p in self.params if p.kind == "plain")

    @property
    def frozen(self) -> tuple[ParamInfo, ...]:
        """The parameters the optimizer does not train, in parameter order: frozen units
        (``trained=False``) and kind ``"frozen"`` (non-floating, or not read as a unit)."""
        return tuple(p for p in self.params if not p.trained)

    @property
    def trained(self) -> tuple[ParamInfo, ...]:
        """Every parameter the optimizer updates (units and plain), in parameter order."""
        return tuple(p for p in self.params if p.trained)

    @property
    def weight_elements(self) -> int:
        """Elements of the units' parameters (what the model holds)."""
        return sum(int(np.prod(p.shape)) for p in self.units)

    @property
    def plain_elements(self) -> int:
        """Elements of the plain parameters."""
        return sum(int(np.prod(p.shape)) for p in self.plain)

    @property
    def stored_elements(self) -> int:
        """Elements of the units' masters as stored, rows padded so every device holds the same
        number of rows (the elements a gather moves per element of this)."""
        return sum(int(np.prod(p.stored_shape)) for p in self.units)

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
        return self._layout.master_sharding(info)

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
        return self._layout.logical_sharding(info)

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
        return self._layout.param_tree(arrays)

    def from_param_tree(self, tree: dict) -> dict[str, Any]:
        """The inverse of ``param_tree``.

        Args:
          tree: nested dicts holding a value at every trained parameter's path (as
            ``param_tree`` builds them, e.g. after ``optax.apply_updates``); other entries are
            ignored.

        Returns:
          ``{name: value}`` for every trained parameter, in parameter order.
        """
        return self._layout.from_param_tree(tree)

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
        return self._layout.owner_of(key_path, leaf)

    # -- state ---------------------------------------------------------------------------------

    def init(self, model: nnx.Module, tx: optax.GradientTransformation) -> TrainState:
        """Shards ``model``'s parameters, quantizes the MXFP8 units, initialises ``tx``.

        The parameters may be host arrays or ``jax.Array``s with any sharding (e.g. created
        under ``jax.jit`` with ``out_shardings``, across several processes): they are placed by
        one jitted program, device to device, with no host gather.

        Args:
          model: the model this plan was built for, with its values: the same parameter paths and
            shapes and as many values of other state (``ValueError`` otherwise).
          tx: the optimizer, initialised on ``param_tree(master)``.

        Returns:
          A ``TrainState``: the masters sharded as ``master_sharding`` says, the planes
          quantized from them, the frozen units' rows in their own dtype sharded like masters
          (their planes quantized once), the other frozen parameters and other state
          replicated, the optimizer leaves that belong to a parameter (``owner_of``) sharded
          like it and the others replicated, ``step`` 0.
        """
        values, rest = self._values_of(model)
        master, frozen, rest, step = self._layout.place_fn(
            {p.name: values[j] for j, p in enumerate(self.params) if p.trained},
            {p.name: values[j] for j, p in enumerate(self.params) if not p.trained},
            rest,
        )
        quantized = self._layout.quantize_fn(master, frozen)
        params = self.param_tree(master)
        opt_shardings = self._layout.opt_shardings(jax.eval_shape(tx.init, params))
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
        state = TrainState(master, quantized, frozen, tuple(rest), opt_state, step)
        return jax.device_put(state, self._layout.shardings(state))

    def abstract_state(self, tx: optax.GradientTransformation) -> TrainState:
        """The ``TrainState`` that ``init`` would return, as ``jax.ShapeDtypeStruct``s with their
        shardings: for ``lower_train_step`` (memory analysis, HLO) without building the model.

        Args:
          tx: the optimizer ``init`` would be given.

        Returns:
          A ``TrainState`` whose leaves are ``jax.ShapeDtypeStruct``s with shapes, dtypes and
          shardings as ``init`` makes them.
        """
        return self._layout.abstract_state(tx)

    def gather(self, state: TrainState) -> nnx.Module:
        """The model with the full fp32 master parameters (one all-gather per array) and the
        state's RNG streams.

        Args:
          state: a ``TrainState`` of this plan (``check_state``).

        Returns:
          An ``nnx.Module`` of the plan's model: every parameter in its own shape and dtype,
          whole (replicated) on every device; the other state from ``state.rest``.
        """
        self.check_state(state, "state")
        return self._steps.merge(self._layout.logical_fn(state.master, state.frozen), list(state.rest))

    def check_state(self, state: Any, argname: str = "state") -> None:
        """Raises ``ValueError`` unless ``state`` is a ``TrainState`` of this plan: the same
        parameter names, stored shapes and dtypes, planes exactly for the MXFP8 units.

        Args:
          state: the value to check; ``TypeError`` when it is not a ``TrainState``.
          argname: the name the error messages give it.
        """
        return self._layout.check_state(state, argname)

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, state: TrainState, directory, *, async_save: bool = False, overwrite: bool = False):
        """Writes ``state`` to ``directory`` as LOGICAL tensors, shard by shard (orbax).

        Stored: every trained parameter by its model path in its own shape (a unit as the
        parameter, padding dropped), every optimizer leaf that belongs to a parameter in that
        parameter's shape under ``opt/<optimizer path>/<parameter path>`` (the others, e.g. step
        counts, as they are), the frozen parameters, the model's other state (RNG streams), the
        step, the precision of each parameter and the scale rule. Never the mesh, the padding
        or the planes (recomputed on ``restore``), so a checkpoint restores onto any mesh.
        Every process must call it.

        Args:
          state: a ``TrainState`` of this plan (``check_state``) not consumed by a step.
          directory: a path that does not exist yet (unless ``overwrite``).
          async_save: return once the device buffers are copied out; the files are written in
            the background.
          overwrite: replace an existing checkpoint at ``directory``.

        Returns:
          A ``SaveHandle``; with ``async_save`` call ``.wait()`` on it before relying on the
          files.
        """
        self.check_state(state, "state")
        self._layout.check_live(state)
        return fsdp_checkpoint.save(self, state, directory, async_save=async_save, overwrite=overwrite)

    def restore(self, directory, tx: optax.GradientTransformation) -> TrainState:
        """The ``TrainState`` saved in ``directory``, placed on this plan's mesh: parameters and
        optimizer moments read shard by shard into their shardings, planes re-quantized.

        Before any data moves, a ``ValueError`` names every path that does not fit this plan
        and ``tx``: a missing or extra parameter, another shape or dtype, another optimizer
        structure; a checkpoint whose parameters were saved with other precisions or another
        scale rule is refused too.

        Args:
          directory: a checkpoint written by ``FSDP.save``, on any mesh.
          tx: the optimizer to go on training with; its state must have the saved structure.

        Returns:
          A ``TrainState`` sharded as ``init`` shards one, with the saved parameters, optimizer
          state, other state and step, and planes quantized from the restored masters.
        """
        master, frozen, rest, opt_state, step = fsdp_checkpoint.restore(self, directory, self.abstract_state(tx))
        state = TrainState(master, self._layout.quantize_fn(master, frozen), frozen, tuple(rest), opt_state, step)
        return jax.device_put(state, self._layout.shardings(state))

    # -- steps ---------------------------------------------------------------------------------

    def place_batch(self, batch: Any) -> Any:
        """``batch`` with every leaf's leading axis split over the mesh (as a step takes it);
        under tensor parallelism the leading axis over the FSDP axes and the second (sequence)
        over the tp axis.

        ``jax.ShapeDtypeStruct`` leaves get the sharding attached (for lowering only).

        Args:
          batch: a pytree of arrays, or of ``jax.ShapeDtypeStruct``s only; every leaf's leading
            axis divisible by the devices it is split over (``mesh.size / tp_size``) and, under
            tensor parallelism, its second axis by ``tp_size`` (``ValueError`` otherwise).

        Returns:
          The same tree: ``jax.ShapeDtypeStruct``s with the ``NamedSharding`` attached, or the
          arrays placed with it (``jax.device_put``).
        """
        return self._steps.place_batch(batch)

    def loss_and_grads(self, loss_fn: Callable, *, has_aux: bool = False) -> Callable:
        """``fn(state, batch) -> (loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``),
        jitted: the step's gradients, a dict like ``state.master`` (a unit's is
        ``[*stack, N_padded, K]`` fp32, rows sharded; a plain parameter's its own shape).

        Args:
          loss_fn: ``loss_fn(model, batch)``, as the class docstring describes.
          has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back as the loss computed it
            on the whole batch (averaged over the tp ranks under ``tp_axis``, floating there).

        Returns:
          ``fn(state, batch)``. The loss is ``loss_fn``'s on the whole batch (fp32); the state is not
          donated, and a state consumed by a step is a ``ValueError``. The batch goes through
          ``place_batch``. Asking again for the same ``loss_fn`` and ``has_aux`` returns a
          function that reuses the compiled program.
        """

        def make():
            grads_fn = self._steps.grads_fn(loss_fn, has_aux)

            def fn(state, batch):
                loss, aux, grads, _ = grads_fn(state, batch)
                return ((loss, aux), grads) if has_aux else (loss, grads)

            return jax.jit(fn, compiler_options=self._steps.compiler_options)

        jitted = self._jit(("loss_and_grads", loss_fn, has_aux), make)

        def call(state, batch):
            self._layout.check_live(state)
            return jitted(state, self.place_batch(batch))

        return call

    def eval_step(self, loss_fn: Callable) -> Callable:
        """``fn(state, batch) -> loss``, jitted: the loss the training step would see (the same
        gathers, precisions and GEMMs), on the whole batch; no backward is traced (so the loss
        may read parameters inside a ``lax.while_loop``, which a training step refuses), the
        state is not donated.

        Args:
          loss_fn: ``loss_fn(model, batch) -> scalar``, as the class docstring describes (no
            ``aux``).

        Returns:
          ``fn(state, batch)`` returning the loss as an fp32 scalar. The batch goes through
          ``place_batch``; a state consumed by a step is a ``ValueError``.
        """

        def make():
            grads_fn = self._steps.grads_fn(loss_fn, False, differentiate=False)
            return jax.jit(
                lambda state, batch: grads_fn(state, batch)[0], compiler_options=self._steps.compiler_options
            )

        jitted = self._jit(("eval_step", loss_fn), make)

        def call(state, batch):
            self._layout.check_live(state)
            return jitted(state, self.place_batch(batch))

        return call

    def train_step(self, loss_fn: Callable, tx: optax.GradientTransformation, *, has_aux: bool = False) -> Callable:
        """``step(state, batch) -> (state, loss)`` (``(state, loss, aux)`` with ``has_aux``):
        gradients, the ``tx`` update on the shards, re-quantization. Jitted; the input state is
        donated, and calling it again with a consumed state is a ``ValueError``. ``aux`` is as
        ``loss_fn`` computed it on the whole batch.

        Args:
          loss_fn: ``loss_fn(model, batch)``, as the class docstring describes.
          tx: the optimizer the state was initialised with (``init``); another optimizer state
            structure is a ``ValueError``.
          has_aux: ``loss_fn`` returns ``(loss, aux)``.

        Returns:
          ``step(state, batch)``: the new state has the updated masters, their planes re-quantized,
          the new optimizer and other state, and ``state.step + 1``. The loss is ``loss_fn``'s on
          the whole batch (fp32). The batch goes through ``place_batch``. Asking again for the same ``loss_fn``,
          ``tx`` and ``has_aux`` returns a step that reuses the compiled program.
        """
        jitted = self._jit(("train_step", loss_fn, tx, has_aux), lambda: self._steps.train_jit(loss_fn, tx, has_aux))

        def call(state, batch):
            self._layout.check_live(state)
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
        ``memory_analysis()``.

        Args:
          loss_fn, tx, has_aux: as for ``train_step``.
          state: a ``TrainState`` of this plan, or ``abstract_state(tx)``.
          batch: a batch as ``place_batch`` takes it (arrays or ``jax.ShapeDtypeStruct``s).

        Returns:
          The ``jax.stages.Lowered`` step, not yet compiled.
        """
        return self._steps.train_jit(loss_fn, tx, has_aux).lower(state, self.place_batch(batch))

    def _jit(self, key: tuple, make: Callable) -> Callable:
        """The jitted function made for ``key`` (what, and the loss, optimizer and flags it was
        made for), made once: asking ``train_step``/``loss_and_grads``/``eval_step`` again for
        the same loss reuses its compiled programs instead of tracing and compiling anew."""
        if key not in self._jitted:
            self._jitted[key] = make()
        return self._jitted[key]

    # -- parameter shapes ----------------------------------------------------------------------

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
        return self._layout.to_logical(info, stored)

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
        return self._layout.from_logical(info, value, dtype)

    # -- internals -----------------------------------------------------------------------------

    def _values_of(self, model: nnx.Module) -> tuple[list, list]:
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
        _, params, rest = self._steps.partition.split(model)
        variables = jax.tree.leaves(params, is_leaf=_is_variable)
        found = tuple(
            (fsdp_checkpoint.path_names(k), tuple(v.get_value().shape))
            for k, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
        )
        want = tuple((p.path, p.shape) for p in self.params)
        if found != want:
            raise ValueError(f"model has parameters {found}, but this FSDP plan was built for {want}")
        rest = jax.tree.leaves(rest)
        if len(rest) != len(self._rest_avals):
            raise ValueError(
                f"model has {len(rest)} values of state other than the plan's parameters, the plan "
                f"{len(self._rest_avals)}"
            )
        return [v.get_value() for v in variables], rest

    @staticmethod
    def _found(model: nnx.Module, partition: Partition) -> tuple[list, tuple]:
        """``(path, shape, dtype)`` of each parameter of ``partition``, and the avals of the rest."""
        _, params, rest = partition.split(model)
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
        found = [
            (fsdp_checkpoint.path_names(k), tuple(np.shape(v.get_value())), jnp.dtype(v.get_value().dtype))
            for k, v in flat
        ]
        rest_avals = tuple(jax.ShapeDtypeStruct(np.shape(v), v.dtype) for v in jax.tree.leaves(rest))
        return found, rest_avals


def _select(model: nnx.Module, trainable, *, traced: bool) -> tuple[frozenset, frozenset, frozenset, frozenset]:
    """``(trained, parameters, candidates, variables)``: the paths of the floating variables
    ``trainable`` matches; of those and every ``nnx.Param``; of the other floating variables,
    which a traced loss may read as frozen weights (none without a trace); of the trained ones
    that are not ``nnx.Param``s."""
    try:
        filterlib.to_predicate(trainable)
    except (TypeError, ValueError):
        raise TypeError(
            f"trainable={trainable!r} is not an nnx filter (a Variable type such as nnx.LoRAParam, a tuple of "
            f"filters, nnx.Any(...), or a predicate (path, variable) -> bool)"
        ) from None
    floating = lambda v: jnp.issubdtype(v.get_value().dtype, jnp.floating)
    variables = [(tuple(path), v) for path, v in nnx.to_flat_state(nnx.state(model))]
    matched = {tuple(path) for path, _ in nnx.to_flat_state(nnx.state(model, trainable))}
    trained = frozenset(path for path, v in variables if path in matched and floating(v))
    if not trained:
        shown = sorted({type(v).__name__ for _, v in variables if floating(v)})
        raise ValueError(
            f"trainable={trainable!r} matches no floating variable of the model, so the optimizer would train "
            f"nothing; the model's floating variables are of the types {shown} (give the filter "
            "nnx.Optimizer(wrt=) would take: nnx.Param, nnx.LoRAParam, ...)"
        )
    params = trained | {path for path, v in variables if isinstance(v, nnx.Param)}
    candidates = frozenset(path for path, v in variables if traced and path not in params and floating(v))
    loose = frozenset(path for path, v in variables if path in trained and not isinstance(v, nnx.Param))
    return trained, frozenset(params), candidates, loose


def _read_as_weights(found, uses, assigned, trainable, variables: frozenset, candidates: frozenset) -> frozenset:
    """The ``candidates`` (traced as parameters) that a GEMM or lookup of the loss reads and that
    the loss does not assign: frozen weights. A trained variable other than an ``nnx.Param``
    (in ``variables``) that the loss assigns is model state, not a weight: a ``ValueError``."""
    kept = set()
    for j, (path, _, _) in enumerate(found):
        path = tuple(path)
        if path in variables and assigned[j]:
            raise ValueError(
                f"trainable={trainable!r} matches {'/'.join(map(str, path))}, which the loss assigns (model state "
                "such as BatchNorm's statistics, updated by the forward pass, not by the optimizer); leave it out "
                "of the trainable filter"
            )
        if path in candidates and not assigned[j] and any(u.kind in ("gemm", "lookup") for u in uses.by_param[j]):
            kept.add(path)
    return frozenset(kept)


def _unit_kernels(model: nnx.Module) -> dict[tuple, tuple[tuple[int, ...], int, int]]:
    """Kernel path -> ``(stack, in, out)`` for every layer whose kernel is a unit by class."""
    found = {}
    for path, node in nnx.iter_graph(model):
        kernel = getattr(node, "kernel", None) if isinstance(node, nnx.Module) else None
        if not isinstance(kernel, nnx.Variable):
            continue
        spec = unit_kernel_shape(node, tuple(kernel.get_value().shape))
        if spec is not None and jnp.issubdtype(kernel.get_value().dtype, jnp.floating):
            found[(*tuple(path), "kernel")] = spec
    return found


def _tp_roles(model: nnx.Module) -> dict[tuple, str]:
    """Kernel path -> tensor-parallel role, for the layers ``tensor_parallel`` marked."""
    roles = {}
    for path, node in nnx.iter_graph(model):
        role = getattr(node, "tensor_parallel", None) if isinstance(node, nnx.Module) else None
        if role is not None and isinstance(getattr(node, "kernel", None), nnx.Variable):
            roles[(*tuple(path), "kernel")] = role
    return roles


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)
