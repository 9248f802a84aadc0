"""Prices put right for XLA:GPU's latency-hiding scheduler, handed to it as a profile.

XLA:GPU orders a step's instructions by the prices its cost model gives them, and two of those
are far off for a training step (``hlo_replay``'s docstring has the figures):

- the asynchronous copies of a scan's dynamic slices and stacked-output writes cost a fixed 5000
  cycles each, where they move a few MiB at the GPU's memory bandwidth;
- many GEMMs of 16-bit operands with an fp32 result (FSDP's wgrads, fp32 attention logits) cost
  about 60 times the same product with a 16-bit result.

Priced so, the scheduler believes the copies at the end of each backward iteration cover the
next layer's weight gathers, and puts them there, with no GEMM beside them.

XLA takes measured prices from a profile (its profile-guided latency estimator: instruction
name -> µs; an instruction the profile leaves out keeps the cost model's price). ``compile``
compiles a lowered program once with the scheduler's dump on, writes a profile that prices
those copies at their bytes, read and written, over the GPU's memory bandwidth, and those GEMMs
at the FLOP rate the cost model gives the program's own 16-bit-result GEMMs
(``hlo_schedule.corrected_gemm_us``), and compiles it again with the profile: the same program,
scheduled by prices that match what its kernels do. The profile names instructions, and the two
compilations name them alike: they differ only in the dump and the profile, which rename
nothing (tests/test_gpu_compile.py checks that the second schedule has the profile's prices).

A profile the user gives wins: the ``xla_gpu_pgle_profile_file_or_directory_path`` option (in
the options or ``XLA_FLAGS``), an ``fdo_profile``, or jax's own profile-guided compilation
(``jax_enable_pgle``); ``compile`` then compiles once, as asked.

``compile_lowered`` is the one place a lowered program is compiled (``compile`` and the FSDP
steps use it): a program that XLA:GPU cannot compile without a device (a cuDNN call, on a
compile-only device of ``jax.experimental.topologies``) raises ``NeedsDevice``, which says why
and what to do, instead of XLA's own message.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from mxfp8_jax._src.compiled import hlo_replay, hlo_schedule

PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
# the profile names only the instructions it reprices: XLA's check that a profile covers the
# program would report every other one
_QUIET = {"xla_gpu_pgle_accuracy_checker": "PGLE_STRICTNESS_LEVEL_OFF"}
# where a compilation does not say its GPU's bandwidth (a dump without the target description)
FALLBACK_BANDWIDTH = 1.0e12  # bytes per second: below every datacenter GPU's since the V100
_COPIES = ("dynamic-slice", "dynamic-update-slice")


class NeedsDevice(RuntimeError):
    """XLA:GPU cannot compile the program for compile-only devices: it holds a cuDNN call, which
    this XLA resolves only with a live cuDNN (jaxlib 0.12.1 and later; 0.12.0.1 compiled it)."""


_NO_CUDNN = re.compile(r"deviceless cuDNN compilation is not enabled.*?custom call: (?P<target>\S+)", re.S)


def compile_lowered(lowered, options: dict | None = None):
    """``lowered.compile(options)``, with ``NeedsDevice`` for a cuDNN call on compile-only GPUs."""
    import jax

    try:
        return lowered.compile(options or None)
    except jax.errors.JaxRuntimeError as e:
        m = _NO_CUDNN.search(str(e))
        if m is None:
            raise
        raise NeedsDevice(
            f"XLA:GPU of jaxlib {jax.lib.__version__} compiles cuDNN's {m['target']} only with a live "
            "cuDNN, and compile-only devices have none (it needs a GPU, or cuDNN 9.15 or later and the "
            "CUDA driver on this host). An MXFP8 GEMM step (gemm='mxfp8') for Blackwell calls it: "
            "compile that one on a GPU host; here, compile gemm='dequantized' or a GPU without "
            "block-scaled MMA (H100)"
        ) from e


@dataclasses.dataclass(frozen=True)
class Corrections:
    """The prices ``compile`` gives the scheduler: instruction name -> µs, for the GEMMs
    (``hlo_schedule.corrected_gemm_us``) and the asynchronous copies (``copy_us``);
    ``bandwidth``: the bytes per second the copies were priced at."""

    gemms: dict[str, float]
    copies: dict[str, float]
    bandwidth: float

    def __bool__(self) -> bool:
        return bool(self.gemms or self.copies)

    def profile(self) -> str:
        """The prices as XLA's profile (``ProfiledInstructionsProto`` text)."""
        costs = {**self.gemms, **self.copies}
        return "".join(f'costs {{ name: "{name}" cost_us: {us:.6g} }}\n' for name, us in sorted(costs.items()))


def copy_us(comps: dict[str, hlo_replay.Computation], bandwidth: float) -> dict[str, float]:
    """The asynchronous copies of a schedule (``hlo_replay.parse``): an asynchronous start whose
    computation is a dynamic slice or dynamic-update-slice fusion, by name -> µs to read and
    write the bytes it moves at ``bandwidth`` (bytes per second): a slice's result, an update's
    update."""
    out = {}
    for comp in comps.values():
        for i in comp.instrs.values():
            if hlo_replay.collective_kind(comps, comp, i) != "compute" or not _copies(comps, i.called):
                continue
            n = len(i.operands)
            result = i.leaves[n][1] if len(i.leaves) > n else 0
            in_place = n > 1 and result == i.leaves[0][1]  # the result is the updated operand
            moved = i.leaves[1][1] if in_place else result
            out[i.name] = 2 * moved / bandwidth * 1e6
    return out


def _copies(comps: dict[str, hlo_replay.Computation], called, depth: int = 3) -> bool:
    """Whether the computations ``called`` (ids), or those they call, slice or update a slice."""
    for cid in called:
        comp = comps.get(cid)
        if comp is None:
            continue
        if any(i.opcode in _COPIES for i in comp.instrs.values()):
            return True
        if depth and any(_copies(comps, i.called, depth - 1) for i in comp.instrs.values() if i.called):
            return True
    return False


def memory_bandwidth(dump: pathlib.Path) -> float:
    """The GPU's memory bandwidth (bytes per second) that a compilation's dump folder states
    (its target description), else ``FALLBACK_BANDWIDTH``."""
    for path in sorted(dump.glob("*gpu_target_config.pbtxt")):
        found = re.search(r"memory_bandwidth:\s*(\d+)", path.read_text())
        if found and int(found.group(1)) > 0:
            return float(found.group(1))
    return FALLBACK_BANDWIDTH


def corrections(schedule: str, text: str, bandwidth: float) -> Corrections:
    """The prices to give the scheduler, from a compilation's schedule dump (its text), its
    optimized HLO ``text`` and its GPU's memory ``bandwidth``."""
    comps, _ = hlo_replay.parse(schedule)
    gemms = hlo_schedule.corrected_gemm_us(hlo_replay.times_of(comps), hlo_schedule.gemms(text))
    return Corrections(gemms, copy_us(comps, bandwidth), bandwidth)


def user_profiled(options: dict, xla_flags: str | None = None) -> bool:
    """Whether the compilation already has a profile: ``options``, ``XLA_FLAGS`` (or
    ``xla_flags``) or jax's profile-guided compilation."""
    import jax

    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    if options.get(PROFILE_OPTION) or options.get("fdo_profile") or PROFILE_OPTION in flags:
        return True
    return bool(getattr(jax.config, "jax_enable_pgle", False))


def compile(lowered, options: dict | None = None) -> tuple[Any, Corrections | None]:
    """``lowered`` (a ``jax.stages.Lowered`` for a GPU) compiled with the scheduler's prices put
    right (module docstring), and the ``Corrections`` it was given (None: compiled once, as
    asked: the user's profile, or no schedule to read; empty: nothing to reprice, the first
    compilation kept).

    ``options``: compiler options for both compilations (the jit's own apply too). The first
    compilation's dump goes to a folder of its own, removed after; the second's goes where
    ``options`` say."""
    options = dict(options or {})
    if user_profiled(options):
        return compile_lowered(lowered, options), None
    dump = pathlib.Path(tempfile.mkdtemp(prefix="mxfp8-xla-costs-"))
    try:
        dumped = {**options, "xla_dump_to": str(dump), "xla_dump_latency_hiding_schedule": True}
        first = compile_lowered(lowered, dumped)
        schedules = sorted(dump.glob("*.schedule.txt"), key=lambda p: p.stat().st_size)
        if not schedules:  # no latency-hiding scheduler ran (not a GPU program)
            return first, None
        found = corrections(schedules[-1].read_text(), first.as_text(), memory_bandwidth(dump))
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    if not found:
        return first, found
    second = compile_lowered(lowered, {**options, "fdo_profile": found.profile().encode(), **_QUIET})
    return second, found


class CorrectedJit:
    """A jitted function whose programs are compiled by ``compile``, once per signature of its
    arguments (their tree, types and shardings), and called: what ``jax.jit`` does, with the
    scheduler's prices put right. ``lower`` and every other attribute are the jitted function's.

    Args:
      jitted: the ``jax.jit`` function (its compiler options and donations apply).
    """

    def __init__(self, jitted: Callable) -> None:
        self.jitted = jitted
        self._compiled: dict = {}

    def __call__(self, *args):
        key = _signature(args)
        if key not in self._compiled:
            self._compiled[key], _ = compile(self.jitted.lower(*args))
        return self._compiled[key](*args)

    def __getattr__(self, name: str):
        return getattr(self.jitted, name)


def _signature(args) -> tuple:
    import jax

    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((jax.typeof(x), getattr(x, "sharding", None)) for x in leaves)
