"""A small Llama-style decoder LM in plain Flax NNX, and a synthetic sequence task it can learn.

The model is written the way Flax users write one, with nothing specific to this package:
``nnx.Embed`` tokens, blocks of ``nnx.RMSNorm`` -> causal multi-head attention with rotary
position embeddings -> ``nnx.RMSNorm`` -> SwiGLU MLP (all projections ``nnx.Linear`` without
bias), the blocks created stacked with ``nnx.vmap`` and run with ``nnx.scan`` (each iteration
under ``nnx.remat``), a final RMSNorm and an ``nnx.Linear`` LM head. ``FSDP`` keeps every
projection (and the head, when the vocabulary is a multiple of 32) as MXFP8 units.

The task (``SequenceTask``): each sequence starts with two random tokens and continues by a
fixed random permutation of the vocabulary applied to the token two places back,
``x[t+1] = perm[x[t-1]]``: two interleaved chains. Predicting the next token needs attention to
the previous position and a learned lookup; only the second token is unpredictable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mxfp8_jax._src import checks


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes of the decoder; every projection dimension is a multiple of 32 (MXFP8 blocks)."""

    vocab: int = 128
    hidden: int = 128
    heads: int = 4
    head_dim: int = 32
    mlp: int = 256
    layers: int = 4
    rope_base: float = 10_000.0
    eps: float = 1e-6
    remat: bool = True
    dtype: str = "bfloat16"  # compute dtype of the projections and attention

    def __post_init__(self):
        for name in ("vocab", "hidden", "heads", "head_dim", "mlp", "layers"):
            object.__setattr__(self, name, checks.positive_int(getattr(self, name), f"TransformerConfig.{name}"))
        if self.head_dim % 2:
            raise ValueError(f"TransformerConfig.head_dim={self.head_dim} must be even (rotary pairs)")


def rope(x: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding of ``x [batch, seq, heads, head_dim]`` (pairs of halves)."""
    seq, dim = x.shape[1], x.shape[-1]
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float32) / dim)
    angle = np.arange(seq, dtype=np.float32)[:, None] * inv[None, :]  # [seq, dim/2]
    cos, sin = jnp.asarray(np.cos(angle))[None, :, None, :], jnp.asarray(np.sin(angle))[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention with rotary embeddings; softmax in fp32."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        width, dtype = cfg.heads * cfg.head_dim, jnp.dtype(cfg.dtype)
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        self.q, self.k, self.v = linear(cfg.hidden, width), linear(cfg.hidden, width), linear(cfg.hidden, width)
        self.o = linear(width, cfg.hidden)
        self.heads, self.head_dim, self.base = cfg.heads, cfg.head_dim, cfg.rope_base

    def __call__(self, x):
        b, s, _ = x.shape
        split = lambda t: t.reshape(b, s, self.heads, self.head_dim)
        q, k, v = rope(split(self.q(x)), self.base), rope(split(self.k(x)), self.base), split(self.v(x))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        logits = logits / np.sqrt(self.head_dim).astype(np.float32)
        causal = np.tril(np.ones((s, s), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, -1)
        return self.o(out)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        dtype = jnp.dtype(cfg.dtype)
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        self.gate, self.up, self.down = (
            linear(cfg.hidden, cfg.mlp),
            linear(cfg.hidden, cfg.mlp),
            linear(cfg.mlp, cfg.hidden),
        )

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.eps, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.eps, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x)).astype(x.dtype)
        return x + self.mlp(self.mlp_norm(x)).astype(x.dtype)


class TransformerLM(nnx.Module):
    """Decoder-only LM: ``tokens [batch, seq] int32 -> logits [batch, seq, vocab] fp32``."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.hidden, rngs=rngs)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(cfg, rngs=rngs)

        self.blocks = blocks(rngs)
        self.norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.eps, rngs=rngs)
        self.head = nnx.Linear(cfg.hidden, cfg.vocab, use_bias=False, dtype=jnp.dtype(cfg.dtype), rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)

        def layer(x, block):
            return block(x)

        if self.cfg.remat:
            layer = nnx.remat(layer)
        x = nnx.scan(layer, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        return self.head(self.norm(x)).astype(jnp.float32)


def init_transformer(cfg: TransformerConfig, seed: int = 0) -> TransformerLM:
    """The model with its parameters initialised in one compiled program (flax's initialisers:
    LeCun-normal projections, normal embeddings, unit norm scales)."""
    abstract = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(seed)))
    graphdef, _ = nnx.split(abstract)
    state = jax.jit(lambda: nnx.state(TransformerLM(cfg, rngs=nnx.Rngs(seed))))()
    return nnx.merge(graphdef, state)


def next_token_loss(model: TransformerLM, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``."""
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = tokens[:, 1:]
    return -jnp.take_along_axis(logp, target[..., None], axis=-1).mean()


class SequenceTask:
    """Batches of ``[batch, seq_len]`` int32 sequences with ``x[t+1] = perm[x[t-1]]``.

    ``perm`` is a fixed random permutation of ``range(vocab)`` drawn from ``seed``; each
    sequence's first two tokens are uniform. The best achievable mean loss is
    ``log(vocab) / (seq_len - 1)`` (only the second token is a guess).
    """

    def __init__(self, vocab: int, seq_len: int, seed: int = 0) -> None:
        if seq_len < 3:
            raise ValueError(f"seq_len={seq_len} must be at least 3")
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.perm = np.random.default_rng(seed + 7_919).permutation(vocab).astype(np.int32)

    @property
    def loss_floor(self) -> float:
        return float(np.log(self.vocab) / (self.seq_len - 1))

    def batches(self, steps: int, batch: int) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        for _ in range(steps):
            x = np.empty((batch, self.seq_len), np.int32)
            x[:, :2] = rng.integers(0, self.vocab, (batch, 2))
            for t in range(2, self.seq_len):
                x[:, t] = self.perm[x[:, t - 2]]
            yield x
