"""The ``mxfp8-jax`` command: the demo end to end in a subprocess, info, bench dispatch, errors."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mxfp8_jax as mx
from mxfp8_jax import cli, demo

from conftest import cpu_only, device_count, need_devices, rows_per_device


def command():
    """The installed console script when it is on PATH, else the module."""
    script = shutil.which("mxfp8-jax")
    return [script] if script else [sys.executable, "-m", "mxfp8_jax.cli"]


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            *command(),
            "demo",
            "--steps",
            "3",
            "--hidden",
            "32",
            "--layers",
            "2",
            "--devices",
            "2",
            "--seed",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "as MXFP8 planes (8.25 bits)" in proc.stdout and "as bf16 (16 bits)" in proc.stdout
    report = json.loads(out.read_text())
    assert (report["model"], report["devices"], report["platform"], report["steps"], report["hidden"]) == (
        "transformer",
        2,
        "cpu",
        3,
        32,
    )
    mxfp8, bf16 = report["runs"]["mxfp8"], report["runs"]["bf16"]
    for run in (mxfp8, bf16):
        assert len(run["losses"]) == 3 and all(math.isfinite(v) for v in run["losses"])
    # Same initial weights and data: the first losses differ only by the weights' precision.
    assert abs(mxfp8["first_loss"] - bf16["first_loss"]) < 0.05 * bf16["first_loss"]
    # The projections gather MXFP8 planes, the embedding and head (bf16 units in both runs) 16-bit
    # words, the norms fp32; the bf16 run gathers no plane
    gathered = lambda run: {tuple(o[0] for o in c["outputs"]) for c in run["collectives"] if c["op"] == "all-gather"}
    assert gathered(mxfp8) == {("u8",), ("u16",), ("f32",)} and gathered(bf16) == {("u16",), ("f32",)}
    assert mxfp8["bf16_gather_bytes"] < bf16["bf16_gather_bytes"] and mxfp8["mxfp8_gather_bytes"] > 0
    # the demo's two scanned blocks: each loop of the step runs all layers but one, peeled off
    # (fsdp_fetch), and XLA inlines a loop of one trip, so every collective runs once a step
    assert {c["per_step"] for c in mxfp8["collectives"]} == {1}
    assert mxfp8["reduce_scatter_bytes"] > 0 and bf16["reduce_scatter_bytes"] > 0


def test_demo_mlp_in_process(devices):
    """The MLP (64 -> 32, two 32x32 blocks, a 32 -> 10 head) on the run's n devices: its bytes
    gathered per step, by element type. MXFP8 units store whole 32-row blocks per device (32 rows
    -> 32 n), bf16 units rows padded to a multiple of n (10 -> 10, 12, 16 on 2, 4, 8 devices); the
    first layer's dgrad is never gathered (its input is the data); the 10-class head is a bf16
    unit in both runs."""
    n = len(devices)
    mx_rows = lambda r: rows_per_device(r, n) * n
    bf_rows = lambda r: -(-r // n) * n
    report = demo.run(steps=2, devices=n, hidden=32, seed=1, show_progress=False, model="mlp")
    assert report["model"] == "mlp" and report["devices"] == n and len(report["runs"]["mxfp8"]["losses"]) == 2
    m, b = report["runs"]["mxfp8"], report["runs"]["bf16"]
    codes_and_scales = 1 + 1 / 32
    # [out, in] weights: the first layer once (forward), each block twice (forward and dgrad)
    assert m["mxfp8_gather_bytes"] == codes_and_scales * (mx_rows(32) * 64 + 2 * 2 * mx_rows(32) * 32)
    assert m["bf16_gather_bytes"] == 2 * 2 * bf_rows(10) * 32  # the head, forward and backward
    assert b["mxfp8_gather_bytes"] == 0
    assert b["bf16_gather_bytes"] == 2 * (bf_rows(32) * 64 + 2 * 2 * bf_rows(32) * 32 + 2 * bf_rows(10) * 32)
    assert (m["mxfp8_units"], m["bf16_units"], b["mxfp8_units"], b["bf16_units"]) == (3, 1, 0, 4)
    assert report["weight_gather_ratio"] == m["weight_all_gather_bytes"] / b["weight_all_gather_bytes"]


def test_version_is_written_once():
    import importlib.metadata

    assert importlib.metadata.version("mxfp8-jax") == mx.__version__  # the build reads __init__.py


def test_info_prints_versions_devices_and_backends(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"mxfp8_jax {mx.__version__}" in out
    import jax

    assert f"jax {jax.__version__}" in out and f"devices ({len(jax.devices())})" in out
    backends = mx.available_backends()
    assert f"mxfp8 kernel backends: {', '.join(backends)}" in out if backends else "extension not built" in out


def test_bench_dispatch(capsys, monkeypatch):
    assert "quantize" in cli.bench_names()
    with pytest.raises(SystemExit, match="unknown benchmark 'nope'.*quantize"):
        cli.main(["bench", "nope"])
    seen = []
    import mxfp8_jax.bench.quantize as bq
    from mxfp8_jax.bench import _suite

    monkeypatch.setattr(bq, "main", lambda argv: seen.append(argv))
    assert cli.main(["bench", "quantize", "--m", "64", "--k", "64"]) == 0
    assert seen == [["--m", "64", "--k", "64"]]
    monkeypatch.setattr(_suite, "main", lambda argv: seen.append(("suite", argv)) or 0)
    assert cli.main(["bench", "--quick", "--json", "x.json", "--only", "fused"]) == 0
    assert seen[-1] == ("suite", ["--quick", "--json", "x.json", "--only", "fused"])
    assert cli.main(["bench"]) == 0 and seen[-1] == ("suite", [])


def test_bench_suite_says_when_the_kernel_is_missing(tmp_path, monkeypatch, capsys):
    """No fallback: a case whose kernel is not built is reported in its table and JSON, exit 1."""
    from mxfp8_jax._src.kernels import _ffi
    from mxfp8_jax.bench import _suite

    def missing(name, platform):
        raise _ffi.ExtensionMissingError(f"{name} needs the compiled extension (test)")

    monkeypatch.setattr(_ffi, "require", missing)
    out = tmp_path / "b.json"
    assert _suite.main(["--quick", "--only", "quantize", "--json", str(out)]) == 1
    case = json.loads(out.read_text())["cases"]["quantize"]
    assert case["status"] == "kernel missing" and case["results"] == []
    assert "mxfp8_quantize needs the compiled extension" in case["message"]
    assert "KERNEL MISSING" in capsys.readouterr().out


def test_bench_quick_runs_every_case(tmp_path):
    """`mxfp8-jax bench --quick` (the smoke test; its numbers are shown, not judged)."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [*command(), "bench", "--quick", "--json", str(out)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    payload = json.loads(out.read_text())
    assert payload["quick"] and payload["environment"]["memcpy_GBps_128MiB"] > 0
    cases = payload["cases"]
    assert list(cases) == ["quantize", "dbuffer", "fused", "fsdp"]
    expected_points = {"quantize": 6, "dbuffer": 1, "fused": 2, "fsdp": 5}
    for name, case in cases.items():
        assert case["status"] == "ok", (name, case["message"])
        assert len(case["results"]) == expected_points[name] == len(case["rows"]), name
        assert case["title"] in proc.stdout, name
        for r in case["results"]:
            timed = [k for k in r if k.endswith("_s") and r[k] is not None]
            assert timed and all(r[k] > 0 for k in timed), (name, r)
            if "bytes" in r:  # timed kernels: GB/s and the copy floor of the same run
                assert r["kernel_GBps"] > 0 and r["xla_GBps"] > 0 and 0 < r["floor_s"] and r["speedup_vs_xla"] > 0
    fsdp = {r["variant"]: r for r in cases["fsdp"]["results"]}
    assert set(fsdp) == {"mxfp8", "mxfp8-p0", "bf16", "gspmd", "dp"}
    # the same gathers per layer; prefetch=1 adds the first layer's rowwise planes before the
    # loop (each iteration then gathers the next layer's, fsdp_fetch) and, for MXFP8 units, the
    # last layer's columnwise ones after it (each backward iteration gathers the layer before's,
    # the handoff): two layers more in the text
    width = fsdp["mxfp8"]["width"]
    layer = width * width * (1 + 1 / 32)
    assert fsdp["mxfp8"]["all_gather_bytes"] - fsdp["mxfp8-p0"]["all_gather_bytes"] == 2 * layer
    assert (fsdp["mxfp8"]["all_gather_bytes"] - layer) / fsdp["bf16"]["all_gather_bytes"] == (1 + 1 / 32) / 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hidden", "48"], "--hidden=48 must be a positive multiple of 32"),
        (["--steps", "0"], "--steps=0 must be at least 1"),
        (["--devices", "0"], "--devices=0 must be at least 1"),
        (["--layers", "0"], "--layers=0 must be at least 1"),
        (["--model", "cnn"], "invalid choice: 'cnn'"),
        (["--gemm", "fp4"], "invalid choice: 'fp4'"),
        (["--data", "images"], "invalid choice: 'images'"),
        (["--model", "mlp", "--data", "text"], "data='text' is a language-modelling task"),
    ],
)
def test_demo_flag_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_run_checks_arguments():
    import jax

    with pytest.raises(ValueError, match="hidden=40 must be a positive multiple of 32"):
        demo.run(steps=1, hidden=40, show_progress=False)
    visible = jax.devices()  # what the demo runs on: this process's default platform
    too_many = len(visible) + 1
    with pytest.raises(
        ValueError,
        match=f"--devices={too_many}: must be between 1 and the {len(visible)} {visible[0].platform} devices",
    ):
        demo.run(steps=1, devices=too_many, show_progress=False)
    with pytest.raises(ValueError, match="model='cnn' must be one of"):
        demo.run(steps=1, model="cnn", show_progress=False)
    with pytest.raises(ValueError, match="layers=0 must be a positive int"):
        demo.run(steps=1, layers=0, show_progress=False)
    with pytest.raises(ValueError, match="gemm='fp8' must be 'dequantized' or 'mxfp8'"):
        demo.run(steps=1, gemm="fp8", show_progress=False)


def test_hlo_collective_accounting():
    from mxfp8_jax._src.compiled import hlo

    text = "\n".join(
        [
            "  %ag = u8[16384]{0} all-gather(u8[2048]{0} %p), channel_id=1, dimensions={0}",
            "  %ags = (bf16[8]{0}, bf16[64]{0}) all-gather-start(bf16[8]{0} %q), dimensions={0}",
            "  %agd = bf16[64]{0} all-gather-done((bf16[8]{0}, bf16[64]{0}) %ags)",
            "  %rs = f32[120]{0} reduce-scatter(f32[960]{0} %g), dimensions={0}, to_apply=%add",
            "  %ar = (f32[], f32[3]{0}) all-reduce(f32[] %l, f32[3]{0} %m), to_apply=%add",
            "  %d = f32[8,8]{1,0} dot(f32[8,8]{1,0} %a, f32[8,8]{1,0} %b)",
        ]
    )
    found = hlo.collectives(text)
    assert [(c.op, c.outputs) for c in found] == [
        ("all-gather", (("u8", (16384,)),)),
        ("all-gather", (("bf16", (64,)),)),
        ("reduce-scatter", (("f32", (120,)),)),
        ("all-reduce", (("f32", ()), ("f32", (3,)))),
    ]
    assert hlo.bytes_by_op(text) == {"all-gather": 16384 + 128, "reduce-scatter": 480, "all-reduce": 16}
    assert [hlo.dtype_bytes(d) for d in ("pred", "u8", "f8e4m3fn", "bf16", "f32", "s64")] == [1, 1, 1, 2, 4, 8]


def test_hlo_loops_count_their_collectives_per_iteration():
    from mxfp8_jax._src.compiled import hlo

    text = "\n".join(
        [
            "%inner (p: u8[4]) -> u8[4] {",
            "  %ag = u8[32]{0} all-gather(u8[4]{0} %p), dimensions={0}",
            "}",
            "%cond (p: s32[]) -> pred[] {",
            "  ROOT %c = pred[] constant(true)",
            "}",
            "%outer (p: u8[4]) -> u8[4] {",
            '  %w = (s32[]) while(%t), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"3"}}',
            "  %rs = f32[2]{0} reduce-scatter(f32[16]{0} %g), dimensions={0}, to_apply=%add",
            "}",
            "%nowhere (p: u8[4]) -> u8[4] {",
            "  %w2 = (s32[]) while(%t), condition=%cond, body=%loose",
            "}",
            "%loose (p: u8[4]) -> u8[4] {",
            "  %ar = f32[] all-reduce(f32[] %l), to_apply=%add",
            "}",
            "ENTRY %main (p: u8[4]) -> u8[4] {",
            '  %w = (s32[]) while(%t), condition=%cond, body=%outer, backend_config={"known_trip_count":{"n":"5"}}',
            "  %ag0 = bf16[64]{0} all-gather(bf16[8]{0} %q), dimensions={0}",
            "  %n = (s32[]) call(%t), to_apply=%nowhere",
            "}",
        ]
    )
    found = {c.computation: c for c in hlo.collectives(text)}
    assert (found["inner"].loop_depth, found["inner"].count) == (2, 15)
    assert (found["outer"].loop_depth, found["outer"].count) == (1, 5)
    assert (found["main"].loop_depth, found["main"].count) == (0, 1)
    assert (found["loose"].loop_depth, found["loose"].count) == (1, None)  # no known trip count
    with pytest.raises(ValueError, match="unknown trip count"):
        _ = found["loose"].bytes_per_step
    assert found["inner"].bytes_per_step == 32 * 15
    assert hlo.while_loops(text) == [("inner", 3), ("loose", None), ("outer", 5)]


def test_fsdp_benchmark_measures_every_variant(capsys, devices):
    """On the run's n devices, width 32 lcm(8, n) (256 up to 8 devices): whole 32-row blocks on
    every device, so the MXFP8 and bf16 units store the same rows and their bytes compare exactly."""
    from mxfp8_jax.bench import fsdp as bench

    n = len(devices)
    payload = bench.run(depths=(2,), width=32 * math.lcm(8, n), devices=n, timed=False, progress=False)
    got = {r["variant"]: r for r in payload["results"]}
    assert set(got) == set(bench.VARIANTS)
    assert got["mxfp8"]["all_gather_types"] == ["u8"] and got["bf16"]["all_gather_types"] == ["u16"]
    # but MXFP8 units gather their last layer's columnwise planes once more (the backward's
    # handoff through the loop: each trip gathers the layer before's, the first layer twice)
    layer = (32 * math.lcm(8, n)) ** 2 * (1 + 1 / 32)
    assert (got["mxfp8"]["all_gather_bytes"] - layer) / got["bf16"]["all_gather_bytes"] == (1 + 1 / 32) / 2
    assert got["dp"]["all_gather_bytes"] == 0 and got["dp"]["all_reduce_bytes"] > 0
    assert all(r["loops"] == [2, 2] for r in got.values())  # every variant keeps the scan
    assert "FSDP step vs depth" in capsys.readouterr().out


def test_demo_two_processes(tmp_path):
    """``demo --processes 2``: two local processes of one jax.distributed job (1 CPU device
    each, gloo); process 0 prints and writes the report; the losses match this process on 2 of
    its devices.

    Not marked multidevice: both sides use 2 devices whatever the run has, so a second pass of
    the multi-device tests at another count would repeat it (a minute of subprocesses) as is."""
    cpu_only("the processes run on CPU devices (gloo), so the in-process side must too")
    if device_count() < 2:  # before the subprocesses: the comparison runs here
        pytest.skip(f"needs 2 devices; this run has {device_count()}")
    out = tmp_path / "report.json"
    argv = ["--model", "mlp", "--steps", "2", "--hidden", "32", "--seed", "1"]
    proc = subprocess.run(
        [*command(), "demo", "--processes", "2", "--devices", "2", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "as MXFP8 planes (8.25 bits)" in proc.stdout and "[Gloo]" not in proc.stdout
    report = json.loads(out.read_text())
    assert report["devices"] == 2 and report["model"] == "mlp"
    single = demo.run(steps=2, devices=2, hidden=32, seed=1, show_progress=False, model="mlp")
    for name in ("mxfp8", "bf16"):
        np.testing.assert_allclose(report["runs"][name]["losses"], single["runs"][name]["losses"], rtol=1e-6)


def test_demo_processes_arguments():
    with pytest.raises(SystemExit):
        cli.main(["demo", "--processes", "2", "--devices", "3"])


# ------------------------------------------------------------------------------------------------
# mxfp8-jax layout: the printed ownership against what each device really stores

_DEVICE_LINE = re.compile(r"^  device (\d+): stored \[(\d+), (\d+)\) (.*); padding (\d+)$")
_PIECE = re.compile(r"t(\d+) rows \[(\d+), (\d+)\) at (\d+)")
_SECTIONS = {"data:": "data", "rowwise scales": "rowwise_scale", "columnwise scales": "columnwise_scale"}


def parse_layout_output(text: str) -> dict:
    """{plane: {device: (pieces {(tensor, row): offset of the row}, padding)}} from the printout."""
    planes, current = {}, None
    for line in text.splitlines():
        for head, name in _SECTIONS.items():
            if line.startswith(head):
                current = planes.setdefault(name, {})
        m = _DEVICE_LINE.match(line)
        if m:
            dev, lo, hi, owned, pad = m.groups()
            rows = {}
            for t, a, b, off in _PIECE.findall(owned):
                rows[(int(t), int(a), int(b))] = int(off)
            current[int(dev)] = (int(hi) - int(lo), rows, int(pad))
    return planes


def stored_rows(local: np.ndarray, row_len: int, decode) -> tuple[dict, int]:
    """{(tensor, row): offset} found in one device's local plane, and its count of zero elements.

    Every stored row is a run of ``row_len`` equal nonzero values that ``decode`` maps to (tensor, row)."""
    found, zeros, at = {}, 0, 0
    while at < len(local):
        if local[at] == 0:
            zeros, at = zeros + 1, at + 1
            continue
        key = decode(local[at])
        n = row_len(key[0])
        assert np.all(local[at : at + n] == local[at]), "a row is not stored contiguously"
        assert key not in found
        found[key], at = at, at + n
    return found, zeros


def as_row_runs(found: dict) -> dict:
    """{(tensor, row): offset} -> {(tensor, first, stop): offset} of runs stored back to back."""
    runs, by_tensor = {}, {}
    for (t, r), off in sorted(found.items(), key=lambda kv: kv[1]):
        by_tensor.setdefault(t, []).append((r, off))
    for t, items in by_tensor.items():
        start_r, start_off, prev_r = items[0][0], items[0][1], items[0][0]
        for r, _ in items[1:]:
            assert r == prev_r + 1, "a device's rows of one tensor are one contiguous run"
            prev_r = r
        runs[(t, start_r, prev_r + 1)] = start_off
    return runs


@pytest.mark.multidevice
@pytest.mark.parametrize(
    "shapes, devices_used, shard_layout",
    [
        ([(128, 64), (32, 128)], "half", "padded"),
        ([(128, 64), (32, 128)], "half", "unpadded"),
        ([(96, 64), (64, 96), (32, 32)], "half", "padded"),
        ([(96, 64), (64, 96), (32, 32)], "all", "unpadded"),
    ],
)
def test_layout_prints_what_every_device_stores(shapes, devices_used, shard_layout, capsys):
    """Oracle: a real QuantizedDBuffer (layout built by the buffer itself), filled with rows whose
    values name them: row g (counting rows over all tensors) is 2^(g - 100) everywhere, so its
    rceil scale byte is g - 100 - 8 + 127, and a column block's scale names its last row.

    On n devices of the run ("all") or n/2 ("half", at least 2): with 8, that is 4 (the worked
    example's count: PADDED, its last device holds only padding) and 8 (more devices than the 6
    row blocks of the last case)."""
    import jax

    n = device_count() if devices_used == "all" else max(2, device_count() // 2)

    argv = ["layout", "--shapes", ",".join(f"{m}x{k}" for m, k in shapes), "--devices", str(n)]
    assert cli.main([*argv, "--shard-layout", shard_layout]) == 0
    printed = parse_layout_output(capsys.readouterr().out)
    assert set(printed) == {"data", "rowwise_scale", "columnwise_scale"}

    mesh = jax.make_mesh((n,), ("fsdp",), devices=need_devices(n))
    placements = (mx.BlockAtomic(32),)
    q = mx.QuantizedDBuffer.empty(mesh, placements, shapes, shard_layout=mx.ShardLayout(shard_layout))
    first_row = np.cumsum([0] + [m for m, _ in shapes])
    tensors = [
        np.repeat(np.exp2(np.arange(first_row[i], first_row[i] + m) - 100.0)[:, None], k, 1).astype(np.float32)
        for i, (m, k) in enumerate(shapes)
    ]
    master = mx.DBuffer.distribute_tensors(tensors, mesh, placements, layout=q.layout)
    q = q.quantize(master, backend="jax")

    def tensor_row(g):
        i = int(np.searchsorted(first_row, g, side="right") - 1)
        return i, int(g - first_row[i])

    decode_master = lambda v: tensor_row(int(np.log2(v)) + 100)
    decode_row_scale = lambda b: tensor_row(int(b) - 127 + 8 + 100)

    def decode_col_scale(b):
        i, r = tensor_row(int(b) - 127 + 8 + 100)
        assert r % 32 == 31, "a 32-row block's scale is its largest row's"
        return i, r // 32

    checks = {
        "data": (master.data, lambda i: shapes[i][1], decode_master),
        "rowwise_scale": (q.rowwise_scale.data, lambda i: shapes[i][1] // 32, decode_row_scale),
        "columnwise_scale": (q.columnwise_scale.data, lambda i: shapes[i][1], decode_col_scale),
    }
    for plane, (array, row_len, decode) in checks.items():
        shards = {s.device: np.asarray(s.data) for s in array.addressable_shards}
        assert len(printed[plane]) == n
        for k in range(n):
            local = shards[mesh.devices[k]]
            found, zeros = stored_rows(local, row_len, decode)
            n_stored, rows, pad = printed[plane][k]
            assert n_stored == local.size, (plane, k)
            assert rows == as_row_runs(found), (plane, k)
            assert pad == zeros, (plane, k)
    # the rowwise E4M3 codes sit where the master's rows are (every row quantizes to 256's code,
    # nonzero): their zero bytes are the padding the printout names
    for s in q.rowwise_data.data.addressable_shards:
        k = list(mesh.devices).index(s.device)
        assert int(np.sum(np.asarray(s.data) == 0)) == printed["data"][k][2]


def test_layout_worked_example_by_hand(capsys):
    """128x64 and 32x128 on 4 devices, PADDED: chunk lcm(32*64, 32*128) = 4096 elements, t0 takes
    two chunks, t1 one, the buffer pads to 4 * 4096, so device 3 holds only padding."""
    assert cli.main(["layout", "--shapes", "128x64,32x128", "--devices", "4"]) == 0
    out = capsys.readouterr().out
    got = parse_layout_output(out)
    assert got["data"] == {
        0: (4096, {(0, 0, 64): 0}, 0),
        1: (4096, {(0, 64, 128): 0}, 0),
        2: (4096, {(1, 0, 32): 0}, 0),
        3: (4096, {}, 4096),
    }
    assert got["columnwise_scale"][1] == (128, {(0, 2, 4): 0}, 0)
    assert "padding 4096 (25.0%)" in out


def test_layout_png_and_errors(tmp_path, capsys, monkeypatch):
    png = tmp_path / "layout.png"
    assert cli.main(["layout", "--shapes", "64x64", "--devices", "2", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the [viz] extra were missing
    assert cli.main(["layout", "--shapes", "64x64", "--devices", "2", "--png", str(png)]) == 1
    assert "pip install 'mxfp8-jax[viz]'" in capsys.readouterr().err
    for argv, message in [
        (["--shapes", "64x48", "--devices", "2"], "K=48 must both be multiples of 32"),
        (["--shapes", "64", "--devices", "2"], "--shapes item '64' must be MxK"),
        (["--shapes", "64x64", "--devices", "0"], "devices=0"),
    ]:
        with pytest.raises(SystemExit) as e:
            cli.main(["layout", *argv])
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_convergence_report_and_picture(tmp_path, capsys):
    """bench.convergence's table and verdicts from a report of known curves, and its PNG."""
    from mxfp8_jax.bench import convergence

    def run(label, precision, end):
        curve = [(0, 6.0), (100, 2.0), (200, 1.8), (300, end)]
        return dict(label=label, precision=precision, gemm="-", seed=0, validation=curve, step_s=0.5, tokens_per_s=8.0)

    report = dict(
        description="test",
        steps=300,
        devices=8,
        platform="cpu",
        gemm_path="exact",
        runs=[run("bf16 seed 0", "bf16", 1.50), run("bf16 seed 1", "bf16", 1.52), run("mxfp8 gemm", "mxfp8", 1.53)],
    )
    convergence.print_report(report)
    out = capsys.readouterr().out
    assert "step 100" in out and "step 300" in out and "1.5300" in out
    assert "1.5000 .. 1.5200 (spread 0.0200)" in out
    assert "mxfp8 gemm: 1.5300 (+0.0100 outside" in out
    assert convergence.at(report["runs"][0]["validation"], 200) == 1.8
    assert convergence.at(report["runs"][0]["validation"], 150) is None
    convergence.draw(report, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
