"""MaxText's own decoder-only Transformer trained through ``mxfp8_jax.flax.FSDP``, next to the
model's own ``jax.jit`` step.

MaxText (Google's JAX LLM trainer) builds its NNX ``Transformer`` from its own config system
(``pyconfig.initialize`` on ``base.yml``): here a tiny llama2 model on simulated CPU devices, its
layers stacked by ``nnx.scan`` with the layer axis at ``param_scan_axis`` (``--axis``; MaxText's
default is 1, not 0), remat as MaxText's default, bf16 compute on fp32 weights, dot-product
attention. The loss is this script's own: next-token cross entropy on random tokens. Then

  - ``FSDP(model, mesh, loss_fn=loss_fn, example_batch=batch)``: the plan table (what each
    parameter became), the MaxText sharding constraints that replicate what the step splits
    (``fsdp.constraints``; ``--drop-constraints``: ``model_constraints="drop"``);
  - ``--steps`` adamw steps of the FSDP step and of the reference step (``jax.jit`` of
    ``value_and_grad`` over the nnx params, batch split over the mesh, params replicated), from
    the same weights on the same batch: per step both losses and their relative difference;
  - both compiled steps' ``memory_analysis()``: temp bytes, their ratio, argument bytes;
  - the parameters by kind (``fsdp.params``) and each one's layer axes and unit stack.

Both run under MaxText's logical axis rules, as MaxText's trainer runs its model; its
activation constraints name the ``fsdp`` axis of MaxText's own mesh (``ici_fsdp_parallelism``
over all devices). MaxText's trainer also enters that mesh (``jax.set_mesh``); here it is not
entered: FSDP's steps place their values on FSDP's mesh themselves and refuse to run under a
context mesh (a ``ValueError`` that says so). An error from FSDP is printed with its traceback,
after the reference's numbers.

Install MaxText without its dependencies (they pin other jax/flax versions), then the packages
its model-building path imports, holding jax, jaxlib, flax, optax and numpy where they are::

    pip freeze > pins.txt
    pip install maxtext==0.2.5 --no-deps
    pip install -c pins.txt omegaconf jinja2 qwix aqtp drjax fastapi uvicorn requests \\
        huggingface_hub transformers grain tiktoken sentencepiece sympy wadler_lindig
    pip install -c pins.txt --no-deps pathwaysutils tokamax immutabledict xprof fire termcolor six \\
        jaxtyping einshape tqdm

Run (in an environment where both ``maxtext`` and ``mxfp8_jax`` import)::

    python scripts/maxtext_probe.py                     # --axis 1 --depth 2 --steps 3
    python scripts/maxtext_probe.py --axis 0 --drop-constraints
    python scripts/maxtext_probe.py --precision bf16    # bf16 units: the harness, without MXFP8's rounding
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.metadata
import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

DEVICES = 8
BATCH, SEQ = 8, 32  # one sequence per device; MaxText's max_target_length
INSTALL = "pip install maxtext==0.2.5 --no-deps (and its import deps: see this script's docstring)"


def maxtext_config(axis: int, depth: int) -> Any:
    """A tiny llama2 config from MaxText's own ``base.yml`` and overrides."""
    from maxtext.configs import pyconfig
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    overrides = dict(
        run_name="maxtext_probe",
        base_output_directory=os.path.join(tempfile.gettempdir(), "maxtext_probe"),
        hardware="cpu",
        skip_jax_distributed_system=True,
        enable_checkpointing=False,
        dataset_type="synthetic",
        decoder_block="llama2",
        base_emb_dim=256,
        base_mlp_dim=512,
        base_num_query_heads=4,
        base_num_kv_heads=4,
        head_dim=64,
        vocab_size=512,
        base_num_decoder_layers=depth,
        max_target_length=SEQ,
        per_device_batch_size=BATCH // DEVICES,
        scan_layers=True,
        param_scan_axis=axis,
        attention="dot_product",
        dropout_rate=0.0,
        enable_dropout=False,
    )
    return pyconfig.initialize(["", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")], **overrides)


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(b) < 1024:
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--axis", type=int, default=1, help="MaxText's param_scan_axis (default 1, MaxText's)")
    parser.add_argument("--depth", type=int, default=2, help="num_decoder_layers (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="adamw steps of each (default 3)")
    parser.add_argument("--precision", choices=("mxfp8", "bf16"), default="mxfp8", help="FSDP(precision=) of the units")
    parser.add_argument("--drop-constraints", action="store_true", help='FSDP(model_constraints="drop")')
    args = parser.parse_args()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # MaxText imports transformers' configs
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    try:
        from flax.linen import partitioning as nn_partitioning
        from maxtext.utils import maxtext_utils, maxtext_utils_nnx, model_creation_utils
    except ImportError as err:
        print(f"maxtext_probe: MaxText is not importable ({err}); {INSTALL}", file=sys.stderr)
        return 2
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from mxfp8_jax.flax import FSDP, ModelConstraintWarning

    versions = {name: importlib.metadata.version(name) for name in ("jax", "flax", "optax", "maxtext", "mxfp8_jax")}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))

    cfg = maxtext_config(args.axis, args.depth)
    mt_mesh = maxtext_utils.get_mesh_from_config(cfg)
    model = model_creation_utils.from_config(cfg, mesh=mt_mesh, rngs=maxtext_utils_nnx.create_nnx_rngs(cfg))
    print(
        f"model: {type(model).__module__}.{type(model).__qualname__}, decoder_block={cfg.decoder_block}, "
        f"layers={cfg.num_decoder_layers}, scan_layers={cfg.scan_layers}, param_scan_axis={cfg.param_scan_axis}, "
        f"remat_policy={cfg.remat_policy}, dtype={cfg.dtype}, weight_dtype={cfg.weight_dtype}, "
        f"attention={cfg.attention}"
    )
    sized = {k: v for k, v in mt_mesh.shape.items() if v > 1}
    same = list(mt_mesh.devices.flat) == jax.devices()
    print(f"MaxText mesh: {sized} (other axes 1), devices in jax.devices() order: {same}")

    @contextlib.contextmanager
    def maxtext_context() -> Iterator[None]:
        """MaxText's logical axis rules, as its trainer runs the model."""
        with nn_partitioning.axis_rules(cfg.logical_axis_rules):
            yield

    def loss_fn(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
        """Next-token cross entropy, mean over the batch."""
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        logits = model(inputs, positions, decoder_segment_ids=jnp.ones_like(inputs), enable_dropout=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, cfg.vocab_size, dtype=jnp.int32)
    batch = {"tokens": tokens}
    tx = optax.adamw(1e-3)

    # The reference: the model's own step, params replicated, the batch split over the mesh.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    replicated = NamedSharding(mesh, P())
    ref_params = jax.device_put(params, replicated)
    ref_rest = jax.device_put(rest, replicated)
    ref_batch = jax.device_put(batch, NamedSharding(mesh, P("fsdp")))

    def ref_loss(params: nnx.State, rest: nnx.State, batch: dict[str, jax.Array]) -> jax.Array:
        return loss_fn(nnx.merge(graphdef, params, rest, copy=True), batch)

    def ref_step(params: nnx.State, opt_state: Any, rest: nnx.State, batch: dict[str, jax.Array]) -> tuple:
        loss, grads = jax.value_and_grad(ref_loss)(params, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ref_losses: list[float] = []
    with maxtext_context():
        ref_jit = jax.jit(ref_step)
        opt_state = tx.init(ref_params)
        lowered = ref_jit.lower(ref_params, opt_state, ref_rest, ref_batch)
        ref_memory = lowered.compile().memory_analysis()
        for _ in range(args.steps):
            ref_params, opt_state, loss = ref_jit(ref_params, opt_state, ref_rest, ref_batch)
            ref_losses.append(float(loss))

    mode = "drop" if args.drop_constraints else "keep"
    fsdp_losses: list[float] = []
    try:
        with maxtext_context(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ModelConstraintWarning)
            fsdp = FSDP(
                model, mesh, loss_fn=loss_fn, example_batch=batch, model_constraints=mode, precision=args.precision
            )
        for message in dict.fromkeys(str(w.message) for w in caught if w.category is ModelConstraintWarning):
            print(f"ModelConstraintWarning: {message}")
        for w in caught:
            if w.category is not ModelConstraintWarning:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        print()
        print(fsdp)
        with maxtext_context():
            state = fsdp.init(model, tx)
            step = fsdp.train_step(loss_fn, tx)
            for _ in range(args.steps):
                state, loss = step(state, batch)
                fsdp_losses.append(float(loss))
            compiled = fsdp.lower_train_step(loss_fn, tx, fsdp.abstract_state(tx), batch).compile()
        fsdp_memory = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - the probe reports what FSDP makes of the model, errors included
        print(f"\nFSDP(model_constraints={mode!r}) failed:\n{traceback.format_exc()}")
        print("reference losses: " + ", ".join(f"{v:.6f}" for v in ref_losses))
        print(f"reference step temp: {fmt_bytes(ref_memory.temp_size_in_bytes)}")
        return 1

    print(f"\n{'step':>4}  {'FSDP loss':>10}  {'reference':>10}  {'rel diff':>9}")
    for i, (a, b) in enumerate(zip(fsdp_losses, ref_losses, strict=True)):
        print(f"{i:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b) / abs(b):>9.2e}")
    fsdp_temp, ref_temp = fsdp_memory.temp_size_in_bytes, ref_memory.temp_size_in_bytes
    print(
        f"\ntemp memory: FSDP step {fmt_bytes(fsdp_temp)}, reference step {fmt_bytes(ref_temp)}, "
        f"ratio {fsdp_temp / ref_temp:.3f}"
    )
    print(
        f"arguments (state + batch, per device): FSDP step {fmt_bytes(fsdp_memory.argument_size_in_bytes)}, "
        f"reference step {fmt_bytes(ref_memory.argument_size_in_bytes)} (params and adamw state replicated)"
    )
    kinds = collections.Counter(p.kind for p in fsdp.params)
    print("parameters by kind: " + ", ".join(f"{k} {kinds.get(k, 0)}" for k in ("mxfp8", "bf16", "plain", "frozen")))
    width = max(len(p.name) for p in fsdp.params)
    for p in fsdp.params:
        print(f"  {p.name:<{width}}  {p.kind:<6}  shape {p.shape}  layer_axes {p.layer_axes}  stack {p.stack}")
    print(f"model constraints that replicate the batch split: {len(fsdp.constraints)} (model_constraints={mode!r})")
    for c in fsdp.constraints:
        print(f"  {c.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
