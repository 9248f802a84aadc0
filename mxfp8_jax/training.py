"""The training loop ``mxfp8-jax demo`` and the benchmarks share: a workload (a model, its loss,
its data and an optimizer schedule) trained with FSDP, reporting losses, timings and what the
compiled step communicates.

- ``Workload("transformer", ...)``: the Llama-style decoder LM of ``mxfp8_jax.models`` on the
  synthetic permutation task (``data="permutation"``) or on real text (``data="text"``, with
  held-out validation batches), FSDP alone or sequence/tensor parallel (``tp > 1``);
  ``Workload("mlp", ...)``: a residual MLP (``make_model``) classifying the labels of a fixed
  random ``Teacher`` network.
- ``train(work, precision, mesh=...)``: one FSDP run of a workload (``precision`` ``"mxfp8"`` or
  ``"bf16"``), its step compiled once; returns the losses, validation curve, timings, memory
  and the collectives read from the compiled HLO.
- ``configure_devices`` / ``select_devices``: the simulated CPU devices asked for before jax
  starts, and the devices a run uses; ``progress_bar``: one rich bar per run.

Heavy imports (jax, flax, optax, rich) happen inside the functions, so that importing this
module leaves jax's backends unstarted.
"""

from __future__ import annotations

import itertools
import time

DEFAULT_CPU_DEVICES = 8
PER_DEVICE_BATCH = 32
IN_FEATURES, CLASSES, DEPTH = 64, 10, 2


def configure_devices(devices: int | None) -> None:
    """Ask for ``devices`` simulated CPU devices (default 8) before jax starts its backends.

    Accelerators are unaffected; if the backends are already running, this does nothing.
    """
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", devices or DEFAULT_CPU_DEVICES)
    except RuntimeError:  # backends already initialised: use what exists
        pass


def select_devices(devices: int | None):
    """The first ``devices`` local devices (all of them when None); ValueError past what exists."""
    import jax

    available = jax.devices()
    if devices is None:
        return available
    if devices < 1 or devices > len(available):
        raise ValueError(
            f"--devices={devices}: must be between 1 and the {len(available)} {available[0].platform} devices available"
        )
    return available[:devices]


# ------------------------------------------------------------------------------------------------
# Model and data


def make_model(hidden: int, seed: int):
    """The demo's residual MLP, initialised on the host from ``seed`` (LeCun-normal kernels,
    zero biases, unit norm scales): no XLA program is compiled to build it."""
    import numpy as np
    from flax import nnx

    from mxfp8_jax.flax import Linear

    class ResidualMLP(nnx.Module):
        """in -> hidden, DEPTH residual blocks x + gelu(Linear(LayerNorm(x))), -> classes."""

        def __init__(self, rngs: nnx.Rngs):
            self.embed = Linear(IN_FEATURES, hidden, rngs=rngs)
            self.norms = nnx.List([nnx.LayerNorm(hidden, rngs=rngs) for _ in range(DEPTH)])
            self.blocks = nnx.List([Linear(hidden, hidden, rngs=rngs) for _ in range(DEPTH)])
            self.head = Linear(hidden, CLASSES, rngs=rngs)  # 10 outputs: not MXFP8-eligible

        def __call__(self, x):
            import jax

            h = self.embed(x)
            for norm, block in zip(self.norms, self.blocks):
                h = h + jax.nn.gelu(block(norm(h)))
            return self.head(h)

    model = nnx.eval_shape(lambda: ResidualMLP(nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        shape, name = var.get_value().shape, path[-1]
        if name == "kernel":
            value = rng.standard_normal(shape) / np.sqrt(shape[0])
        elif name == "scale":
            value = np.ones(shape)
        else:
            value = np.zeros(shape)
        var.set_value(value.astype(np.float32))
    return model


def loss_fn(model, batch):
    import jax.numpy as jnp
    import optax

    x, labels = batch
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Teacher:
    """Labels from a fixed random tanh network; batches drawn from a seeded numpy stream."""

    def __init__(self, seed: int, hidden: int = 128):
        import numpy as np

        rng = np.random.default_rng(seed + 1_000_003)
        self.a = rng.standard_normal((IN_FEATURES, hidden)).astype(np.float32) / np.sqrt(IN_FEATURES)
        self.b = rng.standard_normal((hidden, CLASSES)).astype(np.float32) / np.sqrt(hidden)
        self.seed = seed

    def batches(self, steps: int, batch: int):
        import numpy as np

        rng = np.random.default_rng(self.seed)
        for _ in range(steps):
            x = rng.standard_normal((batch, IN_FEATURES)).astype(np.float32)
            yield x, np.argmax(np.tanh(x @ self.a) @ self.b, axis=-1).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# The two workloads


MODELS = ("transformer", "mlp")
DATA = ("permutation", "text")
SEQ_LEN = 64
VALIDATION_BATCHES = 4


class Workload:
    """A model, its loss, its data stream and an optimizer schedule; built once per demo."""

    def __init__(
        self,
        kind: str,
        *,
        hidden: int,
        layers: int,
        seed: int,
        steps: int,
        tp: int = 1,
        norm_path: str = "fused",
        data: str = "permutation",
    ):
        import optax

        self.kind, self.steps, self.tp, self.data = kind, steps, tp, data
        if tp > 1 and kind != "transformer":
            raise ValueError(f"tp={tp}: tensor parallelism is for --model transformer")
        if data not in DATA:
            raise ValueError(f"data={data!r} must be one of {DATA}")
        if data == "text" and kind != "transformer":
            raise ValueError("data='text' is a language-modelling task: it needs --model transformer")
        self.validation = None
        if kind == "transformer":
            from mxfp8_jax import models

            extra = dict(norm="mxfp8", norm_path=norm_path) if tp > 1 else {}
            self.config = models.TransformerConfig(
                vocab=256 if data == "text" else 128,
                hidden=hidden,
                heads=max(1, hidden // 32),
                head_dim=32,
                mlp=2 * hidden,
                layers=layers,
                **extra,
            )
            if tp > 1 and (self.config.heads % tp or self.config.mlp % (32 * tp)):
                raise ValueError(
                    f"tp={tp} must divide the {self.config.heads} heads and leave the MLP's "
                    f"{self.config.mlp} features a multiple of 32 per device (try a larger --hidden)"
                )
            self.model = models.init_transformer(self.config, seed)
            self.loss_fn = models.next_token_loss
            # under tp the sequence is split: (inputs, targets) pairs of SEQ_LEN tokens
            self._pairs = tp > 1
            self.per_device_batch = 8
            peak = 1e-2
            if data == "text":
                self._task = models.TextTask(SEQ_LEN + 1, seed)
                floor = f"{self._task.describe()}; unigram entropy {self._task.unigram_entropy:.3f}"
                peak = 3e-3
            else:
                self._task = models.SequenceTask(self.config.vocab, SEQ_LEN + self._pairs, seed)
                floor = f"loss floor {self._task.loss_floor:.3f}"
            self.schedule = optax.warmup_cosine_decay_schedule(0.0, peak, min(10, (steps - 1) // 2), steps, peak / 10)
            self.describe = (
                f"Llama-style LM: vocab {self.config.vocab}, hidden {hidden}, {layers} scanned blocks "
                f"({self.config.heads} heads, SwiGLU {self.config.mlp}), remat, sequences of {SEQ_LEN}, {floor}"
            )
            if tp > 1:
                self.describe += f"; sequence/tensor parallel over tp={tp}, {norm_path} all-gather + RMSNorm + quantize"
        elif kind == "mlp":
            self.model = make_model(hidden, seed)
            self.loss_fn = loss_fn
            self._task = Teacher(seed)
            self.per_device_batch = PER_DEVICE_BATCH
            self.schedule = optax.cosine_decay_schedule(3e-3, steps, alpha=0.1)
            self.describe = f"residual MLP {IN_FEATURES}->{hidden}x{DEPTH + 1}->{CLASSES}"
        else:
            raise ValueError(f"model={kind!r} must be one of {MODELS}")

    def batches(self, batch: int):
        return self._pairs_of(self._task.batches(self.steps, batch))

    def validation_batches(self, batch: int) -> list | None:
        """Held-out batches (``--data text``: windows of files never trained on), else None."""
        if self.data != "text":
            return None
        return list(self._pairs_of(iter(self._task.validation_batches(batch, VALIDATION_BATCHES))))

    def _pairs_of(self, stream):
        if getattr(self, "_pairs", False):
            from mxfp8_jax import models

            return (models.next_token_pairs(t) for t in stream)
        return stream


# ------------------------------------------------------------------------------------------------
# Training


def train(
    work: Workload,
    precision: str,
    *,
    mesh,
    progress=None,
    gemm: str = "dequantized",
    label: str | None = None,
    eval_every: int | None = None,
    weight_blocks: str = "1x32",
) -> dict:
    """Trains ``work.model``'s weights (the module is not modified) with ``precision`` FSDP
    weights (``gemm``: how MXFP8 units multiply; ``weight_blocks``: their blocks); returns
    losses, timings, the validation loss where the task has held-out data (every ``eval_every``
    steps too: ``"validation"``), and the step's collectives (read from its compiled HLO)."""
    import optax

    from mxfp8_jax._src.compiled import hlo
    from mxfp8_jax.flax import FSDP

    data = work.batches(work.per_device_batch * (mesh.size // work.tp))
    first = next(data)
    fsdp = FSDP(
        work.model,
        mesh,
        precision=precision,
        tp_axis="tp" if work.tp > 1 else None,
        loss_fn=work.loss_fn,
        example_batch=first,
        gemm=gemm,
        weight_blocks=weight_blocks,
    )
    tx = optax.adam(work.schedule)
    state = fsdp.init(work.model, tx)

    t0, c0 = time.perf_counter(), time.process_time()
    compiled = fsdp.lower_train_step(work.loss_fn, tx, state, first).compile()
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    found = hlo.collectives(compiled.as_text())
    memory = compiled.memory_analysis()

    label = label or precision
    held_out = work.validation_batches(work.per_device_batch * (mesh.size // work.tp))
    evaluate = fsdp.eval_step(work.loss_fn) if held_out else None
    curve, eval_s = [], 0.0

    def validate(step: int) -> float:
        nonlocal eval_s
        t = time.perf_counter()
        value = sum(float(evaluate(state, b)) for b in held_out) / len(held_out)
        eval_s += time.perf_counter() - t
        curve.append((step, value))
        return value

    if evaluate is not None and eval_every:
        validate(0)  # (compiles the evaluation before the timed steps)
        eval_s = 0.0
    task = None if progress is None else progress.add_task(label, total=work.steps, loss=float("nan"))
    losses, started = [], None
    for b in itertools.chain([first], data):
        state, loss = compiled(state, fsdp.place_batch(b))
        losses.append(float(loss))
        started = started or (time.perf_counter(), time.process_time())  # later steps are timed
        if evaluate is not None and eval_every and len(losses) % eval_every == 0 and len(losses) < work.steps:
            validate(len(losses))
        if task is not None:
            progress.update(task, advance=1, loss=losses[-1])
    ended = time.perf_counter() - eval_s
    timed = max(1, len(losses) - 1)
    step_s = (ended - started[0]) / timed
    step_cpu_s = (time.process_time() - started[1]) / timed  # (validation included)
    validation_loss = validate(len(losses)) if evaluate is not None else None

    gathers = [c for c in found if c.op == "all-gather"]
    weight_gather = sum(c.bytes_per_step for c in gathers if max(map(hlo.dtype_bytes, c.dtypes)) <= 2)
    by_dtype = lambda d: sum(c.bytes_per_step for c in gathers if c.dtypes == (d,))
    return {
        "precision": precision,
        "gemm": gemm,
        "losses": losses,
        "validation_loss": validation_loss,
        "validation": curve,
        "first_loss": losses[0] if losses else None,
        "final_loss": _tail_mean(losses),
        "compile_s": compile_s,
        "compile_cpu_s": compile_cpu_s,
        "step_s": step_s,
        "step_cpu_s": step_cpu_s,
        "temp_bytes": memory.temp_size_in_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "all_gather_bytes": sum(c.bytes_per_step for c in gathers),
        "weight_all_gather_bytes": weight_gather,
        "mxfp8_gather_bytes": by_dtype("u8"),
        "bf16_gather_bytes": by_dtype("u16"),
        "reduce_scatter_bytes": sum(c.bytes_per_step for c in found if c.op == "reduce-scatter"),
        "collectives": [
            {"op": c.op, "outputs": [[d, list(s)] for d, s in c.outputs], "bytes": c.bytes, "per_step": c.count}
            for c in found
        ],
        "units": len(fsdp.units),
        "mxfp8_units": len(fsdp.mxfp8_units),
        "bf16_units": len(fsdp.units) - len(fsdp.mxfp8_units),
        "eligible_elements": fsdp.weight_elements,
        "plan": fsdp.summary(),
        "stored_elements": fsdp.stored_elements,
        "plain_elements": fsdp.plain_elements,
    }


def progress_bar(console=None, width: int = 6):
    """A started rich progress display with one bar per training run (its label, the steps
    done and the last loss); ``.stop()`` it when the runs are over."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn(f"{{task.description:>{width}}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
        console=console,
    )
    progress.start()
    return progress


def _tail_mean(losses, n: int = 10):
    tail = losses[-n:]
    return sum(tail) / len(tail) if tail else None
