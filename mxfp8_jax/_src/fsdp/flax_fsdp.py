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

import functools
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from mxfp8_jax._src.fsdp import fsdp_checkpoint, fsdp_table
from mxfp8_jax._src.fsdp.fsdp_discover import make_plan, values_of
from mxfp8_jax._src.fsdp.fsdp_plan import Plan
from mxfp8_jax._src.fsdp.fsdp_state import StateLayout, TrainState
from mxfp8_jax._src.fsdp.fsdp_step import Steps


def _forward(owner: str, member) -> Any:
    """A public member of ``FSDP`` that is ``member`` of its plan (``owner="_plan"``), layout
    (``"_layout"``) or steps (``"_steps"``): written and documented once, there."""
    if isinstance(member, property):
        get = member.fget
        return property(lambda self: get(getattr(self, owner)), doc=member.__doc__)

    @functools.wraps(member)
    def call(self, *args, **kwargs):
        return member(getattr(self, owner), *args, **kwargs)

    return call


def _field(name: str, doc: str) -> property:
    """A read-only attribute of ``FSDP``: the plan's field ``name`` (dotted: through its topology)."""

    def get(self):
        value = self._plan
        for part in name.split("."):
            value = getattr(value, part)
        return value

    return property(get, doc=doc)


class FSDP:
    """MXFP8 FSDP training of an NNX model, or of a model given as a pytree (an Equinox module,
    dicts of arrays), over every axis of ``mesh``.

    ``FSDP(model, mesh, loss_fn=..., example_batch=...)`` traces the loss on the example to
    find how each parameter is read (its values are not used), and plans what each becomes
    (``print(fsdp)`` shows it). Then::

        state = fsdp.init(model, tx)           # shard, quantize, optimizer state
        step = fsdp.train_step(loss_fn, tx)    # jitted; donates the state
        state, loss = step(state, batch)
        model = fsdp.gather(state)             # an ordinary nnx module again

    Args:
      model: the ``nnx.Module`` (concrete or from ``nnx.eval_shape``), or a pytree: its floating
        array leaves are the parameters, named by their key paths (``blocks/up/weight``), its
        other array leaves its other state (counters, RNG keys), every other leaf static (an
        Equinox module's functions and numbers), kept as it is. A pytree model needs
        ``loss_fn`` and ``example_batch``, and takes no ``tp_axis``.
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
      trainable: for a pytree model, a predicate ``(path, leaf) -> bool`` (path: a tuple of
        names and indices) naming the leaves the optimizer trains (default: every floating
        leaf); the others are frozen as below. For an NNX model, an nnx filter naming the
        variables the optimizer trains, as ``nnx.Optimizer(wrt=)`` takes it (a Variable type
        such as ``nnx.LoRAParam``, a tuple, ``nnx.Any(...)``, a predicate ``(path, variable) ->
        bool``); it must match a floating
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
      keep_layers: in a scan over rematerialised layers (with ``prefetch``), how many of the
        last layers keep every weight their forward gathered for their backward, which then
        gathers none of them again for its recomputed forward, nor (32x32 planes, bf16
        weights: bytes of both directions) for its dgrads. Each kept layer holds its gathered
        8-bit planes (bf16 weights) from its forward to its backward: ``1`` (default) keeps the
        step within two layers' planes of ``prefetch=0``'s memory; ``0`` keeps only the first
        weights the forward's last iteration prefetched. Values and gradients are the same for
        every value.
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
      model_constraints: the model's own sharding constraints on activations
        (``with_sharding_constraint``, MaxText's logical constraints) that replicate what the
        step splits over the batch: ``"keep"`` (default: honoured, as ``jax.jit`` would: XLA
        all-gathers the activation there and the ops after it run on the whole batch on every
        device) or ``"drop"`` (ignored: the batch split carries through them). The plan's table
        lists them, and a ``keep`` plan warns once when it finds any. Constraints that split,
        or that name only other axes, are always kept.
      xla_costs: how XLA:GPU's scheduler prices the steps compiled for GPUs: ``"corrected"``
        (default: each step is compiled twice, the second time with a profile that prices two
        kinds of instruction its cost model gets far off, so that the scheduler runs the
        weight gathers beside the GEMMs; docs/fsdp.md, "Overlap") or ``"xla"`` (compiled once,
        as ``jax.jit`` would). A profile of the user's own (XLA's
        ``xla_gpu_pgle_profile_file_or_directory_path``, jax's ``jax_enable_pgle``) wins.
        Steps for CPUs compile once either way.
      weight_blocks: the MXFP8 units' weight blocks: ``"1x32"`` (default: a rowwise and a
        columnwise plane, 1x32 blocks along each GEMM's own contraction) or ``"32x32"`` (one
        plane with one scale per 32x32 tile, which serves the forward and the dgrad: half the
        stored planes, one quantize, 8 + 8/1024 bits a weight per gather), or a mapping of
        regular expressions on the parameter name to those (the first that matches wins;
        ``"1x32"`` where none does). Activations and gradients keep 1x32 blocks.

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
        model: Any,
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
        keep_layers: int = 1,
        backward_gemm: str = "auto",
        model_constraints: str = "keep",
        xla_costs: str = "corrected",
        weight_blocks: Any = "1x32",
    ) -> None:
        options = {k: v for k, v in locals().items() if k not in ("self", "model", "mesh")}  # the keywords above
        self._plan: Plan = make_plan(model, mesh, **options)
        self._layout = StateLayout(self._plan)
        self._steps = Steps(self._plan, self._layout)
        self._jitted: dict[tuple, Callable] = {}

    # -- what the plan holds ---------------------------------------------------------------------

    mesh = _field("topology.mesh", "The mesh the plan is over (its axes automatic).")
    platform = _field("topology.platform", "The platform of the mesh's devices (``cpu``, ``cuda``, ``rocm``).")
    tp_axis = _field("topology.tp_axis", "The mesh axis of tensor parallelism, or None.")
    tp_size = _field("topology.tp_size", "The devices of the tp axis (1 without tensor parallelism).")
    params = _field("params", "Every parameter of the model as the plan sees it (``ParamInfo``), in model order.")
    precision = _field("precision", "The units' default precision (``mxfp8`` or ``bf16``).")
    scale_rule = _field("scale_rule", "The MXFP8 scale rule, as ``format.ScaleRule``'s value.")
    precision_by_path = _field("precision_by_path", "The per-parameter precision rule, as given.")
    weight_blocks = _field("weight_blocks", "The MXFP8 units' weight blocks rule, as given.")
    trainable = _field("trainable", "The nnx filter naming the trained variables, as given.")
    prefetch = _field("prefetch", "How many layers ahead each unit's forward gather starts.")
    keep_layers = _field("keep_layers", "How many of a remat scan's last layers keep their forward's gathered weights.")
    model_constraints = _field("model_constraints", "Whether the step keeps or drops the model's own constraints.")
    xla_costs = _field("xla_costs", "How XLA:GPU's scheduler prices the steps compiled for GPUs.")
    constraints = _field("constraints", "The model's sharding constraints that replicate the batch split.")
    traced = _field("traced", "Whether the units were found by tracing the loss (else by layer class).")
    rest_names = _field("rest_names", "The paths of the model's other state (RNG streams, statistics).")
    units = _forward("_plan", Plan.units)
    mxfp8_units = _forward("_plan", Plan.mxfp8_units)
    plain = _forward("_plan", Plan.plain)
    frozen = _forward("_plan", Plan.frozen)
    trained = _forward("_plan", Plan.trained)
    weight_elements = _forward("_plan", Plan.weight_elements)
    plain_elements = _forward("_plan", Plan.plain_elements)
    stored_elements = _forward("_plan", Plan.stored_elements)

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        """The plan as a table: every parameter, what it became and why, its stored bytes per
        device and bytes gathered per step; totals; how the units multiply on the mesh's platform.

        Returns:
          The table as a multi-line ``str`` (what ``print(fsdp)`` prints).
        """
        return fsdp_table.summary(self._plan)

    # -- state: shardings, shapes, the optimizer's tree (``StateLayout``) --------------------------

    master_sharding = _forward("_layout", StateLayout.master_sharding)
    logical_sharding = _forward("_layout", StateLayout.logical_sharding)
    param_tree = _forward("_layout", StateLayout.param_tree)
    from_param_tree = _forward("_layout", StateLayout.from_param_tree)
    owner_of = _forward("_layout", StateLayout.owner_of)
    abstract_state = _forward("_layout", StateLayout.abstract_state)
    check_state = _forward("_layout", StateLayout.check_state)
    to_logical = _forward("_layout", StateLayout.to_logical)
    from_logical = _forward("_layout", StateLayout.from_logical)
    place_batch = _forward("_steps", Steps.place_batch)

    @property
    def compiler_options(self) -> dict | None:
        """The XLA options the steps are compiled with, chosen by the mesh's platform (on GPUs
        XLA:GPU's collective pipeliner: on for all-gathers under ``xla_costs="xla"``, else off;
        but where ``XLA_FLAGS`` sets it); None: XLA's defaults."""
        return self._steps.compiler_options

    def init(self, model: Any, tx: optax.GradientTransformation) -> TrainState:
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
        self._plan.topology.check_context()
        values, rest = values_of(self._plan, model)
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

    def gather(self, state: TrainState) -> Any:
        """The model with the full fp32 master parameters (one all-gather per array) and the
        state's RNG streams.

        Args:
          state: a ``TrainState`` of this plan (``check_state``).

        Returns:
          The plan's model (an ``nnx.Module``, or the pytree, its static leaves as they were):
          every parameter in its own shape and dtype, whole (replicated) on every device; the
          other state from ``state.rest``.
        """
        self.check_state(state, "state")
        return self._plan.partition.merge(self._layout.logical_fn(state.master, state.frozen), list(state.rest))

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
        return fsdp_checkpoint.save(
            self._plan, self._layout, state, directory, async_save=async_save, overwrite=overwrite
        )

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
        master, frozen, rest, opt_state, step = fsdp_checkpoint.restore(
            self._plan, self._layout, directory, self.abstract_state(tx)
        )
        state = TrainState(master, self._layout.quantize_fn(master, frozen), frozen, tuple(rest), opt_state, step)
        return jax.device_put(state, self._layout.shardings(state))

    # -- steps ---------------------------------------------------------------------------------

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

            return self._steps.jit(fn)

        jitted = self._jit(("loss_and_grads", loss_fn, has_aux), make)

        def call(state, batch):
            self._plan.topology.check_context()
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
            return self._steps.jit(lambda state, batch: grads_fn(state, batch)[0])

        jitted = self._jit(("eval_step", loss_fn), make)

        def call(state, batch):
            self._plan.topology.check_context()
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
            self._plan.topology.check_context()
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
        ``memory_analysis()``, compiled with XLA's own prices; ``compile_train_step`` compiles
        it as ``train_step`` does (``xla_costs``).

        Args:
          loss_fn, tx, has_aux: as for ``train_step``.
          state: a ``TrainState`` of this plan, or ``abstract_state(tx)``.
          batch: a batch as ``place_batch`` takes it (arrays or ``jax.ShapeDtypeStruct``s).

        Returns:
          The ``jax.stages.Lowered`` step, not yet compiled.
        """
        self._plan.topology.check_context()
        return self._steps.train_jit(loss_fn, tx, has_aux).lower(state, self.place_batch(batch))

    def compile_train_step(
        self,
        loss_fn: Callable,
        tx: optax.GradientTransformation,
        state: TrainState,
        batch: Any,
        *,
        has_aux: bool = False,
        compiler_options: dict | None = None,
    ) -> jax.stages.Compiled:
        """``lower_train_step`` compiled as ``train_step`` compiles it: for a GPU mesh under
        ``xla_costs="corrected"``, with the scheduler's prices put right (``xla_costs``), else
        once.

        Args:
          loss_fn, tx, state, batch, has_aux: as for ``lower_train_step``.
          compiler_options: more XLA options (a dump folder, say), for the compilation that
            gives the program.

        Returns:
          The ``jax.stages.Compiled`` step, called as ``compiled(state, fsdp.place_batch(batch))``.
        """
        lowered = self.lower_train_step(loss_fn, tx, state, batch, has_aux=has_aux)
        return self._steps.compile(lowered, compiler_options)

    def _jit(self, key: tuple, make: Callable) -> Callable:
        """The jitted function made for ``key`` (what, and the loss, optimizer and flags it was
        made for), made once: asking ``train_step``/``loss_and_grads``/``eval_step`` again for
        the same loss reuses its compiled programs instead of tracing and compiling anew."""
        if key not in self._jitted:
            self._jitted[key] = make()
        return self._jitted[key]
