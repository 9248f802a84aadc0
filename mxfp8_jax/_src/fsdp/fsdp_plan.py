"""The FSDP plan: what each parameter of a model becomes, and why.

Four kinds, one word each (``ParamInfo.kind``):

- ``"mxfp8"``: an MXFP8 unit. fp32 master rows ``W [*stack, N, K]`` sharded over the mesh in
  whole 32-row blocks, plus their rowwise and columnwise planes; gathered as 8-bit planes for
  each GEMM or lookup that reads it, dropped after (``fsdp_unit``).
- ``"bf16"``: a bf16 unit. The same without planes: the master rows rounded to bf16 and
  gathered as 16-bit words. The default for embeddings and output heads (MXFP8 training recipes
  keep them in higher precision), and for contracted weights whose ``K`` or ``N`` is not a
  multiple of 32.
- ``"plain"``: fp32 in its own shape, split over the mesh along an axis the device count
  divides (after its layer axes), gathered where it is read (norm scales, biases, anything
  that is not a GEMM operand or a lookup table).
- ``"frozen"``: not trained and not a unit (an integer parameter, or one the ``trainable``
  filter leaves out that no GEMM or lookup reads as a unit); whole on every device in its own
  dtype, passed to the model as it is.

A parameter the optimizer does not train (``FSDP(trainable=...)`` leaves it out) that the loss
reads as a unit is a frozen unit: ``ParamInfo.trained`` is False, its rows are stored like a
master's but in the parameter's own dtype, its MXFP8 planes are quantized once, and the step
gathers it as it gathers any unit but computes no gradient for it.

What a parameter is read by comes from a trace of the loss (``fsdp_trace``): a parameter
contracted by ``dot_general`` (any layer: ``nnx.Linear``, ``nnx.LinearGeneral``,
``nnx.Einsum``, ``jnp.einsum`` / ``@`` in a custom layer) or looked up (``nnx.Embed``,
``table[ids]``) is a unit. Its role sets its default precision: ``"embedding"`` (looked up),
``"head"`` (its GEMMs feed no other parameter's GEMM: the logits) or ``"projection"``. Without a
trace (no example batch), units are found by layer class: ``nnx.Linear`` (default
``dot_general``) and ``mxfp8_jax.flax.Linear`` kernels whose two sides are multiples of 32.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from mxfp8_jax._src.fsdp.fsdp_geometry import PRECISIONS, WEIGHT_BLOCKS, Gemms, UnitGeometry
from mxfp8_jax._src.fsdp.fsdp_topology import Topology
from mxfp8_jax._src.fsdp.fsdp_trace import Use, Uses, describe_shape, product
from mxfp8_jax._src.numerics.format import BLOCK

KINDS = ("mxfp8", "bf16", "plain", "frozen")
ROLES = ("projection", "embedding", "head")


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One model parameter as the plan sees it; ``path`` as in ``nnx.to_flat_state``.

    ``kind`` is one of ``KINDS``; a unit (``"mxfp8"``/``"bf16"``) has its ``unit`` geometry and
    ``role``; a plain parameter its ``shard_axis`` (None: whole on every device).
    ``layer_axes``: the axes scans or indices slice off (``level`` of them), leading or not.
    ``reason`` says why a unit is bf16 or why a parameter is not a unit. Under tensor
    parallelism a unit's ``tp`` is ``"column"`` (``N`` split over the ``tp_size`` devices of the
    tp axis) or ``"row"`` (``K`` split); its ``unit`` geometry is then that of one tp slice.
    ``gemm_sites`` / ``lookup_sites`` / ``remat_sites``: the ops of the loss that read it, and
    those of them inside rematerialised regions.
    ``trained``: the optimizer updates it (False: a frozen unit, or kind ``"frozen"``).
    ``gathers``: how many times a step gathers the whole parameter (each read weighted by its
    trips through loops and divided by the layers it reads one of; a unit's GEMM counts twice,
    forward and backward); ``in_while``: read inside a ``while`` loop, counted once per trip.
    """

    path: tuple[str | int, ...]
    shape: tuple[int, ...]
    dtype: Any
    kind: str
    unit: UnitGeometry | None = None
    role: str | None = None
    shard_axis: int | None = None
    layer_axes: tuple[int, ...] = ()
    tp: str | None = None
    tp_size: int = 1
    reason: str = ""
    gemm_sites: int = 0
    lookup_sites: int = 0
    remat_sites: int = 0
    gathers: float = 0.0
    in_while: bool = False
    trained: bool = True

    @property
    def name(self) -> str:
        return "/".join(map(str, self.path))

    @property
    def is_unit(self) -> bool:
        return self.unit is not None

    @property
    def level(self) -> int:
        """How many layer axes scans or indices slice off."""
        return len(self.layer_axes)

    @property
    def stack(self) -> tuple[int, ...]:
        """A unit's stack axes: its layers, then the axes its GEMMs batch over."""
        return self.unit.stack if self.unit is not None else ()

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of its array in ``TrainState.master`` (a unit's padded ``W``; the tp
        slices side by side along rows for ``"column"``, along columns for ``"row"``)."""
        return self.shape if self.unit is None else self.tp_global(self.unit.padded_shape())

    @property
    def step_shape(self) -> tuple[int, ...]:
        """The parameter's shape as the model sees it inside a step (one tp slice)."""
        return self.shape if self.unit is None else self.unit.param_shape

    def tp_global(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """A unit array's shape for one tp slice -> for all of them.

        Args:
          local: the shape of a unit array (master or plane) for one tp slice, rows second to
            last.

        Returns:
          The shape as a tuple, the rows (``"column"``) or the last axis (``"row"``) multiplied
          by ``tp_size``; ``local`` unchanged without tensor parallelism.
        """
        if self.tp is None:
            return tuple(local)
        axis = len(local) - (2 if self.tp == "column" else 1)
        return tuple(d * self.tp_size if a == axis else d for a, d in enumerate(local))


# how XLA:GPU's scheduler prices a step compiled for GPUs (``compiled.xla_costs``)
XLA_COSTS = ("corrected", "xla")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A model's FSDP plan, one immutable value: what every parameter became (``params``, each a
    ``ParamInfo`` saying why), over which devices (``topology``), and how the step computes.

    Everything that stores, steps, checkpoints or prints the model's training reads it; nothing
    sets anything on it. ``fsdp_discover.make_plan`` makes one from an NNX model.

    ``precision``, ``scale_rule`` (an ``int``, ``format.ScaleRule``'s value) and
    ``precision_by_path``: the units' precisions as asked; ``gemms``: how the units' GEMMs
    multiply (``fsdp_unit.Gemms``), resolved for the topology's platform; ``prefetch``: how many
    layers ahead a unit's forward gather starts; ``keep_layers``: how many of a rematerialised
    scan's last layers keep the weights their forward gathered for their backward; ``traced``:
    the units were found by tracing the loss on an example (False: by layer class);
    ``trainable``: the filter that names the trained parameters (shown by the table). The
    model's structure: ``partition`` (how its variables split into the parameters and its
    other state: ``fsdp_discover.Partition``),
    ``rest_avals`` and ``rest_names`` (the other state's shapes and paths) and ``example_tree``
    (the structure of the batch the loss was traced on; None without one). ``constraints``: the
    model's own sharding constraints that replicate activations the batch split reaches
    (``fsdp_specs.Constraint``), found in the traced loss; ``model_constraints``: ``"keep"``
    (the step honours them) or ``"drop"`` (it ignores those). ``xla_costs``: how XLA:GPU's
    scheduler prices the steps compiled for GPUs (``"corrected"`` or ``"xla"``).
    """

    params: tuple[ParamInfo, ...]
    topology: Topology
    precision: str
    scale_rule: int
    gemms: Gemms
    partition: Any
    rest_avals: tuple = ()
    rest_names: tuple[str, ...] = ()
    example_tree: Any = None
    prefetch: int = 1
    keep_layers: int = 1
    traced: bool = False
    trainable: Any = None
    precision_by_path: Any = None
    weight_blocks: Any = "1x32"
    constraints: tuple = ()
    model_constraints: str = "keep"
    xla_costs: str = "corrected"

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


def split_axis(shape: tuple[int, ...], n: int, skip=()) -> int | None:
    """The first axis not in ``skip`` (layer axes) that ``n`` devices split evenly (None: none
    does)."""
    return next((a for a in range(len(shape)) if a not in skip and shape[a] > 0 and shape[a] % n == 0), None)


def resolve_rule(rule, name: str, role: str) -> str | None:
    """The precision ``rule`` asks for ``name`` (None: no opinion). ``rule``: a mapping of
    regular expressions to precisions (the first that ``re.search``es the name wins) or a
    callable ``(name, role) -> precision | None``."""
    if rule is None:
        return None
    if callable(rule):
        return rule(name, role)
    for pattern, precision in rule.items():
        if re.search(pattern, name):
            return precision
    return None


def check_rule(rule) -> None:
    if rule is None or callable(rule):
        return
    if not isinstance(rule, Mapping):
        raise TypeError(
            "precision_by_path must be a mapping {regex: precision} or a callable (name, role) -> precision | None, "
            f"got {type(rule).__name__}"
        )
    for pattern, precision in rule.items():
        _check_pattern(pattern, "precision_by_path")
        _check_precision(precision, f"precision_by_path[{pattern!r}]")


def _check_pattern(pattern, option: str) -> None:
    try:
        re.compile(pattern)
    except (re.error, TypeError) as err:
        raise ValueError(
            f"{option}: the pattern {pattern!r} is not a regular expression ({err}); the keys are "
            "regular expressions searched in the parameter names (e.g. 'blocks/.*/kernel')"
        ) from None


def _shown(names: list[str]) -> str:
    """The first few of ``names``, for an error message."""
    return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")


def check_rule_matches(rule, names) -> None:
    """Every pattern of a mapping ``rule`` matches some parameter name (a pattern that matches
    none is a typo that would otherwise change nothing, silently)."""
    if rule is None or callable(rule):
        return
    names = list(names)
    for pattern in rule:
        if not any(re.search(pattern, name) for name in names):
            raise ValueError(
                f"precision_by_path: the pattern {pattern!r} matches no parameter of the model (re.search on "
                f"the names: {_shown(names)})"
            )


def check_blocks(weight_blocks) -> None:
    """``weight_blocks`` is one of ``WEIGHT_BLOCKS`` or a mapping of regular expressions to them."""
    if isinstance(weight_blocks, str):
        if weight_blocks not in WEIGHT_BLOCKS:
            raise ValueError(
                f"weight_blocks={weight_blocks!r} must be one of {WEIGHT_BLOCKS} or a mapping {{regex: blocks}}"
            )
        return
    if not isinstance(weight_blocks, Mapping):
        raise TypeError(
            f"weight_blocks must be one of {WEIGHT_BLOCKS} or a mapping {{regex: blocks}}, "
            f"got {type(weight_blocks).__name__}"
        )
    for pattern, blocks in weight_blocks.items():
        _check_pattern(pattern, "weight_blocks")
        if blocks not in WEIGHT_BLOCKS:
            raise ValueError(f"weight_blocks[{pattern!r}]={blocks!r} must be one of {WEIGHT_BLOCKS}")


def with_blocks(params: tuple[ParamInfo, ...], weight_blocks) -> tuple[ParamInfo, ...]:
    """``params`` with each MXFP8 unit's weight blocks as ``weight_blocks`` asks (a mapping: the
    first pattern that ``re.search``es its name, ``"1x32"`` where none does). A pattern that
    matches no MXFP8 unit is a ``ValueError`` (a typo would otherwise change nothing)."""
    units = [p for p in params if p.kind == "mxfp8"]
    if isinstance(weight_blocks, str):
        rule = {"": weight_blocks}
    else:
        rule = dict(weight_blocks)
        for pattern in rule:
            if not any(re.search(pattern, p.name) for p in units):
                shown = _shown([p.name for p in units])
                raise ValueError(f"weight_blocks: the pattern {pattern!r} matches no MXFP8 unit (the units: {shown})")

    def blocks_of(name: str) -> str:
        return next((b for pattern, b in rule.items() if re.search(pattern, name)), "1x32")

    return tuple(
        dataclasses.replace(p, unit=dataclasses.replace(p.unit, blocks=blocks_of(p.name))) if p.kind == "mxfp8" else p
        for p in params
    )


def _check_precision(precision, where: str) -> None:
    if precision not in (*PRECISIONS, "plain"):
        raise ValueError(f"{where}={precision!r} must be one of {(*PRECISIONS, 'plain')}")


# ------------------------------------------------------------------------------------------------
# From the uses of a traced loss


def plan_from_uses(
    params: list[tuple[tuple, tuple[int, ...], Any]],
    uses: Uses,
    topology: Topology,
    *,
    precision: str,
    rule=None,
    tp_roles: Mapping[tuple, str] | None = None,
    frozen: frozenset[int] = frozenset(),
) -> tuple[ParamInfo, ...]:
    """``ParamInfo`` for every ``(path, shape, dtype)`` of ``params`` from how the loss reads it,
    on ``topology``: units' rows and plain parameters are split over its FSDP group.

    Under tensor parallelism (``topology.tp_axis``) the roles of the marked layers' kernels are
    in ``tp_roles``. ``frozen``: the indices of the parameters the
    optimizer does not train; each is planned by the same rules, then a unit stays a unit with
    ``trained=False`` and anything else is kind ``"frozen"``."""
    out = []
    for j, (path, shape, dtype) in enumerate(params):
        info = _classify(path, shape, dtype, uses.by_param[j], uses.is_head(j), topology, precision, rule, tp_roles)
        if j in frozen or info.kind == "frozen":
            info = _frozen(info)
        out.append(info)
    return tuple(out)


def _frozen(info: ParamInfo) -> ParamInfo:
    """``info`` as a parameter the optimizer does not train."""
    if info.unit is not None or info.kind == "frozen":
        return dataclasses.replace(info, trained=False)
    why = f" ({info.reason})" if info.reason else ""
    return ParamInfo(
        info.path,
        info.shape,
        info.dtype,
        "frozen",
        reason=f"not trained, not a unit{why}: kept as it is, whole on every device",
        trained=False,
    )


def _classify(path, shape, dtype, uses: list[Use], head, topology: Topology, precision, rule, tp_roles) -> ParamInfo:
    name = "/".join(map(str, path))
    shape = tuple(int(d) for d in shape)
    if not jnp.issubdtype(dtype, jnp.floating):
        return ParamInfo(path, shape, dtype, "frozen", reason="not floating: kept as it is, not trained")
    gemms = [u for u in uses if u.kind == "gemm"]
    lookups = [u for u in uses if u.kind == "lookup"]
    # a plain parameter's layers: those every read slices off; it is split along none of the
    # axes any read slices (a scan or index then reads every device's part of a layer)
    layers = min((u.layers for u in uses), key=len, default=())
    sliced = {a for u in uses for a in u.layers}

    def plain(reason: str) -> ParamInfo:
        return ParamInfo(
            path,
            shape,
            dtype,
            "plain",
            shard_axis=split_axis(shape, topology.fsdp_size, sliced),
            layer_axes=layers,
            reason=reason,
            remat_sites=sum(u.remat for u in uses),
            gathers=_gathers(uses, shape, plain=True),
            in_while=any(u.trips is None for u in uses),
        )

    if not uses:
        return plain("unused: not read by the loss")
    other = next((u for u in uses if u.kind == "other"), None)
    if other is not None:
        return plain(f"read by {other.what}")
    if len({u.layers for u in uses}) > 1:
        if len({u.level for u in uses}) > 1:
            return plain("read both inside and outside the loop over its layers")
        return plain("sliced into layers along different axes by different loops")
    if gemms:
        first = gemms[0]
        batch, k_axes, n_axes = first.batch, first.contract, first.free
        for g in gemms[1:]:
            if g.batch != batch or set(g.contract) not in (set(k_axes), set(n_axes)):
                return plain("contracted in two different ways")
    else:  # a table that is only looked up: its rows are its first axis after the layers
        rest = [a for a in range(len(shape)) if a not in layers]
        batch, n_axes, k_axes = (), tuple(rest[:1]), tuple(rest[1:])
    if not n_axes or not k_axes:
        return plain("a vector: nothing to split into rows")
    role = "embedding" if lookups else "head" if head else "projection"
    k, n = product([shape[a] for a in k_axes]), product([shape[a] for a in n_axes])
    asked = resolve_rule(rule, name, role)
    if asked is not None:
        _check_precision(asked, f"precision_by_path for {name}")
    if asked == "plain":
        return plain("precision_by_path asks for it")
    chosen = asked or (precision if role == "projection" else "bf16")
    reason = "" if asked or role == "projection" else f"{role}: bf16 by default"
    if lookups and gemms and not asked:
        reason = "tied embedding and output head: bf16 by default"
    if chosen == "mxfp8" and (k % BLOCK or n % BLOCK):
        if asked == "mxfp8":
            raise ValueError(
                f"precision_by_path asks for {name} {describe_shape(shape)} as MXFP8, but its GEMMs have "
                f"K={k} and N={n}; both must be multiples of {BLOCK} (MXFP8 blocks)"
            )
        chosen, reason = "bf16", f"K={k}, N={n}: not both multiples of {BLOCK}"
    role_tp = (tp_roles or {}).get(tuple(path)) if topology.tp_axis is not None else None
    geometry_shape = shape
    if role_tp is not None:
        geometry_shape = _tp_slice(
            name, shape, layers, batch, n_axes, k_axes, role_tp, topology.tp_axis, topology.tp_size
        )
    unit = UnitGeometry.build(
        geometry_shape,
        layer_axes=layers,
        batch_axes=batch,
        n_axes=n_axes,
        k_axes=k_axes,
        num_shards=topology.fsdp_size,
        axes=topology.fsdp_axes,
        precision=chosen,
    )
    return ParamInfo(
        path,
        shape,
        dtype,
        chosen,
        unit=unit,
        role=role,
        layer_axes=layers,
        tp=role_tp,
        tp_size=topology.tp_size if role_tp is not None else 1,
        reason=reason,
        gemm_sites=len(gemms),
        lookup_sites=len(lookups),
        remat_sites=sum(u.remat for u in uses),
        gathers=_gathers(uses, shape, plain=False),
        in_while=any(u.trips is None for u in uses),
    )


def _gathers(uses: list[Use], shape, *, plain: bool) -> float:
    """Whole-parameter gathers per step: each read once per trip (a ``while`` body: once), of
    the one layer it reads (``1 / product(layer axes)``); a unit's GEMM twice (its forward and
    its backward gather), a read in a rematerialised region once more. A plain parameter is
    gathered once per read (its gradient leaves by a reduce-scatter)."""
    total = 0.0
    for u in uses:
        share = (u.trips or 1) / product([shape[a] for a in u.layers])
        reads = 1 if plain or u.kind != "gemm" else 2
        total += share * (reads + u.remat)
    return total


def _tp_slice(name, shape, layers, batch, n_axes, k_axes, role, axis_name, t) -> tuple[int, ...]:
    """A tensor-parallel kernel ``[*layers, in, out]`` -> its shape on one device of the tp axis."""
    if role not in ("column", "row"):
        raise ValueError(f"{name}: tensor_parallel={role!r} must be 'column' or 'row'")
    leading = tuple(range(len(shape) - 2))
    if batch or n_axes != (len(shape) - 1,) or k_axes != (len(shape) - 2,) or tuple(layers) != leading:
        raise ValueError(
            f"{name}: tensor_parallel applies to a Linear-like kernel [*layers, in, out] contracted over in; "
            f"this {describe_shape(shape)} parameter is contracted over its axes {k_axes} (batch axes {batch})"
        )
    axis = len(shape) - (1 if role == "column" else 2)
    if shape[axis] % (t * BLOCK):
        raise ValueError(
            f"{name}: a {role}-parallel kernel {describe_shape(shape[-2:])} splits its "
            f"{'out' if role == 'column' else 'in'} features over the {t} devices of {axis_name!r}; "
            f"they must be a multiple of {t} x {BLOCK}"
        )
    return tuple(d // t if a == axis else d for a, d in enumerate(shape))


def check_uses(infos, uses: Uses, *, traced: bool) -> None:
    """The loss a step runs reads every unit of the plan ``infos`` the way the plan keeps it:
    GEMMs and lookups only, with its layer axes, batch axes and contraction (else a
    ``ValueError`` naming the parameter and what the loss does with it)."""
    for j, p in enumerate(infos):
        g = p.unit
        if g is None:
            continue
        for u in uses.by_param[j]:
            problem = None
            if u.kind == "other":
                problem = f"read by {u.what}"
            elif u.level != g.level:
                problem = f"read with {u.level} layer axes sliced off by scans, where the plan has {g.level}" + (
                    " (a stacked layer called without nnx.scan?)" if u.level < g.level else ""
                )
            elif u.layers != g.layer_axes:
                problem = f"sliced into layers along its axes {u.layers}, where the plan has {g.layer_axes}"
            elif u.kind == "gemm" and (
                u.batch != g.batch_axes
                or {frozenset(u.contract), frozenset(u.free)} != {frozenset(g.k_axes), frozenset(g.n_axes)}
            ):
                problem = f"contracted over its axes {u.contract} (batch {u.batch})"
            if problem is None:
                continue
            fix = (
                "the loss given to the step must read parameters as the loss the plan traced"
                if traced
                else "build FSDP(model, mesh, loss_fn=..., example_batch=...) with this loss so that the plan "
                "follows what it does"
            )
            raise ValueError(
                f"{p.name} {list(p.step_shape)}: the FSDP plan keeps it as a {p.kind} unit contracted over its "
                f"axes {g.k_axes} (batch {g.batch_axes}, layer axes {g.layer_axes}), but this loss has it {problem}; "
                f"{fix}"
            )


# ------------------------------------------------------------------------------------------------
# Without a trace: by layer class


def uses_from_layers(params, unit_kernels: Mapping[tuple, tuple[tuple[int, ...], int, int]]) -> Uses:
    """The uses the layer classes imply: the kernel ``[*stack, in, out]`` of each layer in
    ``unit_kernels`` is contracted over ``in`` by one GEMM per layer (its stack axes sliced by
    a scan); nothing else is known (no head, no embedding), so everything else is plain. A plain
    parameter of a stacked module (a scanned block's norm scale ``[L, D]``) is read one layer at
    a time like the block's kernels, so it has as many layer axes as they have."""
    roots = stack_roots(params, unit_kernels)
    by_param = []
    for path, _, _ in params:
        spec = unit_kernels.get(tuple(path))
        if spec is None:
            level = next((k for root, k in roots.items() if tuple(path[: len(root)]) == root), 0)
            by_param.append(
                [
                    Use(
                        "other",
                        tuple(range(level)),
                        "no GEMM of an nnx.Linear or mxfp8_jax.flax.Linear (units by layer class)",
                    )
                ]
            )
            continue
        stack, _, _ = spec
        level = len(stack)
        by_param.append([Use("gemm", tuple(range(level)), "dot_general", contract=(level,), free=(level + 1,))])
    return Uses(by_param, feeds_gemm=set(range(len(params))))


def stack_roots(params, unit_kernels: Mapping[tuple, tuple[tuple[int, ...], int, int]]) -> dict[tuple, int]:
    """Path prefix of each stacked module -> its number of layer axes. A stacked kernel
    ``[*stack, in, out]`` belongs to the outermost module on its path whose parameters all start
    with ``stack`` (an ``nnx.vmap``-made stack has every parameter stacked; its parent holds
    unstacked ones too: the final norm, the embedding)."""
    shapes = [(tuple(path), tuple(shape)) for path, shape, _ in params]
    roots = {}
    for kernel_path, (stack, _, _) in unit_kernels.items():
        if not stack:
            continue
        for depth in range(1, len(kernel_path)):
            prefix = tuple(kernel_path[:depth])
            if all(shape[: len(stack)] == tuple(stack) for path, shape in shapes if path[:depth] == prefix):
                roots.setdefault(prefix, len(stack))
                break
    return roots
