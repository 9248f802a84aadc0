"""What XLA compiled and how it scheduled it: GEMMs, asynchronous collectives, and the latency-
hiding scheduler's own estimate of the step.

Reads the optimized HLO text of a compiled program (``compiled.as_text()``: the computations'
instructions in schedule order, ``is_scheduled=true``) and the schedule the latency-hiding
scheduler dumps (``--xla_dump_latency_hiding_schedule``). Used by ``mxfp8-jax gpu-compile`` and
the tests of the GPU step compiled on a CPU host.

Definitions (one place; the command's tables and the tests count with them):

- **A GEMM** is an instruction that runs one matrix product: a ``dot``, a fusion whose
  computation holds one (XLA:GPU's Triton GEMM fusions, XLA:CPU's library fusions), or a custom
  call to a GEMM library (cuBLAS, cuBLASLt, cuDNN, hipBLASLt; ``__cudnn$blockScaledDot`` is a
  block-scaled MXFP8 GEMM). Its operand types are those the product itself reads: a fusion's
  ``dot`` operands after whatever the fusion converts, so ``convert(bf16 -> f32)`` then an f32
  ``dot`` is an fp32 GEMM. FLOPs are ``2 * (output elements) * (contracted size)``.
- **A gather with a GEMM between start and done** is an asynchronous all-gather (``-start`` /
  ``-done``, not marked ``is_sync``) with at least one GEMM scheduled after its start and before
  its done. Counted per ``-start`` (a combined gather, several arrays in one start, is one
  gather). When the start's result leaves its computation and the done is elsewhere, the path
  between them is followed through the schedule: a loop body's start carried to the next
  iteration (a pipelined gather) counts the GEMMs from the start to the end of the body and
  from the top of the body to the done; a start before a loop whose done is in its first
  iteration counts the GEMMs between the start and the loop, and from the top of the body to
  the done. A ``while`` between them counts as the GEMMs of its body times its trip count. A
  synchronous gather (``all-gather`` or ``is_sync``) never has one.
"""

from __future__ import annotations

import dataclasses
import math
import re

from mxfp8_jax._src.compiled import hlo

_HEAD = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(
    r"^\s*(?P<root>ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)
_REF = re.compile(r"%(?P<name>[\w.\-]+)")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_CALLS = re.compile(r"\b(?:calls|body|condition|to_apply)=%(?P<name>[\w.\-]+)")
_CALL_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{(?P<names>[^}]*)\}")
_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_DIMS = re.compile(r"\b(?P<key>lhs_contracting_dims|lhs_batch_dims)=\{(?P<dims>[0-9,]*)\}")
_BACKEND_DIMS = re.compile(r'"lhs_contracting_dimensions":\[(?P<dims>[^\]]*)\]')
_INDEX = re.compile(r"\bindex=(\d+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_SYNC = re.compile(r'"is_sync":true')
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
GEMM_TARGETS = re.compile(r"cublas|cudnn\$.*(?:dot|matmul|gemm)|blockscaleddot|hipblas|rocblas|matmul|gemm", re.I)
BLOCK_SCALED_TARGETS = re.compile(r"blockscaleddot|block_scaled_dot", re.I)


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    type: str
    op: str
    operands: tuple[str, ...]
    rest: str
    root: bool = False

    @property
    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(dtype, shape)`` of every array in the instruction's type (a tuple's elements)."""
        return [(d, tuple(int(x) for x in s.split(",") if x)) for d, s in _ARRAY.findall(self.type)]

    @property
    def target(self) -> str:
        m = _TARGET.search(self.rest)
        return m["target"] if m else ""

    @property
    def op_name(self) -> str:
        """jax's name of the operation it comes from (``jit(step)/.../shard_map/dot_general``)."""
        m = _OP_NAME.search(self.rest)
        return m.group(1) if m else ""

    def called(self) -> list[str]:
        names = [m["name"] for m in _CALLS.finditer(self.rest)]
        for m in _CALL_LIST.finditer(self.rest):
            names += [n.strip().lstrip("%") for n in m["names"].split(",") if n.strip()]
        return names


@dataclasses.dataclass
class Program:
    """The computations of a compiled module: ``{name: [Instr in schedule order]}``, the entry,
    and which computations run as code (not fused into a kernel nor applied by a reduction)."""

    computations: dict[str, list[Instr]]
    entry: str
    text: str

    @classmethod
    def parse(cls, text: str) -> Program:
        comps: dict[str, list[Instr]] = {}
        entry, current = "", None
        for line in text.splitlines():
            head = _HEAD.match(line)
            if head:
                current = head["name"]
                comps[current] = []
                entry = current if head["entry"] else entry
                continue
            if current is None:
                continue
            m = _INSTR.match(hlo._INDEX_COMMENT.sub("", line))
            if m is None:
                continue
            rest = m["rest"]
            args = rest.split("),", 1)[0] if ")," in rest else rest.rsplit(")", 1)[0]
            operands = tuple(r["name"] for r in _REF.finditer(args))
            comps[current].append(Instr(m["name"], m["type"], m["op"], operands, rest, bool(m["root"])))
        return cls(comps, entry, text)

    def index(self, computation: str) -> dict[str, Instr]:
        return {i.name: i for i in self.computations.get(computation, ())}

    def fused(self) -> set[str]:
        """Computations that are the bodies of fusions, reductions or sorts (not run as code)."""
        out: set[str] = set()
        for instrs in self.computations.values():
            for i in instrs:
                if i.op in ("fusion", "reduce", "reduce-window", "scatter", "select-and-scatter", "sort", "map") or (
                    i.op in ("all-reduce", "all-reduce-start", "reduce-scatter")
                ):
                    out.update(i.called())
        stack = list(out)
        while stack:  # what those call in turn
            for i in self.computations.get(stack.pop(), ()):
                for c in i.called():
                    if c not in out:
                        out.add(c)
                        stack.append(c)
        return out

    def trip_counts(self) -> dict[str, int | None]:
        """Known trip count of the loop whose body each computation is."""
        out: dict[str, int | None] = {}
        for instrs in self.computations.values():
            for i in instrs:
                if i.op == "while":
                    body = re.search(r"\bbody=%([\w.\-]+)", i.rest)
                    trip = _TRIP.search(i.rest)
                    if body:
                        out[body.group(1)] = int(trip.group(1)) if trip else None
        return out

    def runs(self, computation: str) -> int | None:
        """How many times ``computation`` runs per execution of the module."""
        return hlo._Module.parse(self.text).placement(computation)[1]


# ------------------------------------------------------------------------------------------------
# GEMMs


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM instruction: ``kind`` (``"dot"``, ``"fusion"`` or the custom-call target), the
    element types of its two operands and of its result, its FLOPs per run, where it sits, how
    many times it runs per step (None: in a loop of unknown trip count), and jax's name of the
    operation it comes from (``op_name``: an FSDP unit's GEMMs run inside ``shard_map``)."""

    name: str
    computation: str
    kind: str
    operands: tuple[str, str]
    result: str
    flops: int
    count: int | None
    op_name: str = ""

    @property
    def block_scaled(self) -> bool:
        return bool(BLOCK_SCALED_TARGETS.search(self.kind))

    @property
    def fp32(self) -> bool:
        """Both operands fp32 (or wider): a product at TF32 speed at best on a GPU."""
        return all(t in ("f32", "f64") for t in self.operands)

    @property
    def precision(self) -> str:
        """``"mxfp8"`` (block-scaled 8-bit), ``"fp32"``, or the operand types (``"bf16"``,
        ``"bf16xf32"``...)."""
        if self.block_scaled or all(t.startswith("f8") for t in self.operands):
            return "mxfp8" if self.block_scaled else "fp8"
        if self.fp32:
            return "fp32"
        a, b = self.operands
        return a if a == b else f"{a}x{b}"


def gemms(text: str) -> list[Gemm]:
    """Every GEMM that runs in the compiled module ``text``, in text order."""
    prog = Program.parse(text)
    fused = prog.fused()
    module = hlo._Module.parse(text)
    out = []
    for comp, instrs in prog.computations.items():
        if comp in fused:
            continue
        names = {i.name: i for i in instrs}
        count = None
        for i in instrs:
            found = _gemm_of(prog, i, names)
            if found is None:
                continue
            if count is None:
                count = module.placement(comp)[1] if comp != prog.entry else 1
            kind, operands, result, flops = found
            out.append(Gemm(i.name, comp, kind, operands, result, flops, count, i.op_name))
    return out


def _gemm_of(prog: Program, i: Instr, names: dict[str, Instr]):
    """``(kind, operand types, result type, flops)`` when ``i`` runs a GEMM, else None."""
    if i.op == "dot":
        return ("dot", *_dot_types(i, names))
    if i.op == "fusion":
        for comp in i.called():
            dot = _find_dot(prog, comp)
            if dot is not None:
                inner, inner_names = dot
                return ("fusion", *_dot_types(inner, inner_names))
        return None
    if i.op == "custom-call" and GEMM_TARGETS.search(i.target):
        ops = [names[o] for o in i.operands if o in names]
        types = tuple(o.arrays[0][0] if o.arrays else "?" for o in ops[:2])
        result = i.arrays[0] if i.arrays else ("?", ())
        m = _BACKEND_DIMS.search(i.rest)
        contracted = 1
        if m and ops and ops[0].arrays:
            shape = ops[0].arrays[0][1]
            contracted = math.prod(shape[int(d.strip('" '))] for d in m["dims"].split(",") if d.strip('" '))
        elif len(ops) >= 2 and ops[0].arrays:  # block-scaled dot [B, M, K] x [B, N, K]: K last
            contracted = ops[0].arrays[0][1][-1]
        return (i.target, (types + ("?", "?"))[:2], result[0], 2 * math.prod(result[1]) * contracted)
    return None


def _find_dot(prog: Program, comp: str, seen=frozenset()):
    instrs = prog.computations.get(comp, ())
    names = {i.name: i for i in instrs}
    for i in instrs:
        if i.op == "dot":
            return i, names
    for i in instrs:
        for c in i.called():
            if c not in seen:
                found = _find_dot(prog, c, seen | {comp})
                if found is not None:
                    return found
    return None


def _dot_types(i: Instr, names: dict[str, Instr]):
    ops = [names.get(o) for o in i.operands[:2]]
    types = tuple(o.arrays[0][0] if o is not None and o.arrays else "?" for o in ops)
    result = i.arrays[0] if i.arrays else ("?", ())
    dims = {m["key"]: [int(d) for d in m["dims"].split(",") if d] for m in _DIMS.finditer(i.rest)}
    contracted = 1
    if ops[0] is not None and ops[0].arrays:
        shape = ops[0].arrays[0][1]
        contracted = math.prod(shape[d] for d in dims.get("lhs_contracting_dims", []))
    return (types + ("?", "?"))[:2], result[0], 2 * math.prod(result[1]) * contracted


# ------------------------------------------------------------------------------------------------
# Asynchronous collectives in the schedule


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
    """One collective in the schedule: ``op`` (``"all-gather"``, ``"reduce-scatter"``...), the
    ``(dtype, shape)`` of what it produces, whether it runs synchronously, how many GEMMs run
    between its start and done (see the module docstring), whether its done is in another
    iteration or computation (``pipelined``), and how many times it runs per step."""

    name: str
    computation: str
    op: str
    outputs: tuple[tuple[str, tuple[int, ...]], ...]
    sync: bool
    gemms_between: int
    pipelined: bool
    count: int | None

    @property
    def bytes(self) -> int:
        return sum(hlo.dtype_bytes(d) * math.prod(s) for d, s in self.outputs)

    @property
    def overlapped(self) -> bool:
        return not self.sync and self.gemms_between > 0

    def bytes_of(self, bits: int) -> int:
        """Bytes of its outputs whose elements are ``bits`` wide."""
        return sum(hlo.dtype_bytes(d) * math.prod(s) for d, s in self.outputs if hlo.dtype_bytes(d) * 8 == bits)


_ASYNC_OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def async_collectives(text: str, op: str | None = None) -> list[AsyncCollective]:
    """Every collective of the compiled module ``text`` (of kind ``op`` when given), with the
    GEMMs XLA scheduled between its start and its done."""
    prog = Program.parse(text)
    fused = prog.fused()
    module = hlo._Module.parse(text)
    trips = prog.trip_counts()
    weight_cache: dict[str, int] = {}
    out = []
    for comp, instrs in prog.computations.items():
        if comp in fused:
            continue
        count = module.placement(comp)[1] if comp != prog.entry else 1
        pos = {i.name: k for k, i in enumerate(instrs)}
        for k, i in enumerate(instrs):
            kind, start = _collective_kind(i)
            if kind is None or (op is not None and kind != op):
                continue
            arrays = i.arrays
            if start:
                arrays = arrays[len(arrays) // 2 :] if i.op != "async-start" else arrays
                sync = bool(_SYNC.search(i.rest))
                between, pipelined = _between(prog, comp, instrs, pos, k, trips, weight_cache)
            else:
                sync, between, pipelined = True, 0, False
            out.append(
                AsyncCollective(i.name, comp, kind, tuple(arrays), sync, 0 if sync else between, pipelined, count)
            )
    return out


def _collective_kind(i: Instr) -> tuple[str | None, bool]:
    for kind in _ASYNC_OPS:
        if i.op == kind:
            return kind, False
        if i.op == f"{kind}-start":
            return kind, True
    return None, False


def _gemm_weight(prog: Program, i: Instr, names: dict[str, Instr], trips, cache: dict[str, int]) -> int:
    """GEMMs that instruction ``i`` runs: 1 for a GEMM, its body's times the trip count for a
    ``while``, its callee's for a ``call`` / ``conditional`` (the largest branch)."""
    if _gemm_of(prog, i, names) is not None:
        return 1
    if i.op == "while":
        body = re.search(r"\bbody=%([\w.\-]+)", i.rest)
        if body:
            return _computation_gemms(prog, body.group(1), trips, cache) * (trips.get(body.group(1)) or 1)
    if i.op in ("call", "conditional", "async-start"):
        counts = [_computation_gemms(prog, c, trips, cache) for c in i.called()]
        return max(counts, default=0)
    return 0


def _computation_gemms(prog: Program, comp: str, trips, cache: dict[str, int]) -> int:
    if comp not in cache:
        cache[comp] = 0
        instrs = prog.computations.get(comp, ())
        names = {i.name: i for i in instrs}
        cache[comp] = sum(_gemm_weight(prog, i, names, trips, cache) for i in instrs)
    return cache[comp]


def _between(prog: Program, comp: str, instrs: list[Instr], pos, k: int, trips, cache) -> tuple[int, bool]:
    """GEMMs between the start ``instrs[k]`` and its done (module docstring); whether the done
    lies in another iteration or computation."""
    names = {i.name: i for i in instrs}
    weight = lambda seq: sum(_gemm_weight(prog, i, names, trips, cache) for i in seq)
    start = instrs[k]
    for j in range(k + 1, len(instrs)):
        if instrs[j].op.endswith("-done") and start.name in instrs[j].operands:
            return weight(instrs[k + 1 : j]), False
    # the start leaves through a tuple: the root's (carried to the next iteration) or a loop's
    for j in range(k + 1, len(instrs)):
        user = instrs[j]
        if user.op != "tuple" or start.name not in user.operands:
            continue
        slot = user.operands.index(start.name)
        if user.root:  # carried: the done is at the top of the next iteration
            return weight(instrs[k + 1 :]) + _done_in(prog, comp, slot, trips, cache), True
        for w in range(j + 1, len(instrs)):
            if instrs[w].op == "while" and user.name in instrs[w].operands:
                body = re.search(r"\bbody=%([\w.\-]+)", instrs[w].rest)
                inside = _done_in(prog, body.group(1), slot, trips, cache) if body else 0
                return weight(instrs[k + 1 : w]) + inside, True
    return 0, True


def _done_in(prog: Program, body: str, slot: int, trips, cache) -> int:
    """GEMMs from the top of loop body ``body`` to the done of what its parameter carries at
    ``slot``."""
    instrs = prog.computations.get(body, ())
    names = {i.name: i for i in instrs}
    carried = {i.name for i in instrs if i.op == "get-tuple-element" and _slot(i) == slot}
    total = 0
    for i in instrs:
        if i.op.endswith("-done") and carried & set(i.operands):
            return total
        total += _gemm_weight(prog, i, names, trips, cache)
    return 0


def _slot(i: Instr) -> int:
    m = _INDEX.search(i.rest)
    return int(m.group(1)) if m else -1


# ------------------------------------------------------------------------------------------------
# The latency-hiding scheduler's estimate


@dataclasses.dataclass(frozen=True)
class ScheduleStats:
    """The scheduler's statistics of one computation (``scheduler_statistics`` of the dump), in
    its cycles (``cycles_per_microsecond`` of them a microsecond), and how many times the
    computation runs per step."""

    computation: str
    total_cycles: float
    wasted: dict[str, float]
    cycles_per_us: float
    runs: int | None

    def wasted_of(self, op: str) -> float:
        """Wasted (exposed) cycles of ``op``: ``"all_gather"``, ``"reduce_scatter"``..."""
        return self.wasted.get(op, 0.0)


_STAT = re.compile(r"(\w+)_wasted_cycles:\s*([0-9.eE+\-]+)")


def schedule_stats(dump: str, text: str | None = None) -> list[ScheduleStats]:
    """The statistics of every computation in a latency-hiding schedule dump (the text-format
    ``ScheduleProto`` XLA writes as ``<module>.schedule.txt``), with their runs per step read
    from the compiled ``text`` where given (loop bodies run their trip count)."""
    names = {
        m.group(2): m.group(1)
        for m in re.finditer(r'\n  computations \{\n    name: "([^"]+)".*?\n    id: (\d+)\n    root_id', dump, re.S)
    }
    module = hlo._Module.parse(text) if text else None
    out = []
    for block in re.split(r"\ncomputation_schedules \{", dump)[1:]:
        cid = re.search(r"computation_id:\s*(\d+)", block)
        stats = re.search(r"scheduler_statistics \{(.*?)\}", block, re.S)
        if cid is None or stats is None:
            continue
        body = stats.group(1)
        total = re.search(r"total_cycles:\s*([0-9.eE+\-]+)", body)
        per_us = re.search(r"cycles_per_microsecond:\s*([0-9.eE+\-]+)", block)
        wasted = {k: float(v) for k, v in _STAT.findall(body) if k != "total"}
        name = names.get(cid.group(1), f"computation {cid.group(1)}")
        runs = module.placement(name)[1] if module is not None and name in text else 1
        out.append(
            ScheduleStats(
                name, float(total.group(1)) if total else 0.0, wasted, float(per_us.group(1)) if per_us else 1.0, runs
            )
        )
    return out


def step_estimate(stats: list[ScheduleStats]) -> dict[str, float]:
    """The step's estimate from per-computation statistics: each computation's cycles times the
    times it runs per step, summed (``total`` and each kind's wasted cycles), in microseconds.

    A computation's own total does not include the loops it runs (each loop body is scheduled
    and counted on its own), so the sum is the step's."""
    out: dict[str, float] = {"total_us": 0.0}
    for s in stats:
        runs = 1 if s.runs is None else s.runs
        out["total_us"] += s.total_cycles * runs / s.cycles_per_us
        for k, v in s.wasted.items():
            out[f"{k}_wasted_us"] = out.get(f"{k}_wasted_us", 0.0) + v * runs / s.cycles_per_us
    return out


@dataclasses.dataclass(frozen=True)
class GemmPricing:
    """How the scheduler priced the step's GEMMs, per step (loop bodies times their trip
    counts), in microseconds: ``wide_out_us`` the GEMMs of 16-bit operands with an fp32 result
    (an FSDP step's wgrad, accumulated in fp32 for the fp32 master), ``narrow_out_us`` those
    with a 16-bit result, and ``wide_out_at_narrow_us`` the first ones repriced
    (``corrected_gemm_us``). XLA:GPU's cost model prices many of the first by their result
    type: on an H100 it gives a bf16 x bf16 -> f32 product about 60 times the time of the same
    product with a bf16 result, while tensor cores accumulate in fp32 either way and run both
    at one speed."""

    wide_out_us: float
    narrow_out_us: float
    wide_out_at_narrow_us: float
    unmatched: int


def wide_out(g: Gemm) -> bool:
    """A GEMM of 16-bit operands with an fp32 result."""
    return all(op in ("bf16", "f16") for op in g.operands) and g.result == "f32"


def _narrow_out(g: Gemm) -> bool:
    return all(op in ("bf16", "f16") for op in g.operands) and g.result in ("bf16", "f16")


def narrow_rate(times: dict[tuple[str, str], float], found: list[Gemm]) -> float | None:
    """FLOPs per µs the scheduler gives the 16-bit-result GEMMs of a module together (``found``:
    its ``gemms``; ``times``: ``(computation, instruction) -> µs``); None where it has none."""
    flops = us = 0.0
    for g in found:
        t = times.get((g.computation, g.name))
        if t and _narrow_out(g):
            flops, us = flops + g.flops * (g.count or 1), us + t * (g.count or 1)
    return flops / us if us else None


def corrected_gemm_us(times: dict[tuple[str, str], float], found: list[Gemm]) -> dict[str, float]:
    """The GEMMs (of ``found``, a module's ``gemms``) of 16-bit operands and an fp32 result that
    the scheduler priced above their FLOPs at the rate of the module's 16-bit-result GEMMs
    (``narrow_rate``): instruction name -> their µs at that rate. Those it priced at or below it
    keep their price."""
    rate = narrow_rate(times, found)
    if rate is None:
        return {}
    out = {}
    for g in found:
        t = times.get((g.computation, g.name))
        if t is not None and wide_out(g) and g.flops / rate < t:
            out[g.name] = g.flops / rate
    return out


def price_gemms(times: dict[tuple[str, str], float], text: str) -> GemmPricing:
    """The scheduler's prices of the GEMMs of compiled module ``text`` (``GemmPricing``) from
    its ``(computation, instruction) -> µs`` (``hlo_replay.times_of``). ``unmatched``: GEMMs of
    the module the times do not cover."""
    found = gemms(text)
    corrected = corrected_gemm_us(times, found)
    wide = narrow = repriced = 0.0
    unmatched = 0
    for g in found:
        runs = g.count or 1
        t = times.get((g.computation, g.name))
        if t is None:
            unmatched += 1
        elif wide_out(g):
            wide, repriced = wide + t * runs, repriced + corrected.get(g.name, t) * runs
        elif _narrow_out(g):
            narrow += t * runs
    return GemmPricing(wide, narrow, repriced, unmatched)


def cost_analysis(compiled) -> dict | None:
    """XLA's HLO cost analysis of a compiled program's optimized module (``flops``, ``bytes
    accessed``...). A compile-only executable has none of its own (``cost_analysis()`` is None),
    so the module is analysed by the host's CPU client: loop bodies count once, and GEMMs run
    by a library (cuBLAS, cuDNN custom calls) count no FLOPs. None where jax offers neither."""
    try:
        own = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 (compile-only executables raise various errors)
        own = None
    if isinstance(own, list):
        own = own[0] if own else None
    if own:
        return {k: float(v) for k, v in own.items() if k in ("flops", "bytes accessed", "transcendentals")}
    try:
        import jax
        from jax._src.lib import xla_client

        modules = compiled.runtime_executable().hlo_modules()
        cpu = jax.devices("cpu")[0].client
        found = xla_client._xla.hlo_module_cost_analysis(cpu, modules[0])
    except Exception:  # noqa: BLE001 (a private interface: report nothing rather than fail)
        return None
    return {k: float(v) for k, v in found.items() if k in ("flops", "bytes accessed", "transcendentals")}
