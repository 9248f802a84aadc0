"""Collectives in compiled HLO text, with the bytes each one produces per device.

Used to report what a training step communicates (``mxfp8-jax demo``) from what XLA actually
compiled, rather than from a formula.
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OP = re.compile(
    r"=\s*(?P<result>\([^=]*?\)|[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\("
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op: its kind and the ``(dtype, shape)`` of each array it produces."""

    op: str
    outputs: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def bytes(self) -> int:
        """Bytes of the op's outputs on one device (for an all-gather: the gathered buffer)."""
        return sum(dtype_bytes(d) * math.prod(s) for d, s in self.outputs)

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
    then the outputs (the second half is kept).
    """
    found = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        shapes = [(d, tuple(int(x) for x in s.split(",") if x)) for d, s in _SHAPE.findall(m["result"])]
        if m["start"]:
            shapes = shapes[len(shapes) // 2 :]
        found.append(Collective(m["op"], tuple(shapes)))
    return found


def bytes_by_op(hlo_text: str) -> dict[str, int]:
    """Total output bytes per device of each kind of collective in ``hlo_text``."""
    out: dict[str, int] = {}
    for c in collectives(hlo_text):
        out[c.op] = out.get(c.op, 0) + c.bytes
    return out
