"""Planted-bug (mutation) check of the test suite: does some test fail for each known bug?

Each mutant below is one deliberate bug, written as search/replace edits of the repository's
sources: the package's Python, or the GPU kernels' sources and their HIP-CPU shims
(``xla_ffi/``). For each mutant in turn the script copies ``mxfp8_jax/``, ``xla_ffi/``,
``tests/`` and ``pyproject.toml`` into a fresh temporary directory (the working tree is never
touched), applies the edits there, and runs the tests named for that mutant against the copy. A
mutant is *caught* when those tests fail, *missed* when they pass (and *unbuilt* when the
copy's GPU kernels do not compile on HIP-CPU, which proves nothing). A search string that no
longer occurs exactly once in its file stops the run with an error naming the mutant: fix the
pattern after an upstream edit instead of letting a mutant silently become a no-op.

The compiled extension is not rebuilt: the copy uses the ``_mxfp8_*`` modules of the installed
package, so the Python mutants cover the Python sources (the pure-JAX numerics, layouts,
placements, tensor helpers, the FFI call sites and the FSDP gradient path), and the CPU kernels
are the oracles. The GPU mutants are caught by the ``hipcpu`` tests (tests/test_hipcpu.py), which
build the copy's ``xla_ffi/`` on HIP-CPU themselves (about a minute and a half per mutant on
two cores) and compare its bytes with the CPU kernels; they need HIP-CPU (``MXFP8_HIP_CPU``, or
``../shared/hip-cpu`` beside the repository), and the script stops when it is missing rather
than count their skips as misses.

Run on demand, not in CI (one mutant takes from seconds to a minute or two, mostly compiling):

    python scripts/mutants.py              # every mutant, then a caught/missed table
    python scripts/mutants.py --list       # the mutants and their tests
    python scripts/mutants.py rceil-tiny-boundary unpadded-greedy-cuts   # chosen ones
    python scripts/mutants.py --gpu        # the GPU-source mutants only
    python scripts/mutants.py --check      # only verify that every pattern still applies
    python scripts/mutants.py --tests tests/test_quantize.py rceil-tiny-boundary   # other tests

The gpu-*-by-default-backend mutants name tests of ``tests/test_gpu_compile.py`` too: run them
in an environment with the gpu-compile extra (jax's CUDA plugin), where that file is collected.

The exit status is 1 when any mutant is missed or unbuilt (or a pattern no longer applies), else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]  # (file relative to the repository root, search, replace)
    tests: tuple[str, ...]  # pytest node ids (or files), relative to the repository root

    @property
    def gpu(self) -> bool:
        """A mutant of the GPU kernels' sources (or their HIP-CPU shims): the hipcpu tests catch it."""
        return any(rel.startswith("xla_ffi/") for rel, _, _ in self.edits)


MUTANTS = (
    # -- numerics -------------------------------------------------------------------------------
    Mutant(
        "rceil-tiny-boundary",
        "rceil: `>=` turned into `>` where v = amax/448 is subnormal (amax 0x04600002 gets byte 0)",
        (
            (
                "mxfp8_jax/_src/numerics/format.py",
                "tiny = (amax_bits >= _AMAX_BYTE_1)",
                "tiny = (amax_bits > _AMAX_BYTE_1)",
            ),
        ),
        ("tests/test_scale_boundaries.py",),
    ),
    Mutant(
        "floor-off-by-one",
        "floor: byte = exp - 7 instead of exp - 8",
        (
            (
                "mxfp8_jax/_src/numerics/format.py",
                "byte = jnp.clip(exp - 8, 0, 254)",
                "byte = jnp.clip(exp - 7, 0, 254)",
            ),
        ),
        ("tests/test_scale_boundaries.py",),
    ),
    Mutant(
        "columnwise-dequantize-scales",
        "MXFP8Tensor.dequantize(columnwise=True) applies the scale rows in reverse order",
        (
            (
                "mxfp8_jax/_src/numerics/tensor.py",
                "data, scale, axis = self.columnwise_data, self.columnwise_scale, 0",
                "data, scale, axis = self.columnwise_data, self.columnwise_scale[::-1], 0",
            ),
        ),
        ("tests/test_tensor.py", "tests/test_fsdp_scale.py::test_gradients_match_single_device_reference"),
    ),
    Mutant(
        "dequantize-default-dtype",
        "MXFP8Tensor.dequantize() defaults to bf16 instead of the tensor's nominal dtype",
        (
            (
                "mxfp8_jax/_src/numerics/tensor.py",
                "dtype = jnp.dtype(self.dtype if dtype is None else dtype)",
                "dtype = jnp.dtype(jnp.bfloat16 if dtype is None else dtype)",
            ),
        ),
        ("tests/test_tensor.py",),
    ),
    # -- layout: TE padding, cuBLAS swizzle, E8M0 view, UNPADDED cuts ---------------------------
    Mutant(
        "swizzle-tile-order",
        "swizzle_scale: the 32-row groups and 4-row quarters of a 128x4 tile swapped",
        (
            (
                "mxfp8_jax/_src/numerics/tensor.py",
                "4).transpose(0, 3, 2, 1, 4).reshape(-1)",
                "4).transpose(0, 3, 1, 2, 4).reshape(-1)",
            ),
        ),
        ("tests/test_tensor.py",),
    ),
    Mutant(
        "padded-scales-columnwise-unswizzled",
        "padded_scales(swizzle=True) leaves the columnwise plane in its padded order",
        (
            (
                "mxfp8_jax/_src/numerics/tensor.py",
                "col = None if col is None else swizzle_scale(col, columnwise=True)",
                "col = None if col is None else col.reshape(-1)",
            ),
        ),
        ("tests/test_tensor.py",),
    ),
    Mutant(
        "scale-e8m0-columnwise",
        "MXFP8Tensor.scale_e8m0(columnwise=True) returns the rowwise scales",
        (
            (
                "mxfp8_jax/_src/numerics/tensor.py",
                "s = self.columnwise_scale if columnwise else self.rowwise_scale",
                "s = self.rowwise_scale if self.rowwise_scale is not None else self.columnwise_scale",
            ),
        ),
        ("tests/test_tensor.py",),
    ),
    Mutant(
        "unpadded-greedy-cuts",
        "UNPADDED bounds cut greedily (each segment as long as allowed) instead of balanced",
        (
            (
                "mxfp8_jax/_src/buffers/layout.py",
                "bounds.append(min(cands, key=lambda c: (abs(c - ideal), c)))",
                "bounds.append(max(cands))",
            ),
        ),
        ("tests/test_layout.py",),
    ),
    Mutant(
        "to-te-dq-dtype-default",
        "to_te gives TE bf16 as the dequantize dtype whatever the tensor's nominal dtype",
        (
            (
                "mxfp8_jax/_src/tooling/te.py",
                "dq_dtype=jnp.dtype(t.dtype if dq_dtype is None else dq_dtype),",
                "dq_dtype=jnp.dtype(jnp.bfloat16 if dq_dtype is None else dq_dtype),",
            ),
        ),
        ("tests/test_te.py",),
    ),
    # -- placements -----------------------------------------------------------------------------
    Mutant(
        "partition-spec-axis-order",
        "partition_spec lists the Shard axes outermost first (the shard order of shard_index reversed)",
        (
            (
                "mxfp8_jax/_src/buffers/placement.py",
                "axes = tuple(reversed(shard_axes(mesh, placements)))",
                "axes = tuple(shard_axes(mesh, placements))",
            ),
        ),
        ("tests/test_placement.py", "tests/test_dbuffer.py"),
    ),
    Mutant(
        "shard-index-axis-order",
        "shard_index reads the outermost Shard axis as the most significant digit",
        (("mxfp8_jax/_src/buffers/placement.py", "for name in reversed(axes):", "for name in axes:"),),
        ("tests/test_placement.py", "tests/test_dbuffer.py"),
    ),
    # -- fused RMSNorm + quantize: the scale rule reaches the kernels ----------------------------
    Mutant(
        "rmsnorm-quant-ignores-scale-rule",
        "rmsnorm_quant's kernel call always passes rceil",
        (("mxfp8_jax/_src/ops/rmsnorm.py", "scale_rule=cfg.rule.code,", "scale_rule=0,"),),
        ("tests/test_scale_rule_paths.py",),
    ),
    Mutant(
        "allgather-p2p-ignores-scale-rule",
        'allgather_rmsnorm_quant (strategy="p2p") always passes rceil',
        (("mxfp8_jax/_src/ops/fused.py", "scale_rule=n.rule.code,", "scale_rule=0,"),),
        ("tests/test_scale_rule_paths.py",),
    ),
    # -- FSDP -----------------------------------------------------------------------------------
    Mutant(
        "fsdp-ignores-scale-rule",
        "FSDP quantizes its masters with the default rule whatever scale_rule says",
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_planes.py",
                "t = quantize(w.astype(jnp.float32).reshape(-1, k), scale_rule=scale_rule)",
                "t = quantize(w.astype(jnp.float32).reshape(-1, k))",
            ),
        ),
        ("tests/test_fsdp_scale.py::test_floor_rule_planes_and_gradients",),
    ),
    Mutant(
        "fsdp-plain-gradient-averaged-over-devices",
        "a plain parameter's gradient is the mean of the devices' parts, not their sum (the "
        "per-device loss's reduction over the batch)",
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_islands.py",
                "    return lax.psum_scatter(ct, entry, scatter_dimension=axis, tiled=True), None",
                "    return lax.psum_scatter(ct, entry, scatter_dimension=axis, tiled=True) / lax.psum(1, entry), None",
            ),
        ),
        ("tests/test_fsdp_semantics.py::test_batchnorm_training_uses_the_batch_statistics_of_the_whole_batch",),
    ),
    Mutant(
        "fsdp-unit-gradient-averaged-over-devices",
        "a unit's dW is the mean of the devices' parts, not their sum",
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_unit.py",
                "    dw = g.to_master(d_param, g.level)\n    return lax.psum_scatter(dw, g.axes,",
                "    dw = g.to_master(d_param, g.level) / lax.psum(1, g.axes)\n    return lax.psum_scatter(dw, g.axes,",
            ),
        ),
        ("tests/test_fsdp_semantics.py::test_masked_lm_loss_aux_and_update_are_the_unsharded_models",),
    ),
    Mutant(
        "fsdp-bf16-dgrad-negated",
        'precision="bf16": the dgrad GEMM reads -W',
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_unit.py",
                "gathered_bytes, columnwise=not op.transposed, ready=ready))\n",
                "gathered_bytes, columnwise=not op.transposed, ready=ready))\n"
                '    v = v if op.geometry.precision == "mxfp8" else -v\n',
            ),
        ),
        ("tests/test_fsdp_scale.py::test_bf16_gradients_match_single_device_reference",),
    ),
    Mutant(
        "fsdp-dgrad-rowwise-plane",
        "the MXFP8 dgrad gathers the rowwise planes (blocks along the wrong axis)",
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_unit.py",
                "return fetched if op.reuses else _local(op, master, planes, backward=True)",
                "return fetched if op.reuses else _local(op, master, planes, backward=False)",
            ),
            (
                "mxfp8_jax/_src/fsdp/fsdp_unit.py",
                "v = op.value(widened(op.geometry, gathered_bytes, columnwise=not op.transposed, ready=",
                "v = op.value(widened(op.geometry, gathered_bytes, columnwise=op.transposed, ready=",
            ),
        ),
        ("tests/test_fsdp_scale.py::test_gradients_match_single_device_reference",),
    ),
    Mutant(
        "fsdp-padding-rows-get-gradient",
        "the wgrad's padding rows (below N) receive ones instead of zeros",
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_unit.py",
                "    dw = g.to_master(d_param, g.level)\n",
                "    dw = g.to_master(d_param, g.level)\n    dw = dw.at[..., g.out_features :, :].set(1.0)\n",
            ),
        ),
        ("tests/test_flax.py::test_sharded_gradients_match_single_device_reference",),
    ),
    Mutant(
        "fsdp-transposed-gemm-rowwise",
        "a GEMM contracting a unit's N axes (a tied weight's W.T) reads the rowwise planes forward",
        (("mxfp8_jax/_src/fsdp/fsdp_unit.py", "rowwise = op.transposed == backward", "rowwise = not backward"),),
        ("tests/test_fsdp_units.py::test_tied_weight_reads_the_planes_of_each_contraction",),
    ),
    Mutant(
        "fsdp-lookup-columnwise",
        "an MXFP8 table is looked up in its columnwise values (blocks along the vocabulary)",
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_unit.py",
                "def _lookup(op: UnitOp, others, master, planes, pick, token):\n"
                "    local = after(_local(op, master, planes, backward=False, pick=pick), token)",
                "def _lookup(op: UnitOp, others, master, planes, pick, token):\n"
                "    local = after(_local(op, master, planes, backward=True, pick=pick), token)",
            ),
            (
                "mxfp8_jax/_src/fsdp/fsdp_unit.py",
                "return op.bind(op.value(gathered(op.geometry, local, columnwise=False, ready=ready)), others)",
                "return op.bind(op.value(gathered(op.geometry, local, columnwise=True, ready=ready)), others)",
            ),
        ),
        ("tests/test_fsdp_units.py::test_an_mxfp8_table_is_looked_up_in_its_rowwise_values",),
    ),
    Mutant(
        "fsdp-remat-recompute-unordered",
        "a rematerialised region's recompute does not wait for the cotangent (XLA:CPU merges it away)",
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_islands.py",
                "moved = after([a for a, ok in zip(args, numeric) if ok], token)",
                "moved = after([a for a, ok in zip(args, numeric) if ok], None)",
            ),
        ),
        ("tests/test_fsdp_models.py::test_loop_remat_gathers_again_in_the_backward",),
    ),
    # -- MXFP8 GEMMs ----------------------------------------------------------------------------
    Mutant(
        "gemm-contraction-in-dot-order",
        "MXFP8 GEMM: x's contracted axes kept in the layer's dot order, not the kernel's (blocks of K mismatched)",
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_unit.py",
                "return x if self.pc is None else x[..., np.argsort(self.pc)]",
                "return x",
            ),
        ),
        ("tests/test_mxfp8_gemm.py::test_fsdp_mxfp8_einsum_kernels_of_several_axes",),
    ),
    Mutant(
        "fsdp-stack-gradient-into-layer-0",
        "a layer picked by a traced index (fori_loop w[i]) sends its gradient to layer 0 of the stack",
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_unit.py",
                "start = (*pick, *(jnp.zeros((), jnp.int32),) * d_layer.ndim)",
                "start = (*(0 * i for i in pick), *(jnp.zeros((), jnp.int32),) * d_layer.ndim)",
            ),
        ),
        (
            "tests/test_fsdp_stacks.py::"
            "test_a_stack_read_by_index_is_a_unit_read_a_layer_at_a_time_and_the_step_is_exact[fori]",
        ),
    ),
    Mutant(
        "fsdp-static-index-reads-layer-0",
        "a static index w[i] (a Python loop over a stack) reads layer 0 of the split stack",
        (("mxfp8_jax/_src/fsdp/fsdp_eval.py", "a = self.splits[id(a)][1][i]", "a = self.splits[id(a)][1][0]"),),
        (
            "tests/test_fsdp_stacks.py::"
            "test_a_stack_read_by_index_is_a_unit_read_a_layer_at_a_time_and_the_step_is_exact[python]",
        ),
    ),
    Mutant(
        "gpu-backward-by-default-backend",
        "a unit's dgrad and wgrad choose fp32 by this process's default backend, not the lowering platform",
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_dots.py",
                "    return lax.platform_dependent(act, v, dy, cpu=cpu, default=grads(layer))",
                '    return (cpu if jax.default_backend() == "cpu" else grads(layer))(act, v, dy)',
            ),
        ),
        (
            "tests/test_gpu_step.py::test_backward_gemms_follow_the_lowering_platform",
            "tests/test_gpu_compile.py::test_the_gpu_step_multiplies_every_unit_in_bf16",
        ),
    ),
    Mutant(
        "gpu-forward-by-default-backend",
        "a unit's forward GEMM widens to fp32 by this process's default backend, not the lowering platform",
        (
            (
                "mxfp8_jax/_src/fsdp/fsdp_dots.py",
                "    return lax.platform_dependent(act, v, cpu=widened, default=as_written)",
                '    return (widened if jax.default_backend() == "cpu" else as_written)(act, v)',
            ),
        ),
        (
            "tests/test_gpu_step.py::test_backward_gemms_follow_the_lowering_platform",
            "tests/test_gpu_compile.py::test_the_gpu_step_multiplies_every_unit_in_bf16",
        ),
    ),
    Mutant(
        "fsdp-prefetch-waits-for-own-input",
        "prefetch=1 ignored: a layer's gathers wait for its own input again",
        (("mxfp8_jax/_src/fsdp/fsdp_eval.py", "        if not self.islands.prefetch:\n", "        if True:\n"),),
        ("tests/test_fsdp_overlap.py::test_a_python_loop_gathers_each_layer_while_the_layer_before_computes",),
    ),
    Mutant(
        "gemm-exact-unshifted",
        "exact MXFP8 GEMM: operands dequantized without the row shift (tiny values flushed by the CPU dot)",
        (
            ("mxfp8_jax/_src/ops/mxfp8_gemm.py", "byte = jnp.where(s == 0xFF, 0xFF, s - exponent + 127)", "byte = s"),
            (
                "mxfp8_jax/_src/ops/mxfp8_gemm.py",
                "shift = ea + jnp.swapaxes(ew, 1, 2) - 254",
                "shift = 0 * (ea + jnp.swapaxes(ew, 1, 2))",
            ),
        ),
        ("tests/test_mxfp8_gemm.py::test_operand_values_outside_the_fp32_normal_range_still_multiply",),
    ),
    Mutant(
        "gemm-wgrad-rows-in-value-order",
        "MXFP8 GEMM from the fused op: dy's columnwise planes made in the value's row order, x's in the gathered order",
        (
            (
                "mxfp8_jax/_src/ops/mxfp8_gemm.py",
                "    if order is None:\n        q = quantize_tokens(dy",
                "    if True:\n        q = quantize_tokens(dy",
            ),
        ),
        ("tests/test_tp.py::test_mxfp8_gemms_from_the_fused_op_match_fsdp_only",),
    ),
)


# -- GPU kernels, run on HIP-CPU by tests/test_hipcpu.py ----------------------------------------
_HIPCPU = "tests/test_hipcpu.py::"

GPU_MUTANTS = (
    Mutant(
        "gpu-quantize-col-scale-stride",
        "quantize kernel (an index): a band's columnwise scales at band * K/32 instead of band * K",
        (
            (
                "xla_ffi/gpu/quantize.cu",
                "if (p.col_q) d.col_q = p.col_q + e, d.col_s = p.col_s + band * K + col0;",
                "if (p.col_q) d.col_q = p.col_q + e, d.col_s = p.col_s + band * d.lds + col0;",
            ),
        ),
        (_HIPCPU + "test_quantize_matches_the_cpu_kernel",),
    ),
    Mutant(
        "gpu-segments-col-scale-offset",
        "segments kernel (an index): a piece's columnwise scales start at 0, not at offset / 32",
        (
            (
                "xla_ffi/gpu/quantize_segments.cu",
                "d.col_s = p.col_s + s0 + band * mine.row_len + col0;",
                "d.col_s = p.col_s + band * mine.row_len + col0;",
            ),
        ),
        (_HIPCPU + "test_segments_match_the_cpu_kernel",),
    ),
    Mutant(
        "gpu-exact-column-exchange-mask",
        "exact form (a shuffle mask): a column's two half-amaxes joined with lane ^ 8, not its partner lane ^ 16",
        (
            (
                "xla_ffi/gpu/tile.cuh",
                "amax = max(amax, shfl_xor(amax, kTileCols, kGroupLanes));",
                "amax = max(amax, shfl_xor(amax, kTileCols / 2, kGroupLanes));",
            ),
        ),
        (_HIPCPU + "test_quantize_matches_the_cpu_kernel",),
    ),
    Mutant(
        "gpu-fast-column-exchange-mask",
        "fast form, CUDA only (a shuffle mask): a column's half-amaxes joined with lane ^ 8",
        (
            (
                "xla_ffi/gpu/tile.cuh",
                "const uint32_t amax = max(camax[i], shfl_xor(camax[i], kTileCols, kGroupLanes));",
                "const uint32_t amax = max(camax[i], shfl_xor(camax[i], kTileCols / 2, kGroupLanes));",
            ),
        ),
        (_HIPCPU + "test_quantize_matches_the_cpu_kernel[cuda]",),
    ),
    Mutant(
        "gpu-tiles-amax-one-column-run",
        "32x32 kernel (a shuffle): a tile's amax joined only over the lanes of one column run (32 rows "
        "of 4 or 8 columns), not the whole 32-lane group",
        (
            (
                "xla_ffi/gpu/quantize_tiles.cu",
                "for (int m = 1; m < kGroupLanes; m <<= 1) amax = max(amax, shfl_xor(amax, m, kGroupLanes));",
                "for (int m = S; m < kGroupLanes; m <<= 1) amax = max(amax, shfl_xor(amax, m, kGroupLanes));",
            ),
        ),
        (_HIPCPU + "test_tiles_match_the_cpu_kernel",),
    ),
    Mutant(
        "gpu-tiles-scale-row-stride",
        "32x32 kernel (an index): a band's tile scales at tile_row * M/32 instead of tile_row * K/32",
        (
            (
                "xla_ffi/gpu/quantize_tiles.cu",
                "s[tile_row * tiles_k + tile_col] = scale;",
                "s[tile_row * (M / kBlock) + tile_col] = scale;",
            ),
        ),
        (_HIPCPU + "test_tiles_match_the_cpu_kernel",),
    ),
    Mutant(
        "gpu-tiles-fast-form-with-nan",
        "32x32 kernel, fast form, CUDA only (a vendor branch): a warp holding a NaN takes the hardware "
        "cast, which loses a -NaN's sign",
        (("xla_ffi/gpu/quantize_tiles.cu", "if (any_lane(nan)) return false;", "if (any_lane(false)) return false;"),),
        (_HIPCPU + "test_tiles_match_the_cpu_kernel[cuda]",),
    ),
    Mutant(
        "gpu-rmsnorm-tree-short",
        "RMSNorm (a shuffle): the lane tree stops before its last exchange (width 1)",
        (
            (
                "xla_ffi/gpu/rmsnorm.cuh",
                "for (int s = kNormLanes / 2; s >= 1; s /= 2) p = add_rn(p, shfl_xor(p, s, kNormLanes));",
                "for (int s = kNormLanes / 2; s > 1; s /= 2) p = add_rn(p, shfl_xor(p, s, kNormLanes));",
            ),
        ),
        (_HIPCPU + "test_rmsnorm_quantize_matches_the_cpu_kernel",),
    ),
    Mutant(
        "gpu-quantize-ragged-tail",
        "quantize kernel (a tail condition): a lane whose 16 rows pass the last row quantizes none of them",
        (("xla_ffi/gpu/quantize.cu", "d.rows = active && left > 0 ?", "d.rows = active && left >= kTileRows ?"),),
        (_HIPCPU + "test_quantize_matches_the_cpu_kernel",),
    ),
    Mutant(
        "gpu-quantize-tail-overrun",
        "quantize kernel (a tail condition): a lane holding the last rows writes all 16 rows, past the planes' end",
        (
            (
                "xla_ffi/gpu/quantize.cu",
                "static_cast<int>(left < kTileRows ? left : kTileRows)",
                "static_cast<int>(kTileRows)",
            ),
        ),
        (_HIPCPU + "test_quantize_matches_the_cpu_kernel",),
    ),
    Mutant(
        "gpu-rmsnorm-rows-partial-step",
        "RMSNorm rows kernel (a tail condition): the last step of a row not a multiple of 256 wide is not written",
        (
            (
                "xla_ffi/gpu/rmsnorm_kernels.cuh",
                "if (i * kNormStep < H)  // uniform across the warp",
                "if ((i + 1) * kNormStep <= H)  // uniform across the warp",
            ),
        ),
        (_HIPCPU + "test_rmsnorm_quantize_matches_the_cpu_kernel",),
    ),
    Mutant(
        "gpu-rmsnorm-bands-no-barrier",
        "RMSNorm bands kernel (a barrier): the band's inverse RMS values read without waiting for the "
        "lanes that write them",
        (
            (
                "xla_ffi/gpu/rmsnorm_kernels.cuh",
                "    if (lane == 0) inv[k] = rms_inverse(s, H, prm.eps);\n  }\n  block_sync();\n",
                "    if (lane == 0) inv[k] = rms_inverse(s, H, prm.eps);\n  }\n",
            ),
        ),
        (_HIPCPU + "test_rmsnorm_quantize_matches_the_cpu_kernel",),
    ),
    Mutant(
        "gpu-segments-gaps-no-barrier",
        "segments gaps kernel (a barrier): a thread reads the pieces near its block before the others have listed them",
        (
            (
                "xla_ffi/gpu/quantize_segments.cu",
                "    if (slot < kMaxPieces) near[slot] = q;  // more only with overlapping (invalid) tables\n  }\n"
                "  block_sync();\n",
                "    if (slot < kMaxPieces) near[slot] = q;  // more only with overlapping (invalid) tables\n  }\n",
            ),
        ),
        (_HIPCPU + "test_segments_match_the_cpu_kernel",),
    ),
    Mutant(
        "gpu-gather-row-table",
        "fused gather kernel: the first row of each rank read from the rank before it",
        (
            (
                "xla_ffi/gpu/rmsnorm_kernels.cuh",
                "while (k + 1 < table.ranks && r >= table.start[k + 1]) ++k;",
                "while (k + 1 < table.ranks && r > table.start[k + 1]) ++k;",
            ),
        ),
        (_HIPCPU + "test_gather_kernel_matches_the_cpu_fused_op",),
    ),
    Mutant(
        "gpu-fast-pair-order",
        "fast form, CUDA only: the two codes of a converted pair swapped in the packed result",
        (
            (
                "xla_ffi/gpu/tile.cuh",
                "return cvt_e4m3x2(__fmul_rn(f32(x0), m0), __fmul_rn(f32(x1), m1));",
                "return cvt_e4m3x2(__fmul_rn(f32(x1), m1), __fmul_rn(f32(x0), m0));",
            ),
        ),
        (
            _HIPCPU + "test_quantize_matches_the_cpu_kernel[cuda]",
            _HIPCPU + "test_the_fast_form_emulation_matches_the_exact_cast",
        ),
    ),
    Mutant(
        "hipcpu-cvt-ties-away",
        "the emulated cvt.rn.satfinite rounds ties away from zero instead of to even",
        (("xla_ffi/hipcpu/cuda.h", "if (twice > sum || (twice == sum && (lo & 1))) ++lo;", "if (twice >= sum) ++lo;"),),
        (_HIPCPU + "test_the_fast_form_emulation_matches_the_exact_cast",),
    ),
    Mutant(
        "hipcpu-cuda-vote-over-64-lanes",
        "the CUDA path's __any_sync votes over HIP-CPU's 64 lanes instead of NVIDIA's 32",
        (("xla_ffi/hipcpu/cuda.h", "return (warp & mask) != 0;", "return lanes != 0;"),),
        (_HIPCPU + "test_a_vote_covers_the_warp_and_an_exchange_its_32_lane_group",),
    ),
    Mutant(
        "hipcpu-launch-keeps-ftz",
        "the shim's launch does not set IEEE arithmetic: kernels run with the driver's flush-to-zero",
        (("xla_ffi/hipcpu/hipcpu.h", "    ieee_fp_env();\n    kernel(xs...);", "    kernel(xs...);"),),
        (
            _HIPCPU + "test_kernels_set_the_ieee_environment_in_every_worker",
            _HIPCPU + "test_quantize_matches_the_cpu_kernel",
        ),
    ),
)

MUTANTS = MUTANTS + GPU_MUTANTS


class PatternError(RuntimeError):
    pass


def apply(mutant: Mutant, root: Path) -> None:
    """Applies ``mutant``'s edits to the copy of the repository at ``root``. A replacement of None
    only asserts that the search string is there (an anchor that says the edit still means what it did)."""
    for rel, search, replace in mutant.edits:
        path = root / rel
        text = path.read_text()
        count = text.count(search)
        if count != 1:
            raise PatternError(
                f"mutant {mutant.name!r}: {search!r} occurs {count} times in {rel} (want exactly 1); "
                f"update the pattern in scripts/mutants.py"
            )
        if replace is not None:
            path.write_text(text.replace(search, replace))


COPIED = ("mxfp8_jax", "xla_ffi", "tests")  # with pyproject.toml: what each mutant's copy holds


def extension_files() -> list[Path]:
    """The compiled ``_mxfp8_*`` modules of the installed package (found without importing it)."""
    spec = importlib.util.find_spec("mxfp8_jax")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("mxfp8_jax is not installed in this interpreter")
    found = []
    for loc in spec.submodule_search_locations:
        found += [p for p in Path(loc).glob("_mxfp8_*") if p.suffix in (".so", ".pyd")]
    return sorted({p.name: p for p in found}.values())


# The child interpreter drops editable-install import hooks (they would import the working
# tree's package instead of the copy), puts the copy first on sys.path, then runs pytest.
_BOOT = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
    "if not type(f).__module__.startswith('_editable')]; sys.path.insert(0, sys.argv[1]); "
    "import mxfp8_jax; assert mxfp8_jax.__file__.startswith(sys.argv[1]), mxfp8_jax.__file__; "
    "import pytest; sys.exit(pytest.main(sys.argv[2:]))"
)


def make_copy(dest: Path, extensions: list[Path]) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", ".hypothesis", ".pytest_cache")
    for folder in COPIED:
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for ext in extensions:
        shutil.copy2(ext, dest / "mxfp8_jax" / ext.name)


def hip_cpu() -> Path | None:
    """HIP-CPU where the hipcpu tests of the working tree find it (the copies lie elsewhere)."""
    given = os.environ.get("MXFP8_HIP_CPU", "").strip()
    where = Path(given).expanduser() if given else ROOT.parent / "shared" / "hip-cpu"
    return where.resolve() if (where / "include" / "hip" / "hip_runtime.h").is_file() else None


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[bool, float, str]:
    """(passed, seconds, output tail) of the tests against the copy."""
    args = [sys.executable, "-c", _BOOT, str(copy), "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly"]
    env = dict(os.environ)
    if (found := hip_cpu()) is not None:  # the copy has no ../shared beside it: give it the path
        env.update(MXFP8_HIP_CPU=str(found), MXFP8_REQUIRE_HIPCPU="1")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            args + list(tests), cwd=copy, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return False, time.monotonic() - t0, "timed out (counted as caught only if tests failed: see output)"
    return proc.returncode == 0, time.monotonic() - t0, (proc.stdout + proc.stderr)[-3000:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", action="store_true", help="only check that every pattern applies")
    parser.add_argument("--gpu", action="store_true", help="only the GPU-source mutants (caught on HIP-CPU)")
    parser.add_argument("--baseline", action="store_true", help="first run every mutant's tests unmutated")
    parser.add_argument(
        "--tests", nargs="+", metavar="NODE", help="run these tests against every chosen mutant instead of its own"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutant (default 900)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the test output of each mutant")
    opts = parser.parse_args(argv)

    by_name = {m.name: m for m in MUTANTS}
    unknown = [n for n in opts.names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutants {unknown}; --list shows them")
    chosen = [by_name[n] for n in opts.names] if opts.names else list(MUTANTS)
    if opts.gpu:
        chosen = [m for m in chosen if m.gpu]
    if opts.list:
        for m in chosen:
            print(f"{m.name:40s} {m.what}\n{'':40s} tests: {' '.join(m.tests)}")
        return 0

    with tempfile.TemporaryDirectory(prefix="mxfp8-mutants-") as tmp:
        pristine = Path(tmp) / "pristine"
        for folder in ("mxfp8_jax", "xla_ffi"):
            shutil.copytree(ROOT / folder, pristine / folder, ignore=shutil.ignore_patterns("__pycache__"))
        for m in chosen:  # every pattern first: a stale one fails before any test runs
            scratch = Path(tmp) / "check"
            shutil.copytree(pristine, scratch)
            try:
                apply(m, scratch)
            except PatternError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            finally:
                shutil.rmtree(scratch)
        if opts.check:
            print(f"all {len(chosen)} mutants apply")
            return 0
        if any(m.gpu for m in chosen) and hip_cpu() is None:
            print(
                "error: the GPU mutants need HIP-CPU (set MXFP8_HIP_CPU, or put it at ../shared/hip-cpu), "
                "or their hipcpu tests would skip and count as misses",
                file=sys.stderr,
            )
            return 1

        extensions = extension_files()
        if not extensions:
            print("warning: no compiled extension found; the FFI tests will fail or skip", file=sys.stderr)
        if opts.baseline:
            tests = tuple(opts.tests or dict.fromkeys(t for m in chosen for t in m.tests))
            copy = Path(tmp) / "baseline"
            make_copy(copy, extensions)
            ok, secs, out = run_tests(copy, tests, opts.timeout)
            print(f"baseline (unmutated) {'passes' if ok else 'FAILS'} in {secs:.0f}s")
            if not ok:
                print(out)
                return 1

        rows = []
        for m in chosen:
            copy = Path(tmp) / m.name
            make_copy(copy, extensions)
            apply(m, copy)
            passed, secs, out = run_tests(copy, tuple(opts.tests or m.tests), opts.timeout)
            failed = [
                ln.split(" - ")[0][7:] for ln in out.splitlines() if ln.startswith(("FAILED tests/", "ERROR tests/"))
            ]
            verdict = "missed" if passed else "caught"
            if not passed and "BuildError" in out:  # the copy's kernels did not build: proves nothing
                verdict = "unbuilt"
            rows.append((m.name, verdict, secs, failed[0] if failed else ""))
            print(f"{verdict:6s} {m.name:40s} {secs:5.0f}s  {rows[-1][3]}", flush=True)
            if opts.verbose or verdict != "caught":
                print(out)
            shutil.rmtree(copy)

    print("\n| mutant | result | first failing test |\n|---|---|---|")
    for name, verdict, _, test in rows:
        print(f"| {name} | {verdict} | {test} |")
    missed = [r for r in rows if r[1] != "caught"]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
