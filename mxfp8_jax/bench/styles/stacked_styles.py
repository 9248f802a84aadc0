"""Small Flax NNX token LMs whose layers are read by index, skipped, shared or frozen.

Each model is ``nnx.Embed`` -> ``depth`` residual MLP blocks -> ``nnx.RMSNorm`` -> an
``nnx.Linear`` head (int32 tokens ``[batch, seq]`` -> fp32 logits ``[batch, seq, vocab]``),
built only from plain Flax NNX and JAX, and each has a ``loop=`` option choosing how the
blocks run. A block is ``h + gelu(rmsnorm(h) @ w_in) @ w_out`` with its own RMSNorm scale.

- ``"stacked"`` (``StackedMLP``): the layers' weights as stacked ``nnx.Param`` arrays
  ``w_in [L, D, F]``, ``w_out [L, F, D]``, ``norm [L, D]``, read by index: ``loop="fori"``
  (``lax.fori_loop`` with static bounds, ``self.w_in[i]`` at a traced ``i``), ``"python"``
  (``self.w_in[i]`` at a Python ``i``), ``"scan"`` (``lax.scan`` over the stacked arrays as
  ``xs``: the reference form).
- ``"layerdrop"`` (``LayerDropMLP``): each block run under ``lax.cond(keep[l], block, identity)``
  with ``keep`` derived from the batch (the same on every device); ``loop="python"`` (an
  ``nnx.List``) or ``"scan"`` (blocks stacked by ``nnx.vmap``, run by ``nnx.scan``).
- ``"lora"`` (``LoRAMLP``): each projection an ``nnx.LoRA`` around an ``nnx.Linear`` base
  (base kernel an ``nnx.Param``, adapters ``nnx.LoRAParam``), meant to be trained with only the
  ``nnx.LoRAParam`` s; ``loop="python"`` or ``"scan"``.
- ``"frozen"`` (``CustomFrozenMLP``): base kernels held in ``FrozenWeight`` (an
  ``nnx.Variable``, not a Param), adapters ``a``/``b`` ``nnx.Param``; ``loop="python"`` or
  ``"scan"``.
- ``"shared"`` (``SharedBlockMLP``): one block applied ``depth`` times; ``loop="fori"`` (the
  block's weights loop-invariant) or ``"python"``.

``build(name, cfg, seed)`` gives a model with values drawn from ``nnx.Rngs(seed)``;
``loss_fn`` and ``make_batch`` are those of a next-token LM.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_normal = nnx.initializers.normal(0.02)
_lecun = nnx.initializers.lecun_normal()


@dataclasses.dataclass(frozen=True)
class StackConfig:
    """Sizes of a stacked-style model: ``vocab`` tokens, hidden ``width`` (D), MLP ``mlp`` (F),
    ``depth`` (L) blocks, LoRA/adapter ``rank`` (r). D, F and vocab are multiples of 32 by
    default (the GEMM sides that MXFP8 blocks); the adapters' rank is not."""

    vocab: int = 64
    width: int = 64
    mlp: int = 128
    depth: int = 2
    rank: int = 8

    def __post_init__(self):
        for name in ("vocab", "width", "mlp", "depth", "rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"StackConfig.{name} must be a positive int, got {v!r}")


def _rmsnorm(x, scale, eps: float = 1e-6):
    """``x`` normalised by its root mean square over the last axis, times ``scale``."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _check_loop(model: str, loop: str, allowed: tuple[str, ...]) -> str:
    if loop not in allowed:
        raise ValueError(f"{model}: loop must be one of {allowed}, got loop={loop!r}")
    return loop


def _stacked(block: type, cfg: StackConfig, rngs: nnx.Rngs) -> nnx.Module:
    """``cfg.depth`` blocks created at once (``nnx.split_rngs`` + ``nnx.vmap``): one module whose
    variables carry a leading layer axis."""

    @nnx.split_rngs(splits=cfg.depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs):
        return block(cfg, rngs=rngs)

    return create(rngs)


class _LM(nnx.Module):
    """The shared frame: ``nnx.Embed`` tokens, ``self.blocks_forward(h, tokens)``, final
    ``nnx.RMSNorm``, untied ``nnx.Linear`` head (no bias)."""

    def _frame(self, cfg: StackConfig, loop: str, rngs: nnx.Rngs):
        self.loop, self.depth = loop, cfg.depth
        self.embed = nnx.Embed(cfg.vocab, cfg.width, embedding_init=_normal, rngs=rngs)
        self.final_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.head = nnx.Linear(cfg.width, cfg.vocab, use_bias=False, rngs=rngs)

    def blocks_forward(self, h, tokens):
        raise NotImplementedError

    def __call__(self, tokens):
        h = self.blocks_forward(self.embed(tokens), tokens)
        return self.head(self.final_norm(h))


# --------------------------------------------------------------------------------------------
# 1. StackedMLP: stacked nnx.Param weights read by index
# --------------------------------------------------------------------------------------------


class StackedMLP(_LM):
    """Every layer's weights in three stacked ``nnx.Param`` s: ``w_in [L, D, F]``,
    ``w_out [L, F, D]``, ``norm [L, D]`` (one RMSNorm scale per layer). Block ``l``:
    ``h + gelu(rmsnorm(h, norm[l]) @ w_in[l]) @ w_out[l]``.

    ``loop="fori"``: ``lax.fori_loop(0, L, body, h)`` (static bounds) whose body reads
    ``self.w_in[i]`` at the traced index; ``"python"``: ``for i in range(L)`` reading
    ``self.w_in[i]``; ``"scan"``: ``lax.scan`` over ``(w_in, w_out, norm)`` as ``xs``.
    """

    LOOPS = ("fori", "python", "scan")

    def __init__(self, cfg: StackConfig, *, loop: str = "scan", rngs: nnx.Rngs):
        self._frame(cfg, _check_loop("StackedMLP", loop, self.LOOPS), rngs)
        L, D, F = cfg.depth, cfg.width, cfg.mlp
        self.w_in = nnx.Param(_lecun(rngs.params(), (L, D, F)))
        self.w_out = nnx.Param(_lecun(rngs.params(), (L, F, D)))
        self.norm = nnx.Param(jnp.ones((L, D), jnp.float32))

    @staticmethod
    def _block(h, w_in, w_out, norm):
        return h + nnx.gelu(_rmsnorm(h, norm) @ w_in) @ w_out

    def blocks_forward(self, h, tokens):
        if self.loop == "scan":

            def step(h, ws):
                return self._block(h, *ws), None

            h, _ = jax.lax.scan(step, h, (self.w_in[...], self.w_out[...], self.norm[...]))
            return h
        if self.loop == "fori":

            def body(i, h):
                return self._block(h, self.w_in[i], self.w_out[i], self.norm[i])

            return jax.lax.fori_loop(0, self.depth, body, h)
        for i in range(self.depth):
            h = self._block(h, self.w_in[i], self.w_out[i], self.norm[i])
        return h


# --------------------------------------------------------------------------------------------
# 2. LayerDropMLP: blocks run under lax.cond, some skipped
# --------------------------------------------------------------------------------------------


class NormScale(nnx.Module):
    """An RMSNorm whose scale is one ``nnx.Param [D]``."""

    def __init__(self, dim: int):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x):
        return _rmsnorm(x, self.scale[...])


class MLPBlock(nnx.Module):
    """``h + w_out(gelu(w_in(rmsnorm(h))))`` with ``nnx.Linear`` in/out kernels (no bias)."""

    def __init__(self, cfg: StackConfig, *, rngs: nnx.Rngs):
        self.norm = NormScale(cfg.width)
        self.w_in = nnx.Linear(cfg.width, cfg.mlp, use_bias=False, rngs=rngs)
        self.w_out = nnx.Linear(cfg.mlp, cfg.width, use_bias=False, rngs=rngs)

    def __call__(self, h):
        return h + self.w_out(nnx.gelu(self.w_in(self.norm(h))))


def layer_keep(tokens, depth: int) -> jax.Array:
    """Which layers run, from the batch alone (so every device agrees): ``bool [depth]``,
    ``(tokens.sum() + arange(depth)) % 3 != 0`` (about a third of the layers skipped)."""
    return (jnp.sum(tokens) + jnp.arange(depth)) % 3 != 0


def _identity(h):
    return h


class LayerDropMLP(_LM):
    """Blocks of ``MLPBlock`` (``nnx.Linear`` in/out, an RMSNorm scale), each run as
    ``lax.cond(keep[l], block, identity, h)`` with ``keep = layer_keep(tokens, L)``.

    ``loop="python"``: an ``nnx.List`` of blocks and a Python loop; ``"scan"``: the blocks
    created stacked (``nnx.split_rngs`` + ``nnx.vmap``) and run by ``nnx.scan`` over
    ``(blocks, keep)`` with the cond inside the body.
    """

    LOOPS = ("python", "scan")

    def __init__(self, cfg: StackConfig, *, loop: str = "python", rngs: nnx.Rngs):
        self._frame(cfg, _check_loop("LayerDropMLP", loop, self.LOOPS), rngs)
        if loop == "scan":
            self.blocks = _stacked(MLPBlock, cfg, rngs)
        else:
            self.blocks = nnx.List([MLPBlock(cfg, rngs=rngs) for _ in range(cfg.depth)])

    def blocks_forward(self, h, tokens):
        keep = layer_keep(tokens, self.depth)
        if self.loop == "scan":

            def step(h, block, k):
                return jax.lax.cond(k, block, _identity, h)

            return nnx.scan(step, in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)(h, self.blocks, keep)
        for l, block in enumerate(self.blocks):
            h = jax.lax.cond(keep[l], block, _identity, h)
        return h


# --------------------------------------------------------------------------------------------
# 3. LoRAMLP: nnx.LoRA around nnx.Linear bases
# --------------------------------------------------------------------------------------------


class LoRABlock(nnx.Module):
    """``h + w_out(gelu(w_in(rmsnorm(h))))`` where ``w_in``/``w_out`` are
    ``nnx.LoRA(in, rank, out, base_module=nnx.Linear(in, out, use_bias=False))``: the base
    kernel an ``nnx.Param`` at ``w_in/base_module/kernel``, the adapters ``lora_a [in, r]`` and
    ``lora_b [r, out]`` ``nnx.LoRAParam`` s (``lora_b`` zeros, as nnx.LoRA initialises it)."""

    def __init__(self, cfg: StackConfig, *, rngs: nnx.Rngs):
        D, F, r = cfg.width, cfg.mlp, cfg.rank
        self.norm = NormScale(D)
        self.w_in = nnx.LoRA(D, r, F, base_module=nnx.Linear(D, F, use_bias=False, rngs=rngs), rngs=rngs)
        self.w_out = nnx.LoRA(F, r, D, base_module=nnx.Linear(F, D, use_bias=False, rngs=rngs), rngs=rngs)

    def __call__(self, h):
        return h + self.w_out(nnx.gelu(self.w_in(self.norm(h))))


class _BlockListLM(_LM):
    """An LM of ``cfg.depth`` blocks of ``BLOCK``: an ``nnx.List`` run by a Python loop
    (``loop="python"``) or stacked by ``nnx.vmap`` and run by ``nnx.scan`` (``"scan"``)."""

    LOOPS = ("python", "scan")
    BLOCK: type = None

    def __init__(self, cfg: StackConfig, *, loop: str = "python", rngs: nnx.Rngs):
        self._frame(cfg, _check_loop(type(self).__name__, loop, self.LOOPS), rngs)
        if loop == "scan":
            self.blocks = _stacked(self.BLOCK, cfg, rngs)
        else:
            self.blocks = nnx.List([self.BLOCK(cfg, rngs=rngs) for _ in range(cfg.depth)])

    def blocks_forward(self, h, tokens):
        if self.loop == "scan":
            return nnx.scan(lambda h, block: block(h), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(h, self.blocks)
        for block in self.blocks:
            h = block(h)
        return h


class LoRAMLP(_BlockListLM):
    """Blocks of ``LoRABlock``, meant to be trained with ``trainable=nnx.LoRAParam`` (only the
    adapters; the base kernels, norms, embedding and head are ``nnx.Param`` and stay as they
    are). ``loop="python"``: an ``nnx.List`` and a Python loop; ``"scan"``: blocks created
    stacked by ``nnx.vmap`` (``nnx.LoRA`` stacks: every variable gains a leading layer axis)
    and run by ``nnx.scan``."""

    BLOCK = LoRABlock


# --------------------------------------------------------------------------------------------
# 4. CustomFrozenMLP: base kernels in a custom nnx.Variable, Param adapters
# --------------------------------------------------------------------------------------------


class FrozenWeight(nnx.Variable):
    """A weight that is not an ``nnx.Param``: ``nnx.state(model, nnx.Param)`` leaves it out, so
    a step that differentiates only the Params keeps it fixed."""


class FrozenAdapterLinear(nnx.Module):
    """``y = x @ base + (x @ a) @ b``: ``base [in, out]`` a ``FrozenWeight``, ``a [in, r]``
    (normal) and ``b [r, out]`` (zeros) ``nnx.Param`` s."""

    def __init__(self, in_features: int, out_features: int, rank: int, *, rngs: nnx.Rngs):
        self.base = FrozenWeight(_lecun(rngs.params(), (in_features, out_features)))
        self.a = nnx.Param(_lecun(rngs.params(), (in_features, rank)))
        self.b = nnx.Param(jnp.zeros((rank, out_features), jnp.float32))

    def __call__(self, x):
        return x @ self.base[...] + (x @ self.a[...]) @ self.b[...]


class FrozenBlock(nnx.Module):
    """``h + w_out(gelu(w_in(rmsnorm(h))))`` with ``FrozenAdapterLinear`` projections."""

    def __init__(self, cfg: StackConfig, *, rngs: nnx.Rngs):
        self.norm = NormScale(cfg.width)
        self.w_in = FrozenAdapterLinear(cfg.width, cfg.mlp, cfg.rank, rngs=rngs)
        self.w_out = FrozenAdapterLinear(cfg.mlp, cfg.width, cfg.rank, rngs=rngs)

    def __call__(self, h):
        return h + self.w_out(nnx.gelu(self.w_in(self.norm(h))))


class CustomFrozenMLP(_BlockListLM):
    """Blocks of ``FrozenBlock``: the projections' base kernels are ``FrozenWeight`` variables
    (outside ``nnx.Param``), only the adapters, norms, embedding and head are Params.
    ``loop="python"``: an ``nnx.List`` and a Python loop; ``"scan"``: blocks created stacked by
    ``nnx.vmap`` and run by ``nnx.scan``."""

    BLOCK = FrozenBlock


# --------------------------------------------------------------------------------------------
# 5. SharedBlockMLP: one block applied depth times
# --------------------------------------------------------------------------------------------


class SharedBlockMLP(_LM):
    """One ``MLPBlock`` (``nnx.Linear`` in/out, an RMSNorm scale) applied ``depth`` times:
    ``loop="fori"`` (``lax.fori_loop(0, L, ...)`` with static bounds; the block's weights are
    loop-invariant) or ``"python"``. The parameter count does not grow with depth."""

    LOOPS = ("fori", "python")

    def __init__(self, cfg: StackConfig, *, loop: str = "fori", rngs: nnx.Rngs):
        self._frame(cfg, _check_loop("SharedBlockMLP", loop, self.LOOPS), rngs)
        self.block = MLPBlock(cfg, rngs=rngs)

    def blocks_forward(self, h, tokens):
        if self.loop == "fori":
            return jax.lax.fori_loop(0, self.depth, lambda i, h: self.block(h), h)
        for _ in range(self.depth):
            h = self.block(h)
        return h


# --------------------------------------------------------------------------------------------
# Construction, loss, data
# --------------------------------------------------------------------------------------------

MODELS: dict[str, type[_LM]] = {
    "stacked": StackedMLP,
    "layerdrop": LayerDropMLP,
    "lora": LoRAMLP,
    "frozen": CustomFrozenMLP,
    "shared": SharedBlockMLP,
}


def loops(name: str) -> tuple[str, ...]:
    """The ``loop=`` values model ``name`` takes."""
    return _model_class(name).LOOPS


def _model_class(name: str) -> type[_LM]:
    if name not in MODELS:
        raise ValueError(f"name must be one of {tuple(MODELS)}, got name={name!r}")
    return MODELS[name]


def build(name: str, cfg: StackConfig | None = None, seed: int = 0, *, loop: str | None = None) -> nnx.Module:
    """Model ``name`` (a key of ``MODELS``) of sizes ``cfg`` with values from
    ``nnx.Rngs(seed)`` (deterministic); ``loop`` defaults to the class's first form. Wrap in
    ``nnx.eval_shape(lambda: build(...))`` for the structure alone."""
    cls = _model_class(name)
    cfg = StackConfig() if cfg is None else cfg
    loop = cls.LOOPS[0] if loop is None else loop
    return cls(cfg, loop=loop, rngs=nnx.Rngs(seed))


def loss_fn(model, batch) -> jax.Array:
    """Mean token cross entropy; ``batch = (tokens [B, T] int32, targets [B, T] int32)``."""
    tokens, targets = batch
    logits = model(tokens).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1))


def make_batch(cfg: StackConfig, batch: int, seq: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens (numpy int32): ``tokens [batch, seq]`` and ``targets`` (the next tokens)."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    drawn = np.random.default_rng(seed).integers(0, cfg.vocab, (batch, seq + 1)).astype(np.int32)
    return drawn[:, :-1], drawn[:, 1:]
