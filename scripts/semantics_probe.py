"""Does the FSDP step compute what the model computes? Four measurements against the unsharded
model, for a before/after note on the issue "The FSDP step computes what the model computes".

On 8 simulated CPU devices (``--devices``), one ``optax.sgd(1.0)`` step of the models of
``tests/test_fsdp_semantics.py`` (imported from there, so the probe measures what the tests
assert; every weight a signed power of two, so that MXFP8 and bf16 hold it exactly and only the
order of fp32 sums may differ), FSDP against the same model's own step jitted on one device:

  (a) a token-masked mean loss with uneven padding: the loss, and the parameter update (all
      parameters: relative Frobenius difference of ``after - before``);
  (b) ``has_aux=True``: the token count ``mask.sum()`` and the shape of a per-example ``[B]`` array;
  (c) ``nnx.BatchNorm`` in training mode: the loss, the update, the running averages after the step;
  (d) ``lax.psum(x, "fsdp")`` in the loss: what ``FSDP(...)`` and its step do (the error's first
      line, or the loss).

Each case catches its exceptions and prints them, so the script runs on any version of the code.

    python scripts/semantics_probe.py              # a markdown table
    python scripts/semantics_probe.py --devices 4
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    sys.path.insert(0, str(TESTS))
    import test_fsdp_semantics as sem

    n = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    b = sem.batch_size(n)
    rows: list[tuple[str, str, str, str]] = []

    def fmt(x) -> str:
        return f"{float(x):.6g}"

    def rel(got, want) -> str:
        return f"{sem.frobenius(got, want):.3g}"

    def first_line(err: BaseException) -> str:
        line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"{type(err).__name__}: {line}"[:240]

    def update_rows(label, got, want, before) -> None:
        """All parameters' updates ``after - before`` as one vector each: their norms and the
        relative Frobenius difference."""
        got, want, before = sem.flat(got), sem.flat(want), sem.flat(before)
        keys = sorted(want)
        if sorted(got) != keys:
            rows.append((label, f"parameters {sorted(got)}", f"parameters {keys}", "-"))
            return
        g = np.concatenate([(got[k].astype(np.float64) - before[k]).ravel() for k in keys])
        w = np.concatenate([(want[k].astype(np.float64) - before[k]).ravel() for k in keys])
        rows.append((label, f"norm {np.linalg.norm(g):.6g}", f"norm {np.linalg.norm(w):.6g}", rel(g, w)))

    # (a) and (b): the masked LM with aux
    model, batch, (loss, aux, params, _) = sem.reference("lm", b)
    lengths = batch["mask"].sum(1).astype(int).tolist()
    print(f"{n} CPU devices; LM batch {b} x {sem.SEQ}, real tokens per sequence {lengths}")
    try:
        got_loss, got_aux, got_params, _ = sem.fsdp_step(
            nnx.clone(model), mesh, sem.masked_lm_loss, batch, has_aux=True
        )
        rows.append(("(a) masked-mean loss, uneven padding", fmt(got_loss), fmt(loss), rel(got_loss, loss)))
        update_rows("(a) parameter update after one step", got_params, params, nnx.state(model, nnx.Param))
        rows.append(
            (
                "(b) aux: token count mask.sum()",
                fmt(got_aux["ntokens"]),
                fmt(aux["ntokens"]),
                rel(got_aux["ntokens"], aux["ntokens"]),
            )
        )
        shape_of = lambda a: str(tuple(np.shape(a)))
        rows.append(
            (
                "(b) aux: per-example [B] array, shape",
                shape_of(got_aux["per_example"]),
                shape_of(aux["per_example"]),
                "-",
            )
        )
    except Exception as err:  # noqa: BLE001 - the probe reports whatever the code does
        rows.append(("(a)/(b) masked LM step", first_line(err), fmt(loss), "-"))

    # (c) BatchNorm in training mode
    model, batch, (loss, _, params, rest) = sem.reference("batchnorm", b)
    try:
        got_loss, _, got_params, got_rest = sem.fsdp_step(nnx.clone(model), mesh, sem.mse_loss, batch, has_aux=False)
        rows.append(("(c) BatchNorm training: loss", fmt(got_loss), fmt(loss), rel(got_loss, loss)))
        update_rows("(c) BatchNorm training: parameter update", got_params, params, nnx.state(model, nnx.Param))
        for k, want in sem.flat(rest).items():
            got = sem.flat(got_rest).get(k)
            shown = "missing" if got is None else f"norm {np.linalg.norm(got):.6g}"
            rows.append(
                (
                    f"(c) BatchNorm running {k} after the step",
                    shown,
                    f"norm {np.linalg.norm(want):.6g}",
                    "-" if got is None else rel(got, want),
                )
            )
    except Exception as err:  # noqa: BLE001
        rows.append(("(c) BatchNorm training step", first_line(err), fmt(loss), "-"))

    # (d) lax.psum over the FSDP axis in the loss
    model = sem.exact_weights(sem.DropoutMLP(nnx.Rngs(0)))
    batch, loss_fn = sem.regression_batch(b), sem.psum_loss("fsdp")
    try:
        _, _, _, _ = out = sem.fsdp_step(nnx.clone(model), mesh, loss_fn, batch, has_aux=False)
        fsdp_says = f"loss {fmt(out[0])}"
    except Exception as err:  # noqa: BLE001
        fsdp_says = first_line(err)
    try:
        unsharded_says = f"loss {fmt(sem.unsharded_step(model, loss_fn, batch, has_aux=False)[0])}"
    except Exception as err:  # noqa: BLE001
        unsharded_says = first_line(err)
    rows.append(('(d) lax.psum(x, "fsdp") in the loss', fsdp_says, unsharded_says, "-"))

    header = ("case", "FSDP", "unsharded", "relative difference")
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")


if __name__ == "__main__":
    main()
