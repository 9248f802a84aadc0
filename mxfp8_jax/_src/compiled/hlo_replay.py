"""XLA:GPU's own schedule of a step, replayed on one compute stream and one collective stream
with two of its cost model's prices put right: a measure of exposed communication that does
not rest on those prices.

The latency-hiding scheduler's statistics (``hlo_schedule.schedule_stats``) come from the
prices XLA's cost model gives each instruction, and two of those make a training step's loop
bodies meaningless to read exposure from (``xla_costs`` gives the scheduler the same two put
right, so that it schedules by them):

- **Asynchronous copies.** XLA:GPU runs a scan's per-iteration dynamic slices and writes into a
  stacked output (``dynamic-update-slice``: the saved carry, the stacked gradients) as
  asynchronous copy fusions, which the estimator prices at a fixed 5000 cycles (its default for
  an asynchronous op it does not model). Every loop body then lasts at least that long, and a
  gather in it is "hidden" behind time no kernel spends.
- **GEMMs with an fp32 result.** The cost model prices many GEMMs of 16-bit operands with an
  fp32 result (an FSDP step's wgrad, accumulated in fp32 for the fp32 master; fp32 attention
  logits) about 60 times slower than the same product with a 16-bit result, while tensor
  cores run both at one speed (``hlo_schedule.GemmPricing``).

``replay`` keeps XLA's order of every computation and its price of every other instruction, and
walks the program: kernels run one after another on the compute stream, a GEMM of an fp32
result that XLA priced above its FLOPs at the rate the program's 16-bit-result GEMMs get taking
that time instead (``hlo_schedule.corrected_gemm_us``), asynchronous compute costing nothing
beyond its kernels (conservative: less compute to hide collectives behind); a
collective starts on the collective stream when both its start is reached and the stream is
free (XLA:GPU runs one collective at a time), lasts its latency, and its done waits for it. A
loop runs its body its trip count times, a collective carried from one iteration to the next
(the pipeliner's) completing wherever its done is. Latencies are XLA's own: those its estimator
gives a collective of the same kind and bytes compiled alone for the same mesh
(``probe_latency``), where nothing overlaps it.

What it gives: the step's replayed time, each collective kind's exposed time (how long dones
waited), and for each gather the GEMM time that ran between its start and its done against its
latency (``Gather.hidden``: at least as long).
"""

from __future__ import annotations

import collections
import dataclasses
import re

from mxfp8_jax._src.compiled import hlo

_NOT_ARRAYS = ("TUPLE", "TOKEN", "OPAQUE_TYPE", "PRIMITIVE_TYPE_INVALID")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r'\n  computations \{\n    name: "([^"]+)"(.*?)\n    id: (\d+)\n    root_id: (\d+)', re.S)
_LEAF = re.compile(r"element_type: (\w+)((?:\n\s*dimensions: \d+)*)")
_TRIP = re.compile(r'known_trip_count\\\\?":\{\\\\?"n\\\\?":\\\\?"(\d+)')


@dataclasses.dataclass(frozen=True)
class ScheduledInstr:
    """One instruction of a schedule dump's module (its proto text, not the HLO text that
    ``hlo_schedule.Instr`` reads)."""

    name: str
    opcode: str
    id: str
    operands: tuple[str, ...]
    called: tuple[str, ...]
    tuple_index: int
    parameter: int
    trips: int | None
    leaves: tuple[tuple[str, int], ...]  # (element type, bytes) of each array of its shape
    op_name: str = ""  # its metadata's (jax's name stack: ``transpose(`` in the backward)

    @property
    def results(self) -> tuple[tuple[str, int], ...]:
        """What a collective start produces: the arrays after its operands' (its shape is its
        operands, then its results, then any context)."""
        n = len(self.operands)
        return self.leaves[n : 2 * n]

    @property
    def result_bytes(self) -> int:
        return sum(b for _, b in self.results)


@dataclasses.dataclass
class Computation:
    name: str
    id: str
    root: str
    instrs: dict[str, ScheduledInstr]
    order: list[str] = dataclasses.field(default_factory=list)
    times: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)


def parse(dump: str) -> tuple[dict[str, Computation], str]:
    """The computations of a latency-hiding schedule dump (``<module>.schedule.txt``) by id, with
    each one's instructions in schedule order and their timestamps (µs), and the entry's id."""
    module, _, schedules = dump.partition("\ncomputation_schedules {")
    comps: dict[str, Computation] = {}
    for m in _COMPUTATION.finditer(module):
        instrs = {}
        for chunk in m.group(2).split("\n    instructions {\n")[1:]:
            instr = _instr(chunk)
            instrs[instr.id] = instr
        comps[m.group(3)] = Computation(m.group(1), m.group(3), m.group(4), instrs)
    entry_name = re.search(r'entry_computation_name: "([^"]+)"', module)
    entry = next((c.id for c in comps.values() if entry_name and c.name == entry_name.group(1)), None)
    for block in ("computation_schedules {" + schedules).split("\ncomputation_schedules {"):
        cid = re.search(r"computation_id:\s*(\d+)", block)
        if cid is None or cid.group(1) not in comps:
            continue
        comp = comps[cid.group(1)]
        per_us = re.search(r"cycles_per_microsecond:\s*([0-9.eE+\-]+)", block)
        scale = float(per_us.group(1)) if per_us else 1.0
        for e in re.finditer(r"instructions \{\n    id: (\d+)\n((?:    [a-z_]+: [^\n]*\n)*)", block):
            comp.order.append(e.group(1))
            start = re.search(r"start_timestamp_cycles: ([0-9.eE+\-]+)", e.group(2))
            end = re.search(r"end_timestamp_cycles: ([0-9.eE+\-]+)", e.group(2))
            # a timestamp of 0 is left out of the text
            begin = float(start.group(1)) / scale if start else 0.0
            comp.times[e.group(1)] = (begin, float(end.group(1)) / scale if end else begin)
    return comps, entry


def _instr(chunk: str) -> ScheduledInstr:
    field = lambda key: re.search(rf"\n      {key}: ([^\n]*)", "\n" + chunk)
    shape = chunk.split("\n      metadata {", 1)[0]
    leaves = []
    for dtype, dims in _LEAF.findall(shape):
        if dtype not in _NOT_ARRAYS:
            size = 1
            for d in re.findall(r"\d+", dims):
                size *= int(d)
            leaves.append((dtype, hlo.dtype_bytes(dtype.lower()) * size))
    backend = field("backend_config")
    trips = _TRIP.search(backend.group(1)) if backend else None
    index, param = field("tuple_index"), field("parameter_number")
    op_name = re.search(r'\n        op_name: "([^"]*)"', "\n" + chunk)
    return ScheduledInstr(
        name=field("name").group(1).strip('"'),
        opcode=field("opcode").group(1).strip('"'),
        id=field("id").group(1),
        operands=tuple(re.findall(r"\n      operand_ids: (\d+)", "\n" + chunk)),
        called=tuple(re.findall(r"\n      called_computation_ids: (\d+)", "\n" + chunk)),
        tuple_index=int(index.group(1)) if index else 0,
        parameter=int(param.group(1)) if param else 0,
        trips=int(trips.group(1)) if trips else None,
        leaves=tuple(leaves),
        op_name=op_name.group(1) if op_name else "",
    )


def collective_kind(comps: dict[str, Computation], comp: Computation, instr: ScheduledInstr) -> str | None:
    """The collective an asynchronous start runs (``"all-gather"``...), ``"compute"`` for
    asynchronous compute, None for anything else."""
    if not instr.opcode.endswith("-start"):
        return None
    for kind in COLLECTIVES:
        if instr.opcode == f"{kind}-start" or instr.name.startswith(f"{kind}-start"):
            return kind
    for cid in instr.called:
        inner = comps.get(cid)
        if inner is not None:
            for i in inner.instrs.values():
                if i.opcode in COLLECTIVES:
                    return i.opcode
    return "compute" if instr.opcode == "async-start" else None


@dataclasses.dataclass
class Gather:
    """One run of one collective: where its start is, its kind and bytes, its latency, the GEMM
    time between its start and its done, and how long its done waited."""

    computation: str
    name: str
    kind: str
    nbytes: int
    dtypes: tuple[str, ...]
    latency: float
    gemm_between: float = 0.0
    stall: float = 0.0
    op_name: str = ""
    _end: float = 0.0
    _gemm_at_start: float = 0.0

    @property
    def hidden(self) -> bool:
        return self.gemm_between >= self.latency


@dataclasses.dataclass
class Result:
    step_us: float
    exposed_us: dict[str, float]
    gemm_us: float
    collectives: list[Gather]
    per_computation: dict[str, dict[str, float]]

    def gathers(self) -> list[Gather]:
        return [g for g in self.collectives if g.kind == "all-gather"]


def replay(dump, table: dict[tuple[str, int], float], gemm_us: dict[str, float] | None = None) -> Result:
    """The schedule ``dump`` (its text, or ``parse``'s result) replayed (module docstring).
    ``table``: collective latencies (``probe_latency``); ``gemm_us``: instruction name -> the
    µs a GEMM is replayed at (its corrected price; a GEMM not named keeps the dump's), its keys
    also what counts as GEMM time between a start and its done."""
    comps, entry = parse(dump) if isinstance(dump, str) else dump
    gemm_us = gemm_us or {}
    state = {"t": 0.0, "c": 0.0, "gemm": 0.0}
    runs: list[Gather] = []
    per: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))

    def run(cid: str, params: dict[int, object]) -> object:
        comp = comps[cid]
        env: dict[str, object] = {}
        t0 = state["t"]
        per[comp.name]["runs"] += 1
        for iid in comp.order:
            i = comp.instrs.get(iid)
            if i is None:
                continue
            op = i.opcode
            if op == "parameter":
                env[iid] = params.get(i.parameter)
            elif op == "tuple":
                env[iid] = [env.get(o) for o in i.operands]
            elif op == "get-tuple-element":
                v = env.get(i.operands[0])
                env[iid] = v[i.tuple_index] if isinstance(v, list) and i.tuple_index < len(v) else None
            elif op == "while":
                body = next(c for c in i.called if _is_body(comps[c]))
                carried = env.get(i.operands[0])
                for _ in range(i.trips or 1):
                    carried = run(body, {0: carried})
                env[iid] = carried
            elif op.endswith("-start") and collective_kind(comps, comp, i) not in (None, "compute"):
                kind = collective_kind(comps, comp, i)
                nbytes = i.result_bytes
                lat = table[(kind, nbytes)]
                begin = max(state["t"], state["c"])
                dtypes = tuple(sorted({d for d, _ in i.results}))
                g = Gather(
                    comp.name,
                    i.name,
                    kind,
                    nbytes,
                    dtypes,
                    lat,
                    op_name=i.op_name,
                    _end=begin + lat,
                    _gemm_at_start=state["gemm"],
                )
                state["c"] = g._end
                runs.append(g)
                env[iid] = g
            elif op.endswith("-done"):
                g = env.get(i.operands[0]) if i.operands else None
                if isinstance(g, Gather):
                    g.stall = max(0.0, g._end - state["t"])
                    g.gemm_between = state["gemm"] - g._gemm_at_start
                    state["t"] = max(state["t"], g._end)
                    per[comp.name][f"{g.kind} exposed"] += g.stall
                env[iid] = None
            else:
                start, end = comp.times.get(iid, (0.0, 0.0))
                cost = gemm_us.get(i.name, end - start) if op != "async-start" else 0.0
                state["t"] += cost
                if i.name in gemm_us:
                    state["gemm"] += cost
                env[iid] = None
        per[comp.name]["us"] += state["t"] - t0
        return env.get(comp.root)

    run(entry, {})
    exposed: dict[str, float] = collections.defaultdict(float)
    for g in runs:
        exposed[g.kind] += g.stall
    return Result(state["t"], dict(exposed), state["gemm"], runs, {k: dict(v) for k, v in per.items()})


WEIGHT_BYTES = 2**20


def weight_gathers(gathers: list[Gather]) -> dict[str, dict[str, int]]:
    """The weight gathers of a replayed step by pass: those of at least ``WEIGHT_BYTES`` (units'
    planes, bf16 or fp32 weights; a norm's scale is a few KiB, and XLA combines it with a
    weight's at times), forward or backward by their op name (jax names the backward's ops
    ``transpose(...)``; a recomputed forward runs in the backward). Per pass: ``runs``,
    ``hidden`` (runs with at least their latency of GEMMs between start and done), and both
    again without the pass's first run (``later``, ``later_hidden``), which nothing of its pass
    can run beside."""
    out: dict[str, dict[str, int]] = {}
    for g in gathers:
        if g.nbytes < WEIGHT_BYTES:
            continue
        d = out.setdefault("backward" if "transpose(" in g.op_name else "forward", collections.Counter())
        if d["runs"]:
            d["later"] += 1
            d["later_hidden"] += int(g.hidden)
        d["runs"] += 1
        d["hidden"] += int(g.hidden)
    return {p: {k: d[k] for k in ("runs", "hidden", "later", "later_hidden")} for p, d in out.items()}


def _is_body(comp: Computation) -> bool:
    """A while's body (its root a tuple), not its condition (a predicate)."""
    root = comp.instrs.get(comp.root)
    return root is not None and root.opcode == "tuple"


def probe_latency(mesh, kind: str, nbytes: int, options: dict | None = None) -> float:
    """XLA's estimate (µs) of one ``kind`` collective over every device of ``mesh`` producing
    ``nbytes`` bytes per device, compiled alone for ``mesh``'s devices: the program's only
    instruction of any cost, so the scheduler's total is its latency."""
    import pathlib
    import shutil
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    axes = tuple(mesh.axis_names)
    n = int(np.prod(mesh.devices.shape))
    per = {"all-gather": nbytes // n, "reduce-scatter": nbytes * n, "all-reduce": nbytes, "all-to-all": nbytes}
    if kind not in per:
        raise ValueError(f"kind={kind!r}: one of {tuple(per)}")
    words = max(1, per[kind] // 4)

    def body(x):
        if kind == "all-gather":
            return jax.lax.all_gather(x, axes, tiled=True)
        if kind == "reduce-scatter":
            return jax.lax.psum_scatter(x, axes, tiled=True)
        if kind == "all-reduce":
            return jax.lax.psum(x, axes)
        return jax.lax.all_to_all(x, axes, 0, 0, tiled=True)

    spec = PartitionSpec(axes)
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    arg = jax.ShapeDtypeStruct((words * n,), jnp.float32, sharding=NamedSharding(mesh, spec))
    dump = tempfile.mkdtemp(prefix="mxfp8-latency-")
    try:
        jax.jit(f).lower(arg).compile(
            {**(options or {}), "xla_dump_to": dump, "xla_dump_latency_hiding_schedule": True}
        )
        found = list(pathlib.Path(dump).glob("*.schedule.txt"))
        comps, entry = parse(found[0].read_text()) if found else ({}, None)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    comp = comps.get(entry)
    instrs = list(comp.instrs.values()) if comp else []
    start = next((i for i in instrs if collective_kind(comps, comp, i) == kind), None)
    done = start and next((i for i in instrs if i.opcode.endswith("-done") and i.operands[:1] == (start.id,)), None)
    if done is None:
        raise _NoSchedule(kind)
    return comp.times[done.id][0] - comp.times[start.id][1]


class _NoSchedule(Exception):
    """The probe compiled its collective synchronously: no schedule to read its latency from."""


def times_of(comps: dict[str, Computation]) -> dict[tuple[str, str], float]:
    """``(computation, instruction) -> µs`` the scheduler gave each scheduled instruction."""
    return {
        (c.name, c.instrs[iid].name): end - start
        for c in comps.values()
        for iid, (start, end) in c.times.items()
        if iid in c.instrs
    }


def gemm_pricing(dump: str, text: str):
    """The scheduler's prices of the GEMMs of compiled module ``text``
    (``hlo_schedule.GemmPricing``), from its schedule ``dump``."""
    from mxfp8_jax._src.compiled import hlo_schedule

    return hlo_schedule.price_gemms(times_of(parse(dump)[0]), text)


def replay_step(dump: str, text: str, mesh, options: dict | None = None) -> tuple[Result, object]:
    """``replay`` of a compiled step, and the scheduler's GEMM prices (``GemmPricing``):
    ``dump`` its schedule dump, ``text`` its optimized HLO (``compiled.as_text()``), ``mesh``
    the mesh it was compiled for (its collectives' latencies are probed on it, compiled with
    ``options``). A collective the probe compiles synchronously (XLA then runs no scheduler
    to read: a small all-reduce) is priced as two all-gathers of its bytes, a ring
    all-reduce's reduce-scatter and gather."""
    from mxfp8_jax._src.compiled import hlo_schedule

    comps, entry = parse(dump)
    times = times_of(comps)
    pricing = hlo_schedule.price_gemms(times, text)
    found = hlo_schedule.gemms(text)
    corrected = hlo_schedule.corrected_gemm_us(times, found)
    gemm_us: dict[str, float] = {}
    for g in found:
        t = times.get((g.computation, g.name))
        if t is not None:
            gemm_us[g.name] = corrected.get(g.name, t)
    table: dict[tuple[str, int], float] = {}
    for comp in comps.values():
        for i in comp.instrs.values():
            kind = collective_kind(comps, comp, i)
            if kind in (None, "compute") or (kind, i.result_bytes) in table:
                continue
            try:
                table[(kind, i.result_bytes)] = probe_latency(mesh, kind, i.result_bytes, options)
            except _NoSchedule:
                table[(kind, i.result_bytes)] = 2 * probe_latency(mesh, "all-gather", i.result_bytes, options)
    return replay((comps, entry), table, gemm_us), pricing
