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
