"""FSDP with MXFP8 GEMMs (``gemm="mxfp8"``): what the step lowers to, what it saves, how it learns.

The numerics of the GEMMs themselves are ``test_mxfp8_gemm.py``'s. Here: the whole training
step lowered for CUDA and ROCm on this CPU host (cross-platform lowering) holds one block-scaled
GEMM per GEMM of the recipe, on E4M3 operands, and no dot of a dequantized weight; on CPU it takes
the exact path; the compiled step saves x's columnwise planes instead of x; the transformer learns
real text as well as with bf16 compute.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from mxfp8_jax import flax as mxflax
from mxfp8_jax._src.compiled import hlo
from mxfp8_jax._src.ops import mxfp8_gemm

from conftest import cpu_only

WIDTH = 128


class Block(nnx.Module):
    """``x + b(a(x))``: two bf16 projections and nothing else, so every activation the backward
    keeps is a GEMM input."""

    def __init__(self, d: int, rngs: nnx.Rngs) -> None:
        self.a = nnx.Linear(d, 2 * d, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)
        self.b = nnx.Linear(2 * d, d, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return x + self.b(self.a(x))


class Stack(nnx.Module):
    def __init__(self, depth: int, d: int, remat: bool, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(d, rngs)

        self.blocks, self.remat = make(rngs), remat

    def __call__(self, x):
        def body(x, block):
            return block(x)

        if self.remat:
            body = nnx.remat(body)
        return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)


def loss_fn(model, x):
    return jnp.mean(model(x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


def _fsdp(mesh, *, depth=3, remat=False, tokens=16, gemm="mxfp8", **kw):
    model = nnx.eval_shape(lambda: Stack(depth, WIDTH, remat, nnx.Rngs(0)))
    batch = jax.ShapeDtypeStruct((mesh.size * tokens, WIDTH), jnp.float32)
    return mxflax.FSDP(model, mesh, loss_fn=loss_fn, example_batch=batch, gemm=gemm, **kw), batch


def _lowered_text(fsdp, batch, platform: str) -> str:
    """The step's StableHLO for ``platform``: as ``lower_train_step`` lowers it on the mesh's own
    platform, else lowered across platforms (CUDA and ROCm from a CPU host; the CPU in GPU mode)."""
    tx = optax.sgd(0.1)
    lowered = fsdp.lower_train_step(loss_fn, tx, fsdp.abstract_state(tx), batch)
    if platform == fsdp.mesh.devices.flat[0].platform:
        return lowered.as_text()
    return (
        jax.jit(fsdp._steps.step(loss_fn, tx, False))
        .trace(fsdp.abstract_state(tx), batch)
        .lower(lowering_platforms=(platform,))
        .as_text()
    )


def _reachable(text: str, pattern: str) -> int:
    """Occurrences of ``pattern`` in the module's ``main`` counting each call of a private
    function as often as it is called (jax outlines shared functions; a loop body counts once)."""
    funcs, current = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*func\.func (?:public |private )?@([\w$.-]+)\(", line)
        if m:
            current = m.group(1)
            funcs[current] = [0, []]
            continue
        if current is not None:
            funcs[current][0] += len(re.findall(pattern, line))
            funcs[current][1] += re.findall(r"call @([\w$.-]+)\(", line)
    memo: dict = {}

    def total(name):
        if name not in memo:
            direct, calls = funcs[name]
            memo[name] = direct + sum(total(c) for c in calls if c in funcs)
        return memo[name]

    return total("main")


def _calls_of(text: str, target: str) -> list[str]:
    return [line for line in text.splitlines() if f"custom_call @{target}(" in line]


# ------------------------------------------------------------------------------------------------
# What the step lowers to


@pytest.mark.parametrize("remat", [False, True], ids=["no-remat", "remat"])
def test_cuda_step_runs_every_unit_gemm_as_one_block_scaled_gemm(mesh, remat):
    fsdp, batch = _fsdp(mesh, remat=remat)
    text = _lowered_text(fsdp, batch, "cuda")
    units = len(fsdp.mxfp8_units)
    assert units == 2
    # forward, dgrad, wgrad per unit; under remat the recomputed forward of `a` (its output is
    # b's input, quantized again for b's saved planes) - b's recomputed product is unused and
    # jax drops it before lowering. Each forward GEMM lowered twice (the loop, its last layer
    # peeled off), each backward one three times (the loop, the last layer peeled off as the
    # one the forward kept, layer 0 peeled off, whose dgrad of `a` is the batch's gradient,
    # unused: fsdp_fetch)
    expected = 2 * units + 3 * (2 * units + 1) - 1 if remat else 3 * units
    assert _reachable(text, r"custom_call @__op\$block_scaled_dot\(") == expected
    for line in _calls_of(text, "__op$block_scaled_dot"):
        operands = line.rsplit(" : ", 1)[1].split(" -> ")[0]
        types = re.findall(r"tensor<([^>]*)>", operands)
        assert [t.rsplit("x", 1)[1] for t in types] == ["f8E4M3FN", "f8E4M3FN", "f8E8M0FNU", "f8E8M0FNU"], line
    # no GEMM anywhere on dequantized values: every product of the step is block-scaled
    assert _reachable(text, r"stablehlo\.dot_general") == 0


def test_rocm_step_lowers_to_the_scaled_dot_composite(mesh):
    fsdp, batch = _fsdp(mesh)
    text = _lowered_text(fsdp, batch, "rocm")
    assert _reachable(text, r'stablehlo\.composite "xla\.scaled_dot"') == 3 * len(fsdp.mxfp8_units)
    assert "__op$block_scaled_dot" not in text


def test_cpu_step_takes_the_exact_path(mesh):
    fsdp, batch = _fsdp(mesh)
    text = _lowered_text(fsdp, batch, "cpu")
    assert "block_scaled_dot" not in text and "xla.scaled_dot" not in text
    # the exact path: one fp32 dot per GEMM of the recipe, on dequantized fp32 operands
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3 * len(fsdp.mxfp8_units)
    assert all("bf16" not in line for line in dots)
    assert mxfp8_gemm.gemm_paths() == {"cpu": "exact", "cuda": "native", "rocm": "native"}


# ------------------------------------------------------------------------------------------------
# Memory: x's columnwise planes (8.25 bits) are saved instead of x (16 bits)


def _forward_loop_state(text: str, depth: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, shape)`` of every buffer the forward scan's compiled while loop carries: what it
    reads per layer (the stacked weights) and what it writes per layer for the backward (the
    stacked residuals)."""
    loops = [
        line
        for line in text.splitlines()
        if " while(" in line and f'"known_trip_count":{{"n":"{depth}"}}' in line and "transpose(" not in line
    ]
    assert len(loops) == 1, loops
    state = loops[0].split(" = (", 1)[1].split(") while(", 1)[0]
    return [
        (dt, tuple(int(d) for d in dims.split(",") if d))
        for dt, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]", state)
    ]


def test_saved_gemm_inputs_shrink(mesh):
    """What the compiled forward loop saves per layer and token for the backward: both GEMM
    inputs as bf16 (2 bytes an element) with dequantized weights, as their columnwise planes
    (1 + 1/32 bytes) with MXFP8 GEMMs. Read from the loop's state in the compiled HLO, as the
    difference between two token counts (the stacked weights, the same for both, cancel), so
    the figure is exact; the temp memory XLA reports shrinks with it. ``tokens`` are per device."""
    cpu_only("the compiled CPU step's loop state and temp memory")
    tx = optax.sgd(0.1)
    depth, few, many = 4, 128, 256
    per_token, temp = {}, {}
    for gemm in ("dequantized", "mxfp8"):
        saved = {}
        for tokens in (few, many):
            fsdp, batch = _fsdp(mesh, depth=depth, tokens=tokens, gemm=gemm)
            compiled = fsdp.lower_train_step(loss_fn, tx, fsdp.abstract_state(tx), batch).compile()
            stacked = [
                (dt, shape) for dt, shape in _forward_loop_state(compiled.as_text(), depth) if shape[:1] == (depth,)
            ]
            saved[tokens] = sum(hlo.dtype_bytes(dt) * math.prod(shape) for dt, shape in stacked)
            temp[gemm, tokens] = compiled.memory_analysis().temp_size_in_bytes
        per_token[gemm] = (saved[many] - saved[few]) / (depth * (many - few))
    gemm_inputs = WIDTH + 2 * WIDTH  # a's input and b's, elements per token and layer
    assert per_token == {"dequantized": 2 * gemm_inputs, "mxfp8": gemm_inputs * (1 + 1 / 32)}
    # XLA's buffer assignment shares and aligns buffers, so its temp total moves by other
    # amounts than the loop state; it still falls, at both token counts
    assert temp["mxfp8", few] < temp["dequantized", few] and temp["mxfp8", many] < temp["dequantized", many], temp


# ------------------------------------------------------------------------------------------------
# Arguments


def test_native_path_where_the_platform_has_none_is_an_error(mesh):
    with pytest.raises(ValueError, match="gemm_path='native'.*no native block-scaled GEMM"):
        _fsdp(mesh, gemm_path="native")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(gemm="fp8"), "gemm='fp8' must be one of"),
        (dict(gemm_path="cudnn"), "gemm_path='cudnn' must be one of"),
    ],
)
def test_bad_gemm_arguments(mesh, kw, match):
    kw = {"gemm": "mxfp8", **kw}
    with pytest.raises(ValueError, match=match):
        _fsdp(mesh, **kw)


# ------------------------------------------------------------------------------------------------
# Convergence on real text


SEQUENCES = 64  # per step: the demo's 8 per device on 8 devices


def test_transformer_learns_text_with_mxfp8_gemms_as_with_bf16(devices):
    """The demo's transformer on held-out standard-library text: MXFP8 GEMMs (and gathers) vs
    bf16 FSDP, same weights, batches and schedule; validation losses within 1%. The demo's
    training (``training.train``, as ``demo.run`` calls it) with 64 sequences a step whatever the
    device count (the demo's on 8 devices), on as many of the run's devices as split them
    evenly (all of 2, 4 or 8): the same training on any of them."""
    from mxfp8_jax import training

    n = math.gcd(len(devices), SEQUENCES)
    mesh = Mesh(np.array(devices[:n]), ("data",))
    work = training.Workload("transformer", hidden=128, layers=1, seed=0, steps=24, data="text")
    work.per_device_batch = SEQUENCES // n
    m = training.train(work, "mxfp8", mesh=mesh, gemm="mxfp8", label="mxfp8 gemm")
    b = training.train(work, "bf16", mesh=mesh, gemm="dequantized")
    assert m["gemm"] == "mxfp8" and b["gemm"] == "dequantized"
    assert len(b["losses"]) == 24 and b["validation_loss"] is not None
    first = b["losses"][0]
    assert b["validation_loss"] < first - 1.0  # both learned: far below the untrained loss
    assert abs(m["validation_loss"] - b["validation_loss"]) <= 0.01 * b["validation_loss"], (
        m["validation_loss"],
        b["validation_loss"],
    )


# ------------------------------------------------------------------------------------------------
# The norm's MXFP8 planes are the GEMMs' operands


@pytest.mark.parametrize("cfg_gemm, expected", [("mxfp8", 2 + 7 + 7), ("dequantized", 7 + 7 + 7)])
def test_norm_planes_feed_the_gemms_without_a_quantize_of_their_own(mesh, cfg_gemm, expected):
    """One block, no remat: the step's quantize calls (RMSNorm + quantize is a call of its own).
    With the norms' columnwise planes (``TransformerConfig(gemm="mxfp8")``) the forward
    quantizes only o's and down's inputs (2), the backward each unit's dy (7) and the update
    each unit's new master shard (7): q/k/v and gate/up take the norm's planes as they are.
    Without them, each of those five quantizes the norm's output for its wgrad (5 more)."""
    from mxfp8_jax import models

    cfg = models.TransformerConfig(
        vocab=64, hidden=64, heads=2, head_dim=32, mlp=256, layers=1, remat=False, norm="mxfp8", gemm=cfg_gemm
    )
    model = nnx.eval_shape(lambda: models.TransformerLM(cfg, rngs=nnx.Rngs(0)))
    batch = jax.ShapeDtypeStruct((mesh.size * 2, 33), jnp.int32)
    fsdp = mxflax.FSDP(model, mesh, loss_fn=models.next_token_loss, example_batch=batch, gemm="mxfp8")
    tx = optax.sgd(0.1)
    text = fsdp.lower_train_step(models.next_token_loss, tx, fsdp.abstract_state(tx), batch).as_text()
    assert len(fsdp.mxfp8_units) == 7
    assert _reachable(text, r"custom_call @mxfp8_quantize\(") == expected
