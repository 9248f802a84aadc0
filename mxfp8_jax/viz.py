"""Layouts in words and pictures: who owns which rows of which tensor, where the padding is.

``planes(shapes, devices)`` builds the layouts of an MXFP8 ``QuantizedDBuffer`` on a 1-D mesh of
``devices`` (``BlockAtomic(32)``): the data layout (rowwise and columnwise E4M3 codes share it)
and the two scale layouts (docs/design.md §4: coordinates divided by 32). ``ownership`` lists
what each device stores, ``format_planes`` prints it (``mxfp8-jax layout``) and ``draw_layout``
draws one layout with matplotlib (the ``[viz]`` extra), one bar per device.

Pure Python except for the drawing: nothing here touches a jax array or a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mxfp8_jax._src.buffers.directions import check_mxfp8_shapes, columnwise_scale_layout, rowwise_scale_layout
from mxfp8_jax._src.buffers.layout import GlobalLayout, ShardLayout
from mxfp8_jax._src.core import checks
from mxfp8_jax._src.numerics.format import BLOCK

PLANE_TITLES = {
    "data": "data: rowwise and columnwise E4M3 codes (one layout for both)",
    "rowwise_scale": "rowwise scales [M, K/32] (offsets / 32)",
    "columnwise_scale": "columnwise scales [M/32, K] (offsets / 32; one scale row per 32 data rows)",
}


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[first_row, first_row + n_rows)`` of tensor ``tensor``, stored from ``offset``
    (elements from the start of the device's segment)."""

    tensor: int
    first_row: int
    n_rows: int
    offset: int
    numel: int


@dataclasses.dataclass(frozen=True)
class DeviceShare:
    """What one device stores of a layout: its logical range, its pieces, its padding."""

    device: int
    logical: tuple[int, int]
    physical: tuple[int, int]
    pieces: tuple[Piece, ...]

    @property
    def padding(self) -> int:
        return (self.physical[1] - self.physical[0]) - sum(p.numel for p in self.pieces)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"128x64,32x128"`` -> ``[(128, 64), (32, 128)]``; a clear error for anything else."""
    shapes = []
    for item in (s.strip() for s in str(text).split(",")):
        parts = item.lower().split("x")
        try:
            shape = tuple(int(d) for d in parts)
        except ValueError:
            shape = ()
        if len(shape) != 2 or min(shape) < 1:
            raise ValueError(f"--shapes item {item!r} must be MxK with positive ints, e.g. 128x64")
        shapes.append(shape)
    return shapes


def planes(shapes: Sequence[Sequence[int]], devices: int, shard_layout: str | ShardLayout = "padded") -> dict:
    """The data layout of a ``QuantizedDBuffer`` of ``shapes`` on ``devices`` devices and its
    two scale layouts, as ``{"data", "rowwise_scale", "columnwise_scale"}``."""
    check_mxfp8_shapes(shapes, "shapes")
    devices = checks.positive_int(devices, "devices")
    data = GlobalLayout.build(shapes, devices, block_size=BLOCK, shard_layout=ShardLayout(shard_layout))
    return {
        "data": data,
        "rowwise_scale": rowwise_scale_layout(data),
        "columnwise_scale": columnwise_scale_layout(data),
    }


def ownership(layout: GlobalLayout) -> list[DeviceShare]:
    """One ``DeviceShare`` per segment (device ``k`` of a 1-D mesh holds segment ``k``)."""
    cap = layout.segment_capacity
    out = []
    for k, (start, end) in enumerate(layout.rank_segments):
        pieces = tuple(Piece(i, r, n, off, n * layout.row_size(i)) for i, r, n, off in layout.pieces(k) if n > 0)
        out.append(DeviceShare(k, (start, end), (k * cap, (k + 1) * cap), pieces))
    return out


def format_planes(layouts: dict) -> str:
    """The text ``mxfp8-jax layout`` prints: tensors, then each plane's rows per device."""
    data = layouts["data"]
    lines = [
        f"MXFP8 QuantizedDBuffer: {data.num_tensors} tensors on {data.dp_size} devices, "
        f"{data.shard_layout.name}, BlockAtomic({data.block_size}) (whole 32-row blocks per device)",
    ]
    for i, shape in enumerate(data.tensor_shapes):
        lines.append(f"  t{i} {shape[0]}x{shape[1]}: elements [{data.tensor_range(i)[0]}, {data.tensor_range(i)[1]})")
    for name, layout in layouts.items():
        pad = layout.physical_size - layout.numel_total
        lines += [
            "",
            f"{PLANE_TITLES[name]}",
            f"  stored {layout.physical_size} bytes, {layout.segment_capacity} per device; "
            f"padding {pad} ({100 * layout.padding_overhead:.1f}%)",
        ]
        for share in ownership(layout):
            owned = ", ".join(
                f"t{p.tensor} rows [{p.first_row}, {p.first_row + p.n_rows}) at {p.offset}" for p in share.pieces
            )
            lines.append(
                f"  device {share.device}: stored [{share.physical[0]}, {share.physical[1]}) "
                f"{owned or 'no rows'}; padding {share.padding}"
            )
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "drawing a layout needs matplotlib, which is the [viz] extra: pip install 'mxfp8-jax[viz]'"
        ) from None
    return plt


def draw_layout(layout: GlobalLayout, ax, title: str = "", *, unit: str = "elements") -> None:
    """One horizontal bar per device: its stored range, each tensor piece coloured and labelled
    with its rows, padding hatched grey."""
    plt = _pyplot()
    colors = plt.cm.tab10.colors
    cap = layout.segment_capacity
    for share in ownership(layout):
        k = share.device
        ax.barh(k, cap, color="0.92", hatch="//", edgecolor="0.6")
        for p in share.pieces:
            ax.barh(k, p.numel, left=p.offset, color=colors[p.tensor % 10], edgecolor="k")
            ax.text(
                p.offset + p.numel / 2,
                k,
                f"t{p.tensor}[{p.first_row}:{p.first_row + p.n_rows}]",
                ha="center",
                va="center",
                fontsize=8,
            )
    ax.set_yticks(range(layout.dp_size), [f"device {k}" for k in range(layout.dp_size)])
    ax.set_ylim(layout.dp_size - 0.5, -0.5)
    ax.set_xlim(0, max(cap, 1))
    ax.set_xlabel(f"{unit} within the device's segment")
    ax.set_title(f"{title}{': ' if title else ''}{100 * layout.padding_overhead:.1f}% padding", fontsize=10)


def draw_planes(layouts: dict):
    """A figure with the data layout and both scale layouts, one panel each."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    data = layouts["data"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 1.2 + 1.1 * data.dp_size), constrained_layout=True)
    for ax, (name, layout) in zip(axes, layouts.items()):
        draw_layout(layout, ax, PLANE_TITLES[name].split(" (")[0], unit="bytes")
    handles = [
        Patch(color=plt.cm.tab10.colors[i % 10], label=f"t{i} {m}x{k}") for i, (m, k) in enumerate(data.tensor_shapes)
    ]
    handles.append(Patch(facecolor="0.92", hatch="//", edgecolor="0.6", label="padding"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(f"{data.shard_layout.name} layout on {data.dp_size} devices")
    return fig
