"""FSDP checkpoints: logical, exact, restorable onto any mesh; mismatches named before data moves.

The oracle for a round trip is the state's own logical content read on the host (each
parameter through ``to_logical``, each optimizer moment likewise), compared bit for bit after
restoring on another mesh; for a resume, the uninterrupted run's losses.
"""

import chex
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from mxfp8_jax.flax import FSDP

from conftest import as_bytes, assert_same_bytes, rows_per_device
from fsdp_model import (
    CLASSES,
    TX,
    D,
    H,
    Net,
    batch,
    logical_content,
    logical_grads,
    loss_fn,
    make_net,
    per_example_terms,
)
from summation import assert_within_order_bound


def meshes(devs):
    """The run's n devices as one FSDP axis, half of them (other padding of the rows), and all
    of them as a (2, n/2) mesh."""
    n = len(devs)
    return {
        "all": Mesh(np.array(devs), ("fsdp",)),
        "half": Mesh(np.array(devs[: n // 2]), ("fsdp",)),
        "2d": Mesh(np.array(devs).reshape(2, n // 2), ("data", "fsdp")),
    }


@pytest.fixture(scope="module")
def trained(devices, tmp_path_factory):
    """3 steps on all n devices, saved."""
    model = make_net()
    fsdp = FSDP(model, meshes(devices)["all"])
    state = fsdp.init(model, TX)
    step = fsdp.train_step(loss_fn, TX)
    for i in range(3):
        state, _ = step(state, batch(i))
    path = tmp_path_factory.mktemp("ckpt") / "s3"
    handle = fsdp.save(state, path, async_save=True)  # orbax writes in the background
    handle.wait()
    return fsdp, state, path


@pytest.mark.parametrize("target", ["all", "half", "2d"])
def test_round_trip_exact_on_any_mesh(trained, devices, target):
    fsdp_n, state_n, path = trained
    mesh = meshes(devices)[target]
    fsdp = FSDP(make_net(seed=5), mesh)  # other values: nothing leaks in
    restored = fsdp.restore(path, TX)
    want, got = logical_content(fsdp_n, state_n), logical_content(fsdp, restored)
    assert want.keys() == got.keys() and any(k.startswith("opt/") and "mu" in k for k in want)
    for k in want:
        np.testing.assert_array_equal(as_bytes(got[k]), as_bytes(want[k]), err_msg=k)
    # the stored shapes are the target mesh's padding, which on half the devices differs (W of
    # up is [96, 64], of down [64, 96]), and the planes are recomputed
    stored = {name: restored.master[f"blocks/{name}/kernel"].shape for name in ("up", "down")}
    n = mesh.size
    assert stored == {"up": (2, rows_per_device(H, n) * n, D), "down": (2, rows_per_device(D, n) * n, H)}  # 2 blocks
    if target == "half":
        assert any(restored.master[k].shape != state_n.master[k].shape for k in restored.master)
    q = fsdp._layout.quantize_fn(restored.master)
    for name, planes in restored.quantized.items():
        chex.assert_trees_all_equal(planes, q[name])
    assert int(restored.step) == 3


def test_resume_on_the_same_mesh_is_exact_and_on_another_within_summation_order(trained, devices):
    """A checkpoint resumed on the mesh that wrote it continues bit for bit like the run that
    never stopped. Resumed on half the devices the state is the same bits (the round-trip test),
    but the step sums each gradient over the examples in another order (32 / n examples per
    device, then over the n devices, against 64 / n then n / 2), so its loss and gradients agree
    within the bound of that order alone. Later steps are not compared across meshes:
    re-quantization is discontinuous (one ulp of a master weight can flip an E4M3 code), so no
    tolerance on a trajectory follows."""
    fsdp_n, _, _ = trained
    model = make_net()
    state = fsdp_n.init(model, TX)
    step = fsdp_n.train_step(loss_fn, TX)
    path = trained[2].parent / "resume"
    losses = []  # 14 uninterrupted steps on the n devices
    for i in range(14):
        state, loss = step(state, batch(i))
        losses.append(float(loss))
        if i == 9:  # the step-10 state, saved mid-run (before the next step consumes it)
            fsdp_n.save(state, path)
    same = fsdp_n.restore(path, TX)
    resumed = []
    for i in range(10, 14):
        same, loss = step(same, batch(i))
        resumed.append(float(loss))
    np.testing.assert_array_equal(resumed, losses[10:])

    fsdp_half = FSDP(model, meshes(devices)["half"])
    loss_half, grads_half = fsdp_half.loss_and_grads(loss_fn)(fsdp_half.restore(path, TX), batch(10))
    loss_n, grads_n = fsdp_n.loss_and_grads(loss_fn)(fsdp_n.restore(path, TX), batch(10))
    one = FSDP(model, Mesh(np.array(devices[:1]), ("fsdp",)))
    loss_terms, grad_terms = per_example_terms(one, one.restore(path, TX), batch(10))
    assert_within_order_bound(float(loss_half), float(loss_n), loss_terms, "loss")
    g_half, g_n = logical_grads(fsdp_half, grads_half), logical_grads(fsdp_n, grads_n)
    assert g_half.keys() == g_n.keys() == grad_terms.keys()
    for name in g_n:
        assert_within_order_bound(g_half[name], g_n[name], grad_terms[name], name)


def test_mismatches_are_named(trained, devices, tmp_path):
    _, _, path = trained
    mesh = meshes(devices)["all"]
    renamed = FSDP(make_net(names=("layers", "head")), mesh)
    with pytest.raises(ValueError, match=r"not in the checkpoint: .*params/layers/up/kernel"):
        renamed.restore(path, TX)
    with pytest.raises(ValueError, match=r"opt/"):
        FSDP(make_net(), mesh).restore(path, optax.sgd(0.1))  # another optimizer structure
    with pytest.raises(ValueError, match="precision='mxfp8'"):
        FSDP(make_net(), mesh, precision="bf16").restore(path, TX)

    class Wider(Net):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.head = nnx.Linear(D, 2 * CLASSES, rngs=rngs)

    with pytest.raises(ValueError, match=r"'params/head/kernel': stored shape \(64, 8\), target shape \(64, 16\)"):
        FSDP(Wider(nnx.Rngs(0)), mesh).restore(path, TX)


def test_swapped_layers_restore_by_name(devices, tmp_path):
    """Two layers of equal shape whose attribute order changed: values follow names, not order."""

    class Two(nnx.Module):
        def __init__(self, rngs, first="a"):
            for name in (first, "b" if first == "a" else "a"):
                setattr(self, name, nnx.Linear(D, D, rngs=rngs))

        def __call__(self, x):
            return self.b(self.a(x))

    mesh = meshes(devices)["all"]
    model = Two(nnx.Rngs(0))
    fsdp = FSDP(model, mesh)
    fsdp.save(fsdp.init(model, optax.sgd(0.1)), tmp_path / "two")
    other = Two(nnx.Rngs(1), first="b")
    restored = FSDP(other, mesh).gather(FSDP(other, mesh).restore(tmp_path / "two", optax.sgd(0.1)))
    for name in ("a", "b"):
        np.testing.assert_array_equal(
            np.asarray(getattr(restored, name).kernel.get_value()), np.asarray(getattr(model, name).kernel.get_value())
        )


def test_init_from_sharded_params(devices):
    """Parameters created sharded (jit with out_shardings) are placed without a host round trip:
    the state equals the one built from host values."""
    mesh = meshes(devices)["all"]
    model = make_net()
    fsdp = FSDP(model, mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp"))
    n = mesh.size
    sharded = jax.tree.map(lambda a: jax.device_put(a, spec) if a.ndim == 2 and a.shape[1] % n == 0 else a, params)
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(sharded))
    from_sharded = fsdp.init(nnx.merge(graphdef, sharded), TX)
    from_host = fsdp.init(model, TX)
    assert_same_bytes(from_sharded, from_host)


def test_two_processes_init_from_sharded_params_then_resume_here(devices, tmp_path):
    """2 processes x n/2 CPU devices (the run's n in all): FSDP built from parameters sharded
    across both processes (no host transfer allowed), the first step's gradients, 10 steps,
    checkpoints. What is bitwise is compared bit for bit: the two processes' losses, their
    initial state against this process's (1 x n devices), the final checkpoint against the state
    they held, and their own resume of it against the run that never stopped. The first step's
    loss and gradients differ here only by the order of summing over devices (gloo between
    processes), so they agree within that order's bound; later losses are not compared across
    process counts (re-quantization is discontinuous: no tolerance on a trajectory follows)."""
    from _fsdp_workers import STEPS
    from multiproc import run_processes

    n = len(devices)
    out = tmp_path / "mp"
    results = run_processes(
        "tests/_fsdp_workers.py:train_and_save", 2, args=[str(out)], devices_per_process=n // 2, timeout=300
    )
    for i, r in enumerate(results):
        assert r.result["process"] == i and r.result["devices"] == n
        assert not any(r.result["params_fully_addressable"])
    mine, other = results[0].result, results[1].result
    for key in ("first_loss", "losses", "next_loss", "resumed_loss"):
        assert mine[key] == other[key], key
    assert mine["resumed_loss"] == mine["next_loss"]

    mesh = meshes(devices)["all"]
    model = make_net()
    fsdp = FSDP(model, mesh)
    state = fsdp.init(model, TX)
    init_there, init_here = logical_content(fsdp, fsdp.restore(out / "init", TX)), logical_content(fsdp, state)
    assert init_there.keys() == init_here.keys()
    for k in init_here:
        np.testing.assert_array_equal(as_bytes(init_there[k]), as_bytes(init_here[k]), err_msg=k)

    loss, grads = fsdp.loss_and_grads(loss_fn)(state, batch(0))
    one = FSDP(model, Mesh(np.array(devices[:1]), ("fsdp",)))
    loss_terms, grad_terms = per_example_terms(one, one.init(model, TX), batch(0))
    assert_within_order_bound(mine["first_loss"], float(loss), loss_terms, "first loss")
    there, here = np.load(out / "first_grads.npz"), logical_grads(fsdp, grads)
    assert sorted(there.files) == sorted(here)
    for name in here:
        assert_within_order_bound(there[name], here[name], grad_terms[name], name)

    final = logical_content(fsdp, fsdp.restore(out / "final", TX))
    held = np.load(out / "final_content.npz")
    assert sorted(held.files) == sorted(final) and int(final["step"]) == STEPS
    for k in final:
        np.testing.assert_array_equal(as_bytes(final[k]), as_bytes(held[k]), err_msg=k)
