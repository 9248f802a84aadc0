"""Collectives in compiled HLO text, with the bytes each one produces per device and per step.

Used to report and test what a training step communicates (``mxfp8-jax demo``, the FSDP
benchmark, the tests) from what XLA actually compiled, rather than from a formula.

A collective inside a while loop (a scanned stack of layers) appears once in the text but runs
once per iteration: each one records the computation it sits in, how deep in loops that is, and
how many times it runs per step (the product of the enclosing loops' known trip counts).
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
    "send",
    "recv",
)

_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OP = re.compile(
    r"=\s*(?P<result>\([^=]*?\)|[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(sorted(COLLECTIVES, key=len, reverse=True)) + r")(?P<start>-start)?\("
)
_HEAD = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_CALL = re.compile(r"\b(?P<kind>calls|to_apply|body|condition)=%(?P<name>[\w.\-]+)")
_CALL_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{(?P<names>[^}]*)\}")
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op: its kind and the ``(dtype, shape)`` of each array it produces.

    ``computation``: the HLO computation it sits in; ``loop_depth``: how many while loops
    enclose it; ``count``: how many times it runs per execution of the module (None when an
    enclosing loop has no known trip count).
    """

    op: str
    outputs: tuple[tuple[str, tuple[int, ...]], ...]
    computation: str = ""
    loop_depth: int = 0
    count: int | None = 1

    @property
    def bytes(self) -> int:
        """Bytes of the op's outputs on one device (for an all-gather: the gathered buffer)."""
        return sum(dtype_bytes(d) * math.prod(s) for d, s in self.outputs)

    @property
    def bytes_per_step(self) -> int:
        """``bytes`` times ``count``: what this op moves per execution (loops unrolled)."""
        if self.count is None:
            raise ValueError(f"{self.op} in {self.computation} sits in a loop of unknown trip count")
        return self.bytes * self.count

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.outputs)


def dtype_bytes(name: str) -> int:
    """Bytes per element of an HLO element type (``u8``, ``bf16``, ``f8e4m3fn``, ``f32``, ``pred``)."""
    bits = re.search(r"\d+", name)
    return 1 if bits is None else max(1, int(bits.group()) // 8)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in ``hlo_text`` (``compiled.as_text()``), in text order.

    Asynchronous pairs count once, at their ``-start``, whose result tuple holds the operands
    then the outputs (the second half is kept). Text without computation headers (a fragment)
    is one computation that runs once.
    """
    found = []
    for line, computation, depth, count in _placed_lines(hlo_text):
        m = _OP.search(_INDEX_COMMENT.sub("", line))  # long tuples carry /*index=N*/ marks
        if m is None:
            continue
        shapes = [(d, tuple(int(x) for x in s.split(",") if x)) for d, s in _SHAPE.findall(m["result"])]
        if m["start"]:
            shapes = shapes[len(shapes) // 2 :]
        found.append(Collective(m["op"], tuple(shapes), computation, depth, count))
    return found


def _placed_lines(hlo_text: str):
    """``(line, computation, loop depth, runs per execution)`` for every instruction line."""
    computation = ""
    module = _Module.parse(hlo_text)
    placed: dict[str, tuple[int, int | None]] = {}
    for line in hlo_text.splitlines():
        head = _HEAD.match(line)
        if head:
            computation = head["name"]
            continue
        if computation not in placed:
            placed[computation] = module.placement(computation)
        yield (line, computation, *placed[computation])


_CUSTOM_CALL = re.compile(r'\bcustom-call\(.*custom_call_target="(?P<target>[^"]+)"')


@dataclasses.dataclass(frozen=True)
class CustomCall:
    """One custom call: its target, the computation it sits in, loop depth and runs per step."""

    target: str
    computation: str = ""
    loop_depth: int = 0
    count: int | None = 1


def custom_calls(hlo_text: str) -> list[CustomCall]:
    """Every custom call in ``hlo_text``, in text order, placed like ``collectives``."""
    found = []
    for line, computation, depth, count in _placed_lines(hlo_text):
        m = _CUSTOM_CALL.search(line)
        if m is not None:
            found.append(CustomCall(m["target"], computation, depth, count))
    return found


def counts_by_op(hlo_text: str) -> dict[str, int]:
    """How many collectives of each kind ``hlo_text`` holds (as written, loops not unrolled)."""
    out: dict[str, int] = {}
    for c in collectives(hlo_text):
        out[c.op] = out.get(c.op, 0) + 1
    return out


def bytes_by_op(hlo_text: str) -> dict[str, int]:
    """Total output bytes per device of each kind of collective in ``hlo_text``, per step
    (a collective in a loop counts once per iteration)."""
    out: dict[str, int] = {}
    for c in collectives(hlo_text):
        out[c.op] = out.get(c.op, 0) + c.bytes_per_step
    return out


def while_loops(hlo_text: str) -> list[tuple[str, int | None]]:
    """``(body computation, known trip count or None)`` of every while loop, in text order."""
    return [(body, trip) for _, body, trip in _Module.parse(hlo_text).loops]


@dataclasses.dataclass
class _Module:
    """Which computation calls which, and the while loops among those calls."""

    entry: str | None
    calls: dict[str, list[tuple[str, int | None, bool]]]  # callee -> [(caller, trip, is_loop)]
    loops: list[tuple[str, str, int | None]]  # (caller, body, trip)

    @classmethod
    def parse(cls, text: str) -> _Module:
        entry, current = None, ""
        calls: dict[str, list[tuple[str, int | None, bool]]] = {}
        loops = []
        for line in text.splitlines():
            head = _HEAD.match(line)
            if head:
                current = head["name"]
                entry = current if head["entry"] else entry
                continue
            is_while = " while(" in line
            trip = None
            if is_while:
                t = _TRIP.search(line)
                trip = int(t.group(1)) if t else None
            for m in _CALL.finditer(line):
                in_loop = is_while and m["kind"] in ("body", "condition")
                calls.setdefault(m["name"], []).append((current, trip, in_loop))
                if is_while and m["kind"] == "body":
                    loops.append((current, m["name"], trip))
            for m in _CALL_LIST.finditer(line):
                for name in m["names"].split(","):
                    name = name.strip().lstrip("%")
                    if name:
                        calls.setdefault(name, []).append((current, None, False))
        return cls(entry, calls, loops)

    def placement(self, computation: str, _seen: frozenset = frozenset()) -> tuple[int, int | None]:
        """``(loop depth, runs per execution)`` of ``computation``."""
        callers = self.calls.get(computation)
        if not callers or computation == self.entry or computation in _seen:
            return 0, 1
        depth, total = 0, 0
        for caller, trip, in_loop in callers:
            d, c = self.placement(caller, _seen | {computation})
            if in_loop:
                d += 1
                c = None if c is None or trip is None else c * trip
            depth = max(depth, d)
            total = None if total is None or c is None else total + c
        return depth, total


# ------------------------------------------------------------------------------------------------
# What a gather can overlap: the dependency graph of each computation


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_REF = re.compile(r"%(?P<name>[\w.\-]+)")
_GEMM_TARGET = re.compile(r"gemm|matmul|cublas|hipblas", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class GatherOverlap:
    """One all-gather and the GEMMs of its computation it can run beside.

    ``before``: the GEMMs that must finish before the GEMMs consuming the gathered value (its
    nearest GEMM users); ``overlap``: those of them that do not have to finish before the gather
    starts and do not wait for it, so a scheduler may run the gather while they compute.
    ``dtypes``: the element types it gathers; ``backward``: jax's name for it says it belongs to
    the backward pass (``transpose(...)``); ``carried``: in a while loop's body, it depends on a
    value the loop carries from one iteration to the next (an activation, a cotangent; not the
    stacked inputs the loop passes through unchanged, nor a scalar counter): such a gather can
    start only once the previous iteration is done; ``ahead``: in a while loop's body, no GEMM of
    the iteration reads it, the loop carries it to the next one (a weight gathered an iteration
    before the GEMM that reads it).
    """

    name: str
    computation: str
    dtypes: tuple[str, ...]
    before: int
    overlap: int
    backward: bool = False
    carried: bool = False
    ahead: bool = False


def gather_overlaps(hlo_text: str) -> list[GatherOverlap]:
    """For every all-gather of ``hlo_text`` (``compiled.as_text()``), how many GEMMs (``dot``s,
    fusions or custom calls that compute one) of the same computation it can overlap, read from
    the data dependencies alone (the program's, whatever the scheduler then does). A gather
    inside a loop body is judged within the body: one iteration's dependencies."""
    bodies: dict[str, list[tuple[str, str, str, list[str]]]] = {}
    backward: set[str] = set()
    index: dict[tuple[str, str], int] = {}  # (computation, get-tuple-element) -> its index
    roots: dict[str, str] = {}
    computation = ""
    for line in hlo_text.splitlines():
        head = _HEAD.match(line)
        if head:
            computation = head["name"]
            bodies[computation] = []
            continue
        m = _INSTR.match(line)
        if m is None or not computation:
            continue
        refs = [r["name"] for r in _REF.finditer(m["rest"])]
        bodies[computation].append((m["name"], m["op"], m["type"], refs))
        if m["op"] == "get-tuple-element":
            k = re.search(r"\bindex=(\d+)", m["rest"])
            index[computation, m["name"]] = int(k.group(1)) if k else -1
        if line.lstrip().startswith("ROOT "):
            roots[computation] = m["name"]
        if 'op_name="' in line and "transpose(" in line.split('op_name="', 1)[1].split('"', 1)[0]:
            backward.add(m["name"])
    has_dot: dict[str, bool] = {}

    def computes_dot(name: str, seen=frozenset()) -> bool:
        if name not in has_dot:
            found = False
            for _, op, _, refs in bodies.get(name, ()):
                if op == "dot" or (
                    op in ("fusion", "call")
                    and any(r in bodies and r not in seen and computes_dot(r, seen | {name}) for r in refs)
                ):
                    found = True
                    break
            has_dot[name] = found
        return has_dot[name]

    loop_bodies = {body for _, body, _ in _Module.parse(hlo_text).loops}
    out = []
    for computation, instrs in bodies.items():
        names = {name for name, _, _, _ in instrs}
        varying = _varying_carries(computation, instrs, index, roots) if computation in loop_bodies else set()
        operands = {name: [r for r in refs if r in names] for name, _, _, refs in instrs}
        gemm = set()
        for name, op, _, refs in instrs:
            line_calls = [r for r in refs if r in bodies]
            if op == "dot" or (op in ("fusion", "call") and any(computes_dot(r) for r in line_calls)):
                gemm.add(name)
            elif op == "custom-call" and _GEMM_TARGET.search(" ".join(refs) + op):
                gemm.add(name)
        order = [name for name, _, _, _ in instrs]
        gemm_bits = {name: 1 << k for k, name in enumerate(sorted(gemm))}
        above: dict[str, int] = {}  # the GEMMs each instruction depends on (itself included)
        for name in order:
            bits = gemm_bits.get(name, 0)
            for o in operands[name]:
                bits |= above.get(o, 0)
            above[name] = bits
        users: dict[str, list[str]] = {}
        for name in order:
            for o in operands[name]:
                users.setdefault(o, []).append(name)
        carried: dict[str, bool] = {}
        for name in order:
            carried[name] = name in varying or any(carried.get(o, False) for o in operands[name])
        for name, op, type_, _ in instrs:
            if op not in ("all-gather", "all-gather-start"):
                continue
            below, stack, consumers = set(), [name], []
            while stack:  # everything that depends on the gather; the nearest GEMMs among it
                x = stack.pop()
                for u in users.get(x, ()):
                    if u in below:
                        continue
                    below.add(u)
                    if u in gemm:
                        consumers.append(u)
                    else:
                        stack.append(u)
            need = 0
            for c in consumers:
                need |= above[c] & ~gemm_bits[c]
            after_gather = sum(gemm_bits[u] for u in below if u in gemm)
            free = need & ~above[name] & ~after_gather
            dtypes = tuple(d for d, _ in _SHAPE.findall(type_))
            out.append(
                GatherOverlap(
                    name,
                    computation,
                    dtypes,
                    bin(need).count("1"),
                    bin(free).count("1"),
                    name in backward,
                    carried[name],
                    computation in loop_bodies and not consumers and roots.get(computation) in below,
                )
            )
    return out


def _varying_carries(computation, instrs, index, roots) -> set[str]:
    """The ``get-tuple-element``s of a while body's parameter that read a value the loop changes
    from one iteration to the next (the root tuple does not hand it back as it came), other
    than scalars (the counter)."""
    params = {name for name, op, _, _ in instrs if op == "parameter"}
    by_name = {name: (op, refs) for name, op, _, refs in instrs}
    root = by_name.get(roots.get(computation, ""))
    if root is None or root[0] != "tuple":
        return set()
    handed_back = root[1]
    varying = set()
    for name, op, type_, refs in instrs:
        if op != "get-tuple-element" or not refs or refs[0] not in params:
            continue
        k = index.get((computation, name), -1)
        back = handed_back[k] if 0 <= k < len(handed_back) else None
        same = (
            back is not None
            and by_name[back][0] == "get-tuple-element"
            and by_name[back][1][:1] == refs[:1]
            and index.get((computation, back)) == k
        )
        scalar = re.fullmatch(r"[a-z][a-z0-9]*\[\]", type_.split("{")[0].strip()) is not None
        if not same and not scalar:
            varying.add(name)
    return varying
