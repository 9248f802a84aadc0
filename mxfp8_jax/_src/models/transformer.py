"""A small Llama-style decoder LM in plain Flax NNX, and a synthetic sequence task it can learn.

The model is written the way Flax users write one, with nothing specific to this package:
``nnx.Embed`` tokens, blocks of ``nnx.RMSNorm`` -> causal multi-head attention with rotary
position embeddings -> ``nnx.RMSNorm`` -> SwiGLU MLP (all projections ``nnx.Linear`` without
bias), the blocks created stacked with ``nnx.vmap`` and run with ``nnx.scan`` (each iteration
under ``nnx.remat``; ``layer_loop="python"``: an ``nnx.List`` of blocks run by a Python loop,
each block under ``nnx.remat``; ``"fori"``: the stacked blocks picked by a ``lax.fori_loop``'s
counter, ``blocks[i]`` of their split state), a final RMSNorm and an ``nnx.Linear`` LM head. ``FSDP`` keeps every
projection (and the head, when the vocabulary is a multiple of 32) as MXFP8 units.

With ``norm="mxfp8"`` each block's two norms are MXFP8 RMSNorm + quantize ops whose output
feeds the next GEMMs (``mxfp8_gemm.gemm_operand``: read as its dequantized value by GEMMs on
dequantized weights, as its planes by ``FSDP(gemm="mxfp8")``'s MXFP8 GEMMs), and the residual
stream is bf16. ``gemm="mxfp8"`` asks the norms for the columnwise planes too, the wgrad's x.
Run by ``FSDP(..., tp_axis=cfg.tp_axis)`` on a 2-D ``(fsdp, tp)`` mesh, the
blocks are sequence- and tensor-parallel (Megatron-style): activations between blocks are
split along the sequence over ``tp``; each norm is ``allgather_rmsnorm_quant`` over ``tp``
(``norm_path="fused"``; ``"unfused"``: ``lax.all_gather`` + ``rmsnorm_quant``), whose
quantized output feeds the column-parallel q/k/v and gate/up GEMMs (heads and MLP columns split
over ``tp``) and whose residual output carries the skip connection; the row-parallel o and
down GEMMs end in a reduce-scatter back to sequence shards. Without a bound tp axis (one
device, or FSDP alone) the same model runs the local ``rmsnorm_quant``: the same numbers up to
GEMM summation order.

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
from jax import lax

from mxfp8_jax._src.core import checks, spmd
from mxfp8_jax._src.fsdp.flax_layers import tensor_parallel
from mxfp8_jax._src.ops.fused import allgather_rmsnorm_quant_local
from mxfp8_jax._src.ops.mxfp8_gemm import GEMMS, gemm_operand
from mxfp8_jax._src.ops.rmsnorm import rmsnorm_quant

NORMS = ("nnx", "mxfp8")
NORM_PATHS = ("fused", "unfused")
LAYER_LOOPS = ("scan", "python", "fori")


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
    norm: str = "nnx"  # "mxfp8": the blocks' norms are RMSNorm + MXFP8 quantize ops
    tp_axis: str = "tp"  # the mesh axis of sequence/tensor parallelism, when it is bound
    norm_path: str = "fused"  # under tp: "fused" allgather_rmsnorm_quant, or "unfused"
    strategy: str = "auto"  # the fused op's strategy
    gemm: str = "dequantized"  # "mxfp8": the norms' columnwise planes too (FSDP(gemm="mxfp8")'s
    # wgrad), where a device's gathered rows are whole 32-row blocks
    layer_loop: str = "scan"  # "python": the blocks an nnx.List run by a Python loop; "fori": the
    # stacked blocks picked by a lax.fori_loop's counter

    def __post_init__(self):
        for name in ("vocab", "hidden", "heads", "head_dim", "mlp", "layers"):
            object.__setattr__(self, name, checks.positive_int(getattr(self, name), f"TransformerConfig.{name}"))
        if self.head_dim % 2:
            raise ValueError(f"TransformerConfig.head_dim={self.head_dim} must be even (rotary pairs)")
        if self.norm not in NORMS:
            raise ValueError(f"TransformerConfig.norm={self.norm!r} must be one of {NORMS}")
        if self.norm_path not in NORM_PATHS:
            raise ValueError(f"TransformerConfig.norm_path={self.norm_path!r} must be one of {NORM_PATHS}")
        if self.gemm not in GEMMS:
            raise ValueError(f"TransformerConfig.gemm={self.gemm!r} must be one of {GEMMS}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"TransformerConfig.layer_loop={self.layer_loop!r} must be one of {LAYER_LOOPS}")


def tp_size(axis: str) -> int:
    """The size of mesh axis ``axis`` when the caller runs inside a ``shard_map`` that binds it
    (an FSDP step with ``tp_axis``), else 1."""
    try:
        return int(lax.axis_size(axis))
    except NameError:  # unbound: no tensor parallelism here
        return 1


def rope(x: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding of ``x [batch, seq, heads, head_dim]`` (pairs of halves).

    Args:
      x: ``[batch, seq, heads, head_dim]``, ``head_dim`` even; a token's position is its index
        along ``seq``. Element ``i`` of the first half pairs with element ``i`` of the second.
      base: the rotary base: pair ``i`` at position ``t`` turns by ``t * base ** (-2 * i / head_dim)``.

    Returns:
      The rotated ``x``, same shape and dtype (computed in fp32).
    """
    seq, dim = x.shape[1], x.shape[-1]
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float32) / dim)
    angle = np.arange(seq, dtype=np.float32)[:, None] * inv[None, :]  # [seq, dim/2]
    cos, sin = jnp.asarray(np.cos(angle))[None, :, None, :], jnp.asarray(np.sin(angle))[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention with rotary embeddings; softmax in fp32."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        width = cfg.heads * cfg.head_dim
        self.q, self.k, self.v = (_linear(cfg, cfg.hidden, width, "column", rngs) for _ in range(3))
        self.o = _linear(cfg, width, cfg.hidden, "row", rngs)
        self.heads, self.head_dim, self.base = cfg.heads, cfg.head_dim, cfg.rope_base

    def __call__(self, x):
        """``x [batch, seq, hidden]`` -> ``[batch, seq, hidden]``; inside a tensor-parallel step
        this device's heads only, the output a partial sum over the tp axis."""
        b, s, _ = x.shape
        split = lambda t: t.reshape(b, s, -1, self.head_dim)  # the heads of this tp slice
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
        self.gate = _linear(cfg, cfg.hidden, cfg.mlp, "column", rngs)
        self.up = _linear(cfg, cfg.hidden, cfg.mlp, "column", rngs)
        self.down = _linear(cfg, cfg.mlp, cfg.hidden, "row", rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def _linear(cfg: TransformerConfig, i: int, o: int, role: str, rngs: nnx.Rngs) -> nnx.Linear:
    """A bias-free projection marked column- or row-parallel (ignored without a tp axis); with
    MXFP8 norms the row-parallel ones return fp32 partial sums (reduced over tp, then rounded)."""
    out = jnp.float32 if cfg.norm == "mxfp8" and role == "row" else None
    layer = nnx.Linear(i, o, use_bias=False, dtype=jnp.dtype(cfg.dtype), preferred_element_type=out, rngs=rngs)
    return tensor_parallel(layer, role)


class Block(nnx.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.attn_norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.eps, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.eps, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x):
        if self.cfg.norm == "mxfp8":
            act, skip = self._norm_quant(self.attn_norm, x)
            x = skip + self._reduce(self.attn(act))
            act, skip = self._norm_quant(self.mlp_norm, x)
            return skip + self._reduce(self.mlp(act))
        x = x + self.attn(self.attn_norm(x)).astype(x.dtype)
        return x + self.mlp(self.mlp_norm(x)).astype(x.dtype)

    def _norm_quant(self, norm: nnx.RMSNorm, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [batch, seq, hidden]`` bf16 (this device's sequence shard under tp) -> the MXFP8
        RMSNorm of the whole sequence ``[batch, tp * seq, hidden]`` as the next GEMMs' operand
        (``gemm_operand``: its gradient through ``normed``) and the skip connection
        ``[batch, seq, hidden]``."""
        cfg, tp = self.cfg, tp_size(self.cfg.tp_axis)
        b, s, h = x.shape
        rows = x.reshape(b * s, h).astype(jnp.bfloat16)
        gamma = norm.scale.get_value().astype(jnp.bfloat16)
        # columnwise blocks need whole 32-row groups of each tp rank's rows; otherwise each GEMM
        # quantizes ``normed`` along its tokens itself (zero-padded to 32)
        col = cfg.gemm == "mxfp8" and (b * s) % 32 == 0
        if tp == 1:
            normed, q, scales, *planes = rmsnorm_quant(rows, gamma, eps=cfg.eps, columnwise=col)
            act = gemm_operand(*(a.reshape(b, s, -1) for a in (normed, q, scales)), tuple(planes) or None)
            return act, rows.reshape(b, s, h)
        # the gathered rows [tp, batch * seq]: grouped by tp rank, each rank's rows as sharded
        # over the other mesh axes (by batch), which flat [tp * batch * seq] rows would interleave
        if cfg.norm_path == "fused":
            normed, q, scales, residual, *planes = allgather_rmsnorm_quant_local(
                rows, gamma, axis_name=cfg.tp_axis, eps=cfg.eps, strategy=cfg.strategy, columnwise=col, grouped=True
            )
        else:

            def unfused(r, g):  # this device's rows -> the gathered rows' planes, [tp, rows, ...]
                gathered = lax.all_gather(r, cfg.tp_axis)
                out = rmsnorm_quant(gathered.reshape(-1, h), g, eps=cfg.eps, columnwise=col)
                return (*(a.reshape(tp, -1, a.shape[-1]) for a in out), gathered)

            normed, q, scales, *planes, residual = spmd.by_row_shards(unfused, rows, gamma, block=32 if col else 1)
        # the whole sequences are [batch, tp * seq]; the columnwise planes stay in gathered order
        # [tp, batch * seq] (their 32-row blocks), and say so
        seqs = lambda a: a.reshape(tp, b, s, -1).transpose(1, 0, 2, 3).reshape(b, tp * s, -1)
        order = (tp, b, s) if planes else None
        act = gemm_operand(seqs(normed), seqs(q), seqs(scales), tuple(planes) or None, order=order)
        skip = lax.dynamic_index_in_dim(residual, lax.axis_index(cfg.tp_axis), keepdims=False).reshape(b, s, h)
        return act, skip

    def _reduce(self, y: jax.Array) -> jax.Array:
        """A row-parallel output ``[batch, tp * seq, hidden]`` (fp32 partial sums under tp) ->
        this device's sequence shard of the sum, bf16: one reduce-scatter over tp."""
        tp = tp_size(self.cfg.tp_axis)
        if tp > 1:
            b, s, h = y.shape
            y = y.reshape(b, tp, s // tp, h).transpose(1, 0, 2, 3)
            y = lax.psum_scatter(y, self.cfg.tp_axis, scatter_dimension=0, tiled=False)
        return y.astype(jnp.bfloat16)


class TransformerLM(nnx.Module):
    """Decoder-only LM: ``tokens [batch, seq] int32 -> logits [batch, seq, vocab] fp32``."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.hidden, rngs=rngs)
        if cfg.layer_loop == "python":
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        else:

            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def blocks(rngs):
                return Block(cfg, rngs=rngs)

            self.blocks = blocks(rngs)
        self.norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.eps, rngs=rngs)
        self.head = nnx.Linear(cfg.hidden, cfg.vocab, use_bias=False, dtype=jnp.dtype(cfg.dtype), rngs=rngs)

    def __call__(self, tokens):
        """``tokens [batch, seq]`` (under tp: this device's sequence shard) -> fp32 logits."""
        x = self.embed(tokens)
        if self.cfg.norm == "mxfp8":
            x = x.astype(jnp.bfloat16)

        def layer(x, block):
            return block(x)

        if self.cfg.remat:
            layer = nnx.remat(layer)
        if self.cfg.layer_loop == "python":
            for block in self.blocks:
                x = layer(x, block)
        elif self.cfg.layer_loop == "fori":
            graph, stacked = nnx.split(self.blocks)

            def trip(i, x):
                return layer(x, nnx.merge(graph, jax.tree.map(lambda a: a[i], stacked)))

            x = lax.fori_loop(0, self.cfg.layers, trip, x)
        else:
            x = nnx.scan(layer, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        return self.head(self.norm(x)).astype(jnp.float32)


def init_transformer(cfg: TransformerConfig, seed: int = 0) -> TransformerLM:
    """The model with its parameters initialised in one compiled program (flax's initialisers:
    LeCun-normal projections, normal embeddings, unit norm scales).

    Args:
      cfg: the model's sizes and options.
      seed: the seed of the ``nnx.Rngs`` the initialisers draw from.

    Returns:
      A ``TransformerLM`` for ``cfg``.
    """
    abstract = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(seed)))
    graphdef, _ = nnx.split(abstract)
    state = jax.jit(lambda: nnx.state(TransformerLM(cfg, rngs=nnx.Rngs(seed))))()
    return nnx.merge(graphdef, state)


def next_token_loss(model: TransformerLM, batch) -> jax.Array:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``, for
    ``batch = tokens [batch, seq + 1]``, or ``batch = (inputs, targets)`` already shifted
    (``next_token_pairs``: what a sequence-split step needs).

    Args:
      model: the LM, ``tokens [batch, seq] -> logits [batch, seq, vocab]``.
      batch: int tokens ``[batch, seq + 1]``, or a tuple ``(inputs, targets)`` of int tokens, each
        ``[batch, seq]``.

    Returns:
      The scalar loss: the negative log-likelihood of the targets, averaged over every position.
    """
    inputs, target = batch if isinstance(batch, tuple) else (batch[:, :-1], batch[:, 1:])
    logp = jax.nn.log_softmax(model(inputs), axis=-1)
    return -jnp.take_along_axis(logp, target[..., None], axis=-1).mean()


def next_token_pairs(tokens) -> tuple[np.ndarray, np.ndarray]:
    """``tokens [batch, seq + 1]`` -> ``(inputs, targets)``, each ``[batch, seq]``.

    Args:
      tokens: ``[batch, seq + 1]``, anything ``np.asarray`` takes.

    Returns:
      ``(tokens[:, :-1], tokens[:, 1:])`` as NumPy arrays (views of ``np.asarray(tokens)``).
    """
    tokens = np.asarray(tokens)
    return tokens[:, :-1], tokens[:, 1:]


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
        """``steps`` batches of sequences, the same ones for the same ``seed``.

        Args:
          steps: how many batches to yield.
          batch: sequences per batch.

        Returns:
          An iterator of int32 arrays ``[batch, seq_len]``: each sequence's first two tokens
          uniform in ``[0, vocab)``, then ``x[t] = perm[x[t - 2]]``.
        """
        rng = np.random.default_rng(self.seed)
        for _ in range(steps):
            x = np.empty((batch, self.seq_len), np.int32)
            x[:, :2] = rng.integers(0, self.vocab, (batch, 2))
            for t in range(2, self.seq_len):
                x[:, t] = self.perm[x[:, t - 2]]
            yield x
