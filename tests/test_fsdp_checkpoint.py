"""FSDP checkpoints: logical, exact, restorable onto any mesh; mismatches named before data moves.

The oracle for a round trip is the state's own logical content read on the host (each
parameter through ``to_logical``, each optimizer moment likewise), compared bit for bit after
restoring on another mesh; for a resume, the uninterrupted run's losses.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from mxfp8_jax.flax import FSDP

from conftest import as_bytes
from fsdp_model import CLASSES, TX, D, Net, batch, loss_fn, make_net


def meshes(devs):
    return {
        "8": Mesh(np.array(devs), ("fsdp",)),
        "4": Mesh(np.array(devs[:4]), ("fsdp",)),
        "2x4": Mesh(np.array(devs).reshape(2, 4), ("data", "fsdp")),
    }


def logical_content(fsdp, state):
    """Every logical tensor of ``state`` on the host: parameters and optimizer leaves by name."""
    out = {f"params/{p.name}": np.asarray(fsdp.to_logical(p, state.master[p.name])) for p in fsdp.trained}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        owner = fsdp._owner_of(key_path, leaf)
        name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in key_path)
        out[f"opt/{name}"] = np.asarray(leaf if owner is None else fsdp.to_logical(owner, leaf))
    out["step"] = np.asarray(state.step)
    return out


@pytest.fixture(scope="module")
def trained(cpu_devices, tmp_path_factory):
    """3 steps on 8 devices, saved."""
    model = make_net()
    fsdp = FSDP(model, meshes(cpu_devices)["8"])
    state = fsdp.init(model, TX)
    step = fsdp.train_step(loss_fn, TX)
    for i in range(3):
        state, _ = step(state, batch(i))
    path = tmp_path_factory.mktemp("ckpt") / "s3"
    handle = fsdp.save(state, path, async_save=True)  # orbax writes in the background
    handle.wait()
    return fsdp, state, path


@pytest.mark.parametrize("target", ["8", "4", "2x4"])
def test_round_trip_exact_on_any_mesh(trained, cpu_devices, target):
    fsdp8, state8, path = trained
    fsdp = FSDP(make_net(seed=5), meshes(cpu_devices)[target])  # other values: nothing leaks in
    restored = fsdp.restore(path, TX)
    want, got = logical_content(fsdp8, state8), logical_content(fsdp, restored)
    assert want.keys() == got.keys() and any(k.startswith("opt/") and "mu" in k for k in want)
    for k in want:
        np.testing.assert_array_equal(as_bytes(got[k]), as_bytes(want[k]), err_msg=k)
    # the stored shapes do differ between meshes (padding), and the planes are recomputed
    if target == "4":
        assert restored.master["blocks/up/kernel"].shape != state8.master["blocks/up/kernel"].shape
    q = fsdp._quantize_fn(restored.master)
    for name, planes in restored.quantized.items():
        for a, b in zip(jax.tree.leaves(planes), jax.tree.leaves(q[name])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert int(restored.step) == 3


def test_resume_on_another_mesh_matches_uninterrupted(trained, cpu_devices):
    fsdp8, _, _ = trained
    model = make_net()
    state = fsdp8.init(model, TX)
    step8 = fsdp8.train_step(loss_fn, TX)
    path = trained[2].parent / "resume"
    losses = []  # 20 uninterrupted steps on 8 devices
    for i in range(20):
        state, loss = step8(state, batch(i))
        losses.append(float(loss))
        if i == 9:  # the step-10 state, saved mid-run (before the next step consumes it)
            fsdp8.save(state, path)
    fsdp4 = FSDP(model, meshes(cpu_devices)["4"])
    state4 = fsdp4.restore(path, TX)
    step4 = fsdp4.train_step(loss_fn, TX)
    resumed = []  # restored onto 4 devices: 10 more
    for i in range(10, 20):
        state4, loss = step4(state4, batch(i))
        resumed.append(float(loss))
    np.testing.assert_allclose(resumed, losses[10:], rtol=1e-6, atol=1e-6)


def test_mismatches_are_named(trained, cpu_devices, tmp_path):
    _, _, path = trained
    mesh = meshes(cpu_devices)["8"]
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


def test_swapped_layers_restore_by_name(cpu_devices, tmp_path):
    """Two layers of equal shape whose attribute order changed: values follow names, not order."""

    class Two(nnx.Module):
        def __init__(self, rngs, first="a"):
            for name in (first, "b" if first == "a" else "a"):
                setattr(self, name, nnx.Linear(D, D, rngs=rngs))

        def __call__(self, x):
            return self.b(self.a(x))

    mesh = meshes(cpu_devices)["8"]
    model = Two(nnx.Rngs(0))
    fsdp = FSDP(model, mesh)
    fsdp.save(fsdp.init(model, optax.sgd(0.1)), tmp_path / "two")
    other = Two(nnx.Rngs(1), first="b")
    restored = FSDP(other, mesh).gather(FSDP(other, mesh).restore(tmp_path / "two", optax.sgd(0.1)))
    for name in ("a", "b"):
        np.testing.assert_array_equal(
            np.asarray(getattr(restored, name).kernel.get_value()), np.asarray(getattr(model, name).kernel.get_value())
        )


def test_init_from_sharded_params(cpu_devices):
    """Parameters created sharded (jit with out_shardings) are placed without a host round trip:
    the state equals the one built from host values."""
    mesh = meshes(cpu_devices)["8"]
    model = make_net()
    fsdp = FSDP(model, mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp"))
    sharded = jax.tree.map(lambda a: jax.device_put(a, spec) if a.ndim == 2 and a.shape[1] % 8 == 0 else a, params)
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(sharded))
    from_sharded = fsdp.init(nnx.merge(graphdef, sharded), TX)
    from_host = fsdp.init(model, TX)
    for a, b in zip(jax.tree.leaves(from_sharded), jax.tree.leaves(from_host)):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))


def test_two_processes_init_from_sharded_params_then_resume_here(cpu_devices, tmp_path):
    """2 processes x 4 CPU devices: FSDP built from parameters sharded across both processes
    (no host transfer allowed), 10 steps, saved; here (1 process x 8 devices) the same 10
    steps give the same losses, and the 2-process checkpoint resumes to the same next losses."""
    from _fsdp_workers import STEPS
    from multiproc import run_processes

    results = run_processes("tests/_fsdp_workers.py:train_and_save", 2, args=[str(tmp_path / "mp")], timeout=240)
    for i, r in enumerate(results):
        assert r.result["process"] == i and r.result["devices"] == 8
        assert not any(r.result["params_fully_addressable"])
    assert results[0].result["losses"] == results[1].result["losses"]

    mesh = meshes(cpu_devices)["8"]
    model = make_net()
    fsdp = FSDP(model, mesh)
    state = fsdp.init(model, TX)
    step = fsdp.train_step(loss_fn, TX)
    losses = []
    for i in range(STEPS + 2):
        state, loss = step(state, batch(i))
        losses.append(float(loss))
    np.testing.assert_allclose(results[0].result["losses"], losses[:STEPS], rtol=1e-6, atol=1e-6)
    resumed = fsdp.restore(tmp_path / "mp", TX)
    assert int(resumed.step) == STEPS
    more = []
    for i in range(STEPS, STEPS + 2):
        resumed, loss = step(resumed, batch(i))
        more.append(float(loss))
    np.testing.assert_allclose(more, losses[STEPS:], rtol=1e-6, atol=1e-6)
