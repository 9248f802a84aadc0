"""The reader of scheduled HLO (``compiled.hlo_schedule``) on hand-written modules: which
instructions are GEMMs and of which precision, how many GEMMs run between a gather's start and
its done (in one computation, carried to the next iteration, started before a loop), and the
latency-hiding scheduler's statistics summed over a step."""

import pytest

from mxfp8_jax._src.compiled import hlo_schedule as hs

MODULE = """HloModule step, is_scheduled=true

%fused_bf16 (p0: bf16[8,16], p1: bf16[16,4]) -> f32[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,4]{1,0} parameter(1)
  ROOT %d = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_wide (p0: bf16[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %c = f32[8,16]{1,0} convert(%p0)
  %p1 = f32[16,4]{1,0} parameter(1)
  ROOT %d = f32[8,4]{1,0} dot(%c, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (param: (s32[], (u8[2,4], u8[16,4]), bf16[8,16], bf16[16,4])) -> (s32[], (u8[2,4], u8[16,4]), bf16[8,16], bf16[16,4]) {
  %param = (s32[], (u8[2,4]{1,0}, u8[16,4]{1,0}), bf16[8,16]{1,0}, bf16[16,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %carried = (u8[2,4]{1,0}, u8[16,4]{1,0}) get-tuple-element(%param), index=1
  %x = bf16[8,16]{1,0} get-tuple-element(%param), index=2
  %w = bf16[16,4]{1,0} get-tuple-element(%param), index=3
  %g1 = f32[8,4]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_bf16, metadata={op_name="jit(step)/shard_map/dot_general"}
  %done = u8[16,4]{1,0} all-gather-done(%carried)
  %g2 = f32[8,4]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_bf16
  %slice = u8[2,4]{1,0} slice(%done), slice={[0:2], [0:4]}
  %start = (u8[2,4]{1,0}, u8[16,4]{1,0}) all-gather-start(%slice), dimensions={0}, backend_config={"collective_backend_config":{"is_sync":false}}
  %g3 = f32[8,4]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_bf16
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], (u8[2,4]{1,0}, u8[16,4]{1,0}), bf16[8,16]{1,0}, bf16[16,4]{1,0}) tuple(%next, %start, %x, %w)
}

%cond (param.1: (s32[], (u8[2,4], u8[16,4]), bf16[8,16], bf16[16,4])) -> pred[] {
  %param.1 = (s32[], (u8[2,4]{1,0}, u8[16,4]{1,0}), bf16[8,16]{1,0}, bf16[16,4]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%param.1), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %four), direction=LT
}

ENTRY %main (a: u8[2,4], x: bf16[8,16], w: bf16[16,4], f: f32[16,4], r: f32[16,4]) -> f32[8,4] {
  %a = u8[2,4]{1,0} parameter(0)
  %x = bf16[8,16]{1,0} parameter(1)
  %w = bf16[16,4]{1,0} parameter(2)
  %f = f32[16,4]{1,0} parameter(3)
  %r = f32[16,4]{1,0} parameter(4)
  %sync = u8[16,4]{1,0} all-gather(%a), dimensions={0}
  %first = (u8[2,4]{1,0}, u8[16,4]{1,0}) all-gather-start(%a), dimensions={0}, backend_config={"collective_backend_config":{"is_sync":false}}
  %wide = f32[8,4]{1,0} fusion(%x, %f), kind=kCustom, calls=%fused_wide
  %c0 = s32[] constant(0)
  %init = (s32[], (u8[2,4]{1,0}, u8[16,4]{1,0}), bf16[8,16]{1,0}, bf16[16,4]{1,0}) tuple(%c0, %first, %x, %w)
  %loop = (s32[], (u8[2,4]{1,0}, u8[16,4]{1,0}), bf16[8,16]{1,0}, bf16[16,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %rs-start = ((f32[16,4]{1,0}), f32[2,4]{1,0}) reduce-scatter-start(%r), dimensions={0}, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":true}}
  %rs-done = f32[2,4]{1,0} reduce-scatter-done(%rs-start)
  %lib = (f32[8,4]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %out = f32[8,4]{1,0} get-tuple-element(%lib), index=0
}
"""  # noqa: E501 (HLO instructions are one line each)

FLOPS = 2 * 8 * 4 * 16  # [8, 16] x [16, 4]


def test_gemms_are_found_with_their_operand_types_flops_and_runs():
    found = {g.name: g for g in hs.gemms(MODULE)}
    assert set(found) == {"g1", "g2", "g3", "wide", "lib"}  # nothing inside the fusions' bodies
    for name in ("g1", "g2", "g3"):
        g = found[name]
        assert (g.precision, g.operands, g.result, g.flops, g.count) == ("bf16", ("bf16", "bf16"), "f32", FLOPS, 4)
    assert found["g1"].op_name == "jit(step)/shard_map/dot_general"
    # a fusion that widens its bf16 input and multiplies fp32 values is an fp32 GEMM
    assert found["wide"].fp32 and found["wide"].operands == ("f32", "f32") and found["wide"].count == 1
    lib = found["lib"]
    assert (lib.kind, lib.precision, lib.flops) == ("__cublas$gemm", "bf16", FLOPS)
    assert not any(g.block_scaled for g in found.values())


def test_gathers_count_the_gemms_between_start_and_done():
    found = {c.name: c for c in hs.async_collectives(MODULE)}
    # synchronous: never overlapped
    assert found["sync"].sync and found["sync"].gemms_between == 0 and not found["sync"].overlapped
    # started in the body, done at the top of the next iteration: g3 after it, g1 before the done
    body = found["start"]
    assert (body.pipelined, body.gemms_between, body.count, body.overlapped) == (True, 2, 4, True)
    assert body.outputs == (("u8", (16, 4)),) and body.bytes == body.bytes_of(8) == 64
    # started before the loop, done in its first iteration: `wide` before the loop, g1 inside
    first = found["first"]
    assert (first.pipelined, first.gemms_between, first.count) == (True, 2, 1)
    # a reduce-scatter marked synchronous
    rs = found["rs-start"]
    assert rs.op == "reduce-scatter" and rs.sync and rs.outputs == (("f32", (2, 4)),)
    assert [c.name for c in hs.async_collectives(MODULE, "reduce-scatter")] == ["rs-start"]


def test_gemms_between_in_one_computation():
    text = """HloModule m, is_scheduled=true

%f (p0: bf16[8,16], p1: bf16[16,4]) -> f32[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,4]{1,0} parameter(1)
  ROOT %d = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: u8[2,4], x: bf16[8,16], w: bf16[16,4]) -> u8[16,4] {
  %a = u8[2,4]{1,0} parameter(0)
  %x = bf16[8,16]{1,0} parameter(1)
  %w = bf16[16,4]{1,0} parameter(2)
  %s = (u8[2,4]{1,0}, u8[16,4]{1,0}) all-gather-start(%a), dimensions={0}
  %d1 = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %d2 = f32[8,4]{1,0} fusion(%x, %w), kind=kCustom, calls=%f
  ROOT %g = u8[16,4]{1,0} all-gather-done(%s)
}
"""
    (c,) = hs.async_collectives(text)
    assert (c.gemms_between, c.pipelined, c.sync, c.count) == (2, False, False, 1)
    assert [g.name for g in hs.gemms(text)] == ["d1", "d2"]


DUMP = """hlo_module {
  name: "step"
  computations {
    name: "body"
    instructions {
      name: "x"
    }
    id: 7
    root_id: 70
  }
  computations {
    name: "main"
    id: 9
    root_id: 90
  }
}
computation_schedules {
  computation_id: 7
  instructions {
    id: 70
  }
  scheduler_statistics {
    all_gather_wasted_cycles: 12.5
    total_wasted_cycles: 12.5
    total_cycles: 100
  }
  cycles_per_microsecond: 1
}
computation_schedules {
  computation_id: 9
  scheduler_statistics {
    reduce_scatter_wasted_cycles: 3
    total_wasted_cycles: 3
    total_cycles: 40
  }
  cycles_per_microsecond: 2
}
"""


def test_schedule_statistics_sum_loop_bodies_by_their_trip_count():
    stats = {s.computation: s for s in hs.schedule_stats(DUMP, MODULE)}
    assert set(stats) == {"body", "main"}
    assert stats["body"].runs == 4 and stats["main"].runs == 1
    assert stats["body"].wasted_of("all_gather") == 12.5 and stats["main"].wasted_of("reduce_scatter") == 3
    step = hs.step_estimate(list(stats.values()))
    assert step["total_us"] == pytest.approx(100 * 4 + 40 / 2)
    assert step["all_gather_wasted_us"] == pytest.approx(12.5 * 4)
    assert step["reduce_scatter_wasted_us"] == pytest.approx(3 / 2)


def test_weight_gathers_are_counted_by_pass_without_each_passs_first():
    """``hlo_replay.weight_gathers``: gathers of weights by pass (the backward's op names are
    transposed), a norm scale's few KiB left out, and each pass's first run counted apart."""
    from mxfp8_jax._src.compiled.hlo_replay import Gather, weight_gathers

    def g(name, dtypes, op, gemm, latency=10.0, nbytes=2**24):
        return Gather("main", name, "all-gather", nbytes, dtypes, latency, gemm_between=gemm, op_name=op)

    fwd, bwd = "jit(step)/jvp()/shard_map/all_gather", "jit(step)/transpose(jvp())/shard_map/all_gather"
    gathers = [
        g("a", ("U16",), fwd, 0.0),  # the forward's first: nothing before it
        g("s", ("F32",), fwd, 0.0, nbytes=8 << 10),  # a norm's scale: not a weight gather
        g("b", ("F32", "U8"), fwd, 12.0),
        g("c", ("F32",), fwd, 4.0),  # an fp32 weight (GSPMD's)
        g("d", ("U16",), bwd, 30.0),  # the backward's first, hidden all the same
        g("e", ("U8",), bwd, 10.0),
        g("f", ("U8",), bwd, 9.0),
    ]
    assert weight_gathers(gathers) == {
        "forward": {"runs": 3, "hidden": 1, "later": 2, "later_hidden": 1},
        "backward": {"runs": 3, "hidden": 2, "later": 2, "later_hidden": 1},
    }
