"""Small Flax NNX language models written the ways public Flax NNX code writes them.

Each style is a decoder LM (int32 tokens ``[batch, seq]`` -> fp32 logits ``[batch, seq, vocab]``,
trained with next-token cross entropy) built only from plain Flax NNX and JAX, in the idiom of
a family of public code bases:

- ``"mha"``: stock ``nnx`` layers (``nnx.Embed``, ``nnx.LayerNorm``, ``nnx.MultiHeadAttention``,
  ``nnx.Linear``), blocks stacked by ``nnx.vmap`` and run by ``nnx.scan``, as in Flax's guides.
- ``"gemma"``: the Gemma reference decoders: ``nnx.Einsum`` projections with multi-axis kernels
  (a stacked k/v kernel), a gated MLP kept as raw parameters, a tied embedding.
- ``"maxtext"``: a ``DenseGeneral`` layer whose kernel is ``(*in_features, *out_features)``
  applied with ``lax.dot_general`` over several trailing axes, as large-scale JAX trainers do.
- ``"einsum"``: hand-written layers holding ``nnx.Param`` arrays contracted by ``jnp.einsum`` or
  ``@``, an embedding table read by indexing, an untied head matrix.
- ``"moe"``: a Switch-Transformer-style top-1 mixture of experts with stacked expert weights and
  dense one-hot dispatch/combine tensors.
- ``"dropout"``: ``nnx.Dropout`` (and attention dropout) layers that keep their own RNG streams.

The models themselves know nothing of any training library. ``build`` gives one with values
drawn on the host by numpy (no compilation, whatever the depth), ``abstract`` the same structure
with ``jax.ShapeDtypeStruct`` values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

STYLES: tuple[str, ...] = ("mha", "gemma", "maxtext", "einsum", "moe", "dropout")

_normal = nnx.initializers.normal(0.02)
_lecun = nnx.initializers.lecun_normal()


@dataclasses.dataclass(frozen=True)
class StyleConfig:
    """Sizes of a style model. ``experts``/``capacity`` are read by ``"moe"`` only (``capacity``:
    buffer slots per expert for each sequence of the batch), ``dropout`` by ``"dropout"`` only,
    ``remat`` by all: ``nnx.remat`` around each scan iteration, or around each block call of
    the Python-loop styles."""

    vocab: int = 512
    width: int = 256
    heads: int = 4
    head_dim: int = 64
    mlp: int = 512
    depth: int = 4
    experts: int = 4
    capacity: int = 8
    dropout: float = 0.1
    remat: bool = False

    def __post_init__(self):
        for name in ("vocab", "width", "heads", "head_dim", "mlp", "depth", "experts", "capacity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"StyleConfig.{name} must be a positive int, got {v!r}")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float, np.floating)) or not 0.0 <= d < 1.0:
            raise ValueError(f"StyleConfig.dropout must be a float in [0, 1), got {d!r}")
        if not isinstance(self.remat, (bool, np.bool_)):
            raise ValueError(f"StyleConfig.remat must be a bool, got {self.remat!r}")


def _stacked(block: type, cfg: StyleConfig, rngs: nnx.Rngs) -> nnx.Module:
    """``cfg.depth`` blocks created at once, stacked (``nnx.split_rngs`` + ``nnx.vmap``): one
    module whose parameters carry a leading layer axis."""

    @nnx.split_rngs(splits=cfg.depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs):
        return block(cfg, rngs=rngs)

    return create(rngs)


def _scanned(blocks: nnx.Module, x, remat: bool, *args):
    """``x`` through the stacked ``blocks`` one layer per ``nnx.scan`` iteration (each under
    ``nnx.remat`` when ``remat``); ``args`` are passed to every block unchanged."""

    def step(x, block):
        return block(x, *args)

    if remat:
        step = nnx.remat(step)
    return nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, blocks)


def _call(layer, *args):
    """``layer(*args)``: what a Python loop over blocks calls (under ``nnx.remat`` when asked)."""
    return layer(*args)


def _causal(t: int) -> jax.Array:
    return jnp.tril(jnp.ones((t, t), dtype=bool))


# --------------------------------------------------------------------------------------------
# 1. "mha": stock nnx layers, vmap-created blocks run by scan
# --------------------------------------------------------------------------------------------


class MHABlock(nnx.Module):
    """Pre-LN transformer block made only of stock ``nnx`` layers."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.heads,
            in_features=cfg.width,
            qkv_features=cfg.heads * cfg.head_dim,
            decode=False,
            rngs=rngs,
        )
        self.ln2 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.fc1 = nnx.Linear(cfg.width, cfg.mlp, rngs=rngs)
        self.fc2 = nnx.Linear(cfg.mlp, cfg.width, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class MHAModel(nnx.Module):
    """The layer-scan pattern of Flax's own NNX guides and examples: ``nnx.Embed`` tokens, blocks
    of ``nnx.LayerNorm`` -> causal ``nnx.MultiHeadAttention`` -> ``nnx.LayerNorm`` -> two
    ``nnx.Linear`` with gelu, created stacked by ``nnx.split_rngs`` + ``nnx.vmap`` and run by
    ``nnx.scan`` (``nnx.remat`` per iteration when ``cfg.remat``); final LayerNorm and an untied
    ``nnx.Linear`` head."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.blocks = _stacked(MHABlock, cfg, rngs)
        self.final_norm = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.head = nnx.Linear(cfg.width, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = _scanned(self.blocks, x, self.remat, nnx.make_causal_mask(tokens))
        return self.head(self.final_norm(x))


# --------------------------------------------------------------------------------------------
# 2. "gemma": nnx.Einsum projections, raw-parameter gated MLP, tied embedding, Python loop
# --------------------------------------------------------------------------------------------


class GemmaRMSNorm(nnx.Module):
    """RMS norm with its own ``scale`` parameter (multiplied in directly)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + self.eps) * self.scale[...]


class GemmaAttention(nnx.Module):
    """Attention with ``nnx.Einsum`` projections: query kernel ``[N, D, H]``, one stacked
    key/value kernel ``[2, K, D, H]``, output kernel ``[N, H, D]`` (here ``K = N``)."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        n, d, h = cfg.heads, cfg.width, cfg.head_dim
        self.head_dim = h
        self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (n, d, h), kernel_init=_lecun, rngs=rngs)
        self.kv_einsum = nnx.Einsum("BSD,CKDH->CBSKH", (2, n, d, h), kernel_init=_lecun, rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (n, h, d), kernel_init=_lecun, rngs=rngs)

    def __call__(self, x):
        q = self.q_einsum(x) * self.head_dim**-0.5
        k, v = self.kv_einsum(x)
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k)
        t = x.shape[1]
        logits = jnp.where(_causal(t), logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        encoded = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
        return self.attn_vec_einsum(encoded)


class GemmaMLP(nnx.Module):
    """Gated gelu MLP kept as two raw parameters: ``gating_einsum [2, F, D]`` (gate and up
    projections stacked) contracted by ``jnp.einsum``, ``linear [F, D]`` applied by ``jnp.dot``."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.gating_einsum = nnx.Param(_normal(rngs.params(), (2, cfg.mlp, cfg.width)))
        self.linear = nnx.Param(_normal(rngs.params(), (cfg.mlp, cfg.width)))

    def __call__(self, x):
        gates = jnp.einsum("...D,CFD->...CF", x, self.gating_einsum[...])
        activations = nnx.gelu(gates[..., 0, :]) * gates[..., 1, :]
        return jnp.dot(activations, self.linear[...])


class GemmaBlock(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.pre_attention_norm = GemmaRMSNorm(cfg.width)
        self.attn = GemmaAttention(cfg, rngs=rngs)
        self.pre_ffw_norm = GemmaRMSNorm(cfg.width)
        self.mlp = GemmaMLP(cfg, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.pre_attention_norm(x))
        return x + self.mlp(self.pre_ffw_norm(x))


class GemmaModel(nnx.Module):
    """A decoder in the manner of the public Gemma reference implementations: ``nnx.Einsum``
    attention projections with multi-axis (and one stacked k/v) kernels, a gated MLP of raw
    ``nnx.Param`` arrays, custom RMS norms, blocks in an ``nnx.List`` run by a Python loop. The
    embedding is tied: one ``nnx.Embed``, read by ``__call__`` (scaled by ``sqrt(width)``) on
    the way in and used by ``attend`` (``x @ table.T``) as the output head. No rotary
    embeddings (kept simple)."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.width, self.remat = cfg.width, cfg.remat
        self.embedder = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.layers = nnx.List([GemmaBlock(cfg, rngs=rngs) for _ in range(cfg.depth)])
        self.final_norm = GemmaRMSNorm(cfg.width)

    def __call__(self, tokens):
        x = self.embedder(tokens) * jnp.sqrt(jnp.float32(self.width))
        call = nnx.remat(_call) if self.remat else _call
        for layer in self.layers:
            x = call(layer, x)
        return self.embedder.attend(self.final_norm(x))


# --------------------------------------------------------------------------------------------
# 3. "maxtext": DenseGeneral everywhere, vmap-created blocks run by scan
# --------------------------------------------------------------------------------------------


def _tuple(x) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Sequence) else (x,)


class DenseGeneral(nnx.Module):
    """A dense layer over several input axes into several output axes: the kernel is one
    ``nnx.Param`` of shape ``(*in_features, *out_features)`` contracted with the input's
    ``axis`` by ``lax.dot_general``."""

    def __init__(self, in_features, out_features, axis=-1, *, rngs: nnx.Rngs):
        self.in_features = _tuple(in_features)
        self.out_features = _tuple(out_features)
        self.axis = _tuple(axis)
        if len(self.axis) != len(self.in_features):
            raise ValueError(f"DenseGeneral: axis {self.axis} does not match in_features {self.in_features}")
        n_in = len(self.in_features)
        init = nnx.initializers.lecun_normal(
            in_axis=tuple(range(n_in)), out_axis=tuple(range(n_in, n_in + len(self.out_features)))
        )
        self.kernel = nnx.Param(init(rngs.params(), self.in_features + self.out_features, jnp.float32))

    def __call__(self, inputs):
        axis = tuple(a % inputs.ndim for a in self.axis)
        kernel = self.kernel[...]
        contract = (axis, tuple(range(len(axis))))
        return jax.lax.dot_general(inputs, kernel, (contract, ((), ())))


class MaxTextAttention(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        nh = (cfg.heads, cfg.head_dim)
        self.query = DenseGeneral(cfg.width, nh, rngs=rngs)
        self.key = DenseGeneral(cfg.width, nh, rngs=rngs)
        self.value = DenseGeneral(cfg.width, nh, rngs=rngs)
        self.out = DenseGeneral(nh, cfg.width, axis=(-2, -1), rngs=rngs)

    def __call__(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        return self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True))


class MaxTextMLP(nnx.Module):
    """SwiGLU with the gate and up projections fused in one ``[D, 2, F]`` kernel."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.wi = DenseGeneral(cfg.width, (2, cfg.mlp), rngs=rngs)
        self.wo = DenseGeneral(cfg.mlp, cfg.width, rngs=rngs)

    def __call__(self, x):
        h = self.wi(x)
        return self.wo(nnx.silu(h[..., 0, :]) * h[..., 1, :])


class MaxTextBlock(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.pre_self_attention_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.self_attention = MaxTextAttention(cfg, rngs=rngs)
        self.post_self_attention_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.mlp = MaxTextMLP(cfg, rngs=rngs)

    def __call__(self, x):
        x = x + self.self_attention(self.pre_self_attention_norm(x))
        return x + self.mlp(self.post_self_attention_norm(x))


class MaxTextModel(nnx.Module):
    """A decoder in the manner of large-scale JAX LLM trainers: every projection a
    ``DenseGeneral`` (query/key/value ``[D, N, H]``, output ``[N, H, D]`` contracted over two
    axes, fused MLP input ``[D, 2, F]``), ``nnx.RMSNorm``, blocks created stacked by ``nnx.vmap``
    and run by ``nnx.scan`` (``nnx.remat`` per iteration when ``cfg.remat``), ``nnx.Embed``
    tokens and an untied ``DenseGeneral`` logits head."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.token_embedder = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.layers = _stacked(MaxTextBlock, cfg, rngs)
        self.decoder_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.logits_dense = DenseGeneral(cfg.width, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        x = _scanned(self.layers, self.token_embedder(tokens), self.remat)
        return self.logits_dense(self.decoder_norm(x))


# --------------------------------------------------------------------------------------------
# 4. "einsum": hand-written nnx.Param layers, jnp.einsum / @, Python loop
# --------------------------------------------------------------------------------------------


class EinsumLinear(nnx.Module):
    """``y = einsum('...i,io->...o', x, weight) + bias``."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True, rngs: nnx.Rngs):
        self.weight = nnx.Param(_lecun(rngs.params(), (in_features, out_features)))
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32)) if use_bias else None

    def __call__(self, x):
        y = jnp.einsum("...i,io->...o", x, self.weight[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class MatmulLinear(nnx.Module):
    """``y = x @ weight`` (no bias)."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(_lecun(rngs.params(), (in_features, out_features)))

    def __call__(self, x):
        return x @ self.weight[...]


class EinsumRMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.weight[...]


class EinsumAttention(nnx.Module):
    """Fused q/k/v weight ``[D, 3, N, H]`` read by one einsum into ``[3, B, T, N, H]``; the
    output projection a ``MatmulLinear`` over the flattened heads."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.wqkv = nnx.Param(_normal(rngs.params(), (cfg.width, 3, cfg.heads, cfg.head_dim)))
        self.o_proj = MatmulLinear(cfg.heads * cfg.head_dim, cfg.width, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = jnp.einsum("btd,dsnh->sbtnh", x, self.wqkv[...])
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(self.head_dim)
        scores = jnp.where(_causal(t), scores, -1e9)
        out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)
        return self.o_proj(out.reshape(b, t, self.heads * self.head_dim))


class EinsumBlock(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = EinsumRMSNorm(cfg.width)
        self.self_attn = EinsumAttention(cfg, rngs=rngs)
        self.post_attention_layernorm = EinsumRMSNorm(cfg.width)
        self.up_proj = EinsumLinear(cfg.width, cfg.mlp, rngs=rngs)
        self.down_proj = EinsumLinear(cfg.mlp, cfg.width, rngs=rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.down_proj(jax.nn.gelu(self.up_proj(self.post_attention_layernorm(x))))


class EinsumModel(nnx.Module):
    """Hand-written layers in the manner of community JAX model zoos: each layer keeps raw
    ``nnx.Param`` arrays and contracts them itself (``jnp.einsum``, and ``x @ w`` in the
    attention output), an embedding table ``nnx.Param [V, D]`` read by indexing
    ``table[(tokens,)]``, an untied ``nnx.Param [D, V]`` output head applied by ``@``; blocks in
    an ``nnx.List`` run by a Python loop."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.embed_tokens = nnx.Param(_normal(rngs.params(), (cfg.vocab, cfg.width)))
        self.layers = nnx.List([EinsumBlock(cfg, rngs=rngs) for _ in range(cfg.depth)])
        self.norm = EinsumRMSNorm(cfg.width)
        self.lm_head = nnx.Param(_lecun(rngs.params(), (cfg.width, cfg.vocab)))

    def __call__(self, tokens):
        x = self.embed_tokens[(tokens,)]
        call = nnx.remat(_call) if self.remat else _call
        for layer in self.layers:
            x = call(layer, x)
        return self.norm(x) @ self.lm_head[...]


# --------------------------------------------------------------------------------------------
# 5. "moe": Switch-style top-1 experts with dense dispatch/combine, scanned blocks
# --------------------------------------------------------------------------------------------


class SwitchMLP(nnx.Module):
    """Top-1 mixture of experts. Router ``nnx.Linear(D, E)``; expert weights ``wi [E, D, F]``
    and ``wo [E, F, D]``. The batch's tokens are flattened to ``t``; each expert has ``C =
    capacity * batch`` buffer slots filled in token order (later tokens over capacity are
    dropped: they pass by the residual only). Dense one-hot ``dispatch [t, E, C]`` gathers the
    expert inputs, ``combine`` (dispatch times the router probability) scatters them back."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.experts, self.capacity = cfg.experts, cfg.capacity
        self.router = nnx.Linear(cfg.width, cfg.experts, use_bias=False, rngs=rngs)
        self.wi = nnx.Param(_normal(rngs.params(), (cfg.experts, cfg.width, cfg.mlp)))
        self.wo = nnx.Param(_normal(rngs.params(), (cfg.experts, cfg.mlp, cfg.width)))

    def __call__(self, x):
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        probs = jax.nn.softmax(self.router(tokens), axis=-1)  # [t, E]
        expert = jnp.argmax(probs, axis=-1)
        gate = jnp.max(probs, axis=-1)
        expert_mask = jax.nn.one_hot(expert, self.experts, dtype=jnp.int32)  # [t, E]
        position = jnp.cumsum(expert_mask, axis=0) * expert_mask - 1  # slot in the expert's buffer, -1 if not routed
        capacity = self.capacity * b
        dispatch = jax.nn.one_hot(position, capacity, dtype=x.dtype)  # [t, E, C]; -1 and >= C give zeros
        combine = dispatch * gate[:, None, None]
        xe = jnp.einsum("tec,td->ecd", dispatch, tokens)
        h = jnp.einsum("ecd,edf->ecf", xe, self.wi[...])
        ye = jnp.einsum("ecf,efd->ecd", nnx.gelu(h), self.wo[...])
        y = jnp.einsum("tec,ecd->td", combine, ye)
        return y.reshape(b, t, d)


class MoEAttention(nnx.Module):
    """Attention from four ``nnx.Linear`` (no bias) and ``jax.nn.dot_product_attention``."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        inner = cfg.heads * cfg.head_dim
        self.q_proj = nnx.Linear(cfg.width, inner, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(cfg.width, inner, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(cfg.width, inner, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(inner, cfg.width, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, self.heads, self.head_dim)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.reshape(b, t, self.heads * self.head_dim))


class MoEBlock(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.attn = MoEAttention(cfg, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.moe = SwitchMLP(cfg, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.mlp_norm(x))


class MoEModel(nnx.Module):
    """A Switch-Transformer-style decoder: every block's MLP a top-1 mixture of experts with
    stacked expert weights and dense one-hot dispatch/combine einsums (the expert axis a batch
    axis of the expert contractions). Blocks created stacked by ``nnx.vmap`` and run by
    ``nnx.scan`` (``nnx.remat`` when ``cfg.remat``), so expert weights are ``[L, E, D, F]``;
    ``nnx.Embed`` tokens, untied ``nnx.Linear`` head. No load-balancing loss."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.blocks = _stacked(MoEBlock, cfg, rngs)
        self.norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.lm_head = nnx.Linear(cfg.width, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = _scanned(self.blocks, self.embed(tokens), self.remat)
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------------------------
# 6. "dropout": nnx.Dropout layers with their own RNG streams, Python loop
# --------------------------------------------------------------------------------------------


class DropoutBlock(nnx.Module):
    """Pre-LN block: causal ``nnx.MultiHeadAttention`` with attention dropout, then an
    ``nnx.Linear`` MLP with dropout after the activation; dropout on both residual branches."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.heads,
            in_features=cfg.width,
            qkv_features=cfg.heads * cfg.head_dim,
            dropout_rate=cfg.dropout,
            deterministic=False,
            decode=False,
            rngs=rngs,
        )
        self.attn_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.fc1 = nnx.Linear(cfg.width, cfg.mlp, rngs=rngs)
        self.act_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.fc2 = nnx.Linear(cfg.mlp, cfg.width, rngs=rngs)
        self.resid_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn_dropout(self.attn(self.ln1(x), mask=mask))
        h = self.act_dropout(nnx.gelu(self.fc1(self.ln2(x))))
        return x + self.resid_dropout(self.fc2(h))


class DropoutModel(nnx.Module):
    """The everyday Flax NNX training-script model: ``nnx.Dropout`` layers (and the attention's
    own dropout) each holding a stream forked from the model's ``nnx.Rngs(dropout=...)``, so a
    call draws fresh masks and advances the streams' counters; training mode by default
    (``nnx.view(model, deterministic=True)`` or ``model.eval()`` for evaluation). Blocks in an
    ``nnx.List`` run by a Python loop, ``nnx.Embed`` tokens, untied ``nnx.Linear`` head."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.embed_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.blocks = nnx.List([DropoutBlock(cfg, rngs=rngs) for _ in range(cfg.depth)])
        self.final_norm = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.head = nnx.Linear(cfg.width, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        x = self.embed_dropout(self.embed(tokens))
        call = nnx.remat(_call) if self.remat else _call
        for block in self.blocks:
            x = call(block, x, mask)
        return self.head(self.final_norm(x))


# --------------------------------------------------------------------------------------------
# Construction, initialization, loss, data
# --------------------------------------------------------------------------------------------

_MODELS: dict[str, type[nnx.Module]] = {
    "mha": MHAModel,
    "gemma": GemmaModel,
    "maxtext": MaxTextModel,
    "einsum": EinsumModel,
    "moe": MoEModel,
    "dropout": DropoutModel,
}

_DESCRIPTIONS: dict[str, str] = {
    "mha": "stock nnx: nnx.Embed, LayerNorm -> causal nnx.MultiHeadAttention -> LayerNorm -> 2x nnx.Linear gelu MLP; "
    "blocks vmap-stacked, run by nnx.scan (remat optional); untied nnx.Linear head",
    "gemma": "Gemma-like: nnx.Einsum q [N,D,H], stacked kv [2,K,D,H], out [N,H,D]; gated MLP of raw nnx.Param "
    "[2,F,D] (jnp.einsum) and [F,D] (jnp.dot); custom RMSNorm; nnx.List + Python loop; tied nnx.Embed (attend)",
    "maxtext": "MaxText-like: DenseGeneral (nnx.Param kernel (*in, *out), lax.dot_general) for q/k/v [D,N,H], "
    "out [N,H,D], MLP [D,2,F]/[F,D] and head; nnx.RMSNorm; vmap-stacked, nnx.scan (remat optional); nnx.Embed",
    "einsum": "hand-written: nnx.Param layers by jnp.einsum (fused qkv [D,3,N,H], MLP) and x @ w (attn out, head); "
    "embedding table indexed table[(tokens,)]; custom RMSNorm; nnx.List + Python loop; untied head",
    "moe": "Switch-like top-1 MoE: router nnx.Linear, experts wi [E,D,F] / wo [E,F,D] via dense one-hot "
    "dispatch/combine einsums; nnx.Linear attention; vmap-stacked, nnx.scan (remat optional); untied head",
    "dropout": "nnx.Dropout (own forked RNG streams) after embed, attention, activation and residual + "
    "MultiHeadAttention dropout; nnx.Linear MLP; nnx.List + Python loop; untied nnx.Linear head; train mode",
}


def _check_style(style: str) -> type[nnx.Module]:
    if style not in _MODELS:
        raise ValueError(f"style must be one of {STYLES}, got style={style!r}")
    return _MODELS[style]


def describe(style: str) -> str:
    """One line: how the style is written (layers used, scan or loop, tied or not)."""
    _check_style(style)
    return _DESCRIPTIONS[style]


def abstract(style: str, cfg: StyleConfig = StyleConfig()) -> nnx.Module:
    """The model's structure with ``jax.ShapeDtypeStruct`` values (``nnx.eval_shape``)."""
    cls = _check_style(style)
    if not isinstance(cfg, StyleConfig):
        raise ValueError(f"cfg must be a StyleConfig, got {type(cfg).__name__}")
    return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(params=0, dropout=1)))


# How build() initializes each parameter: ("kernel", contracted axes counted from the end: robust
# to a leading stacked-layer axis), ("embed",), ("ones",), ("zeros",).
_CUSTOM_RULES: dict[tuple[type, str], tuple] = {
    (GemmaRMSNorm, "scale"): ("ones",),
    (GemmaMLP, "gating_einsum"): ("kernel", (-1,)),
    (GemmaMLP, "linear"): ("kernel", (-2,)),
    (EinsumLinear, "weight"): ("kernel", (-2,)),
    (EinsumLinear, "bias"): ("zeros",),
    (MatmulLinear, "weight"): ("kernel", (-2,)),
    (EinsumRMSNorm, "weight"): ("ones",),
    (EinsumAttention, "wqkv"): ("kernel", (-4,)),
    (EinsumModel, "embed_tokens"): ("embed",),
    (EinsumModel, "lm_head"): ("kernel", (-2,)),
    (SwitchMLP, "wi"): ("kernel", (-2,)),
    (SwitchMLP, "wo"): ("kernel", (-2,)),
}


def _einsum_fan_in(spec: str, shape: tuple[int, ...]) -> int:
    inputs, out = spec.split("->")
    _, kernel = inputs.split(",")
    lead = len(shape) - len(kernel)  # stacked-layer axes in front
    return math.prod(shape[lead + i] for i, c in enumerate(kernel) if c not in out)


def _rule(module: nnx.Module, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """(kind, std) of the parameter ``name`` of ``module``; kind is "normal", "ones" or "zeros"."""
    if name == "bias" and isinstance(module, (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.LayerNorm)):
        return "zeros", 0.0
    if name == "scale" and isinstance(module, (nnx.LayerNorm, nnx.RMSNorm)):
        return "ones", 0.0
    if name == "embedding" and isinstance(module, nnx.Embed):
        return "embed", 0.0
    if name == "kernel":
        if isinstance(module, nnx.Linear):
            return "normal", module.in_features**-0.5
        if isinstance(module, (nnx.LinearGeneral, DenseGeneral)):
            return "normal", math.prod(module.in_features) ** -0.5
        if isinstance(module, nnx.Einsum):
            return "normal", _einsum_fan_in(module.einsum_str, shape) ** -0.5
    rule = _CUSTOM_RULES.get((type(module), name))
    if rule is None:
        raise ValueError(f"no initialization rule for parameter {name!r} of {type(module).__name__}")
    if rule[0] == "kernel":
        return "normal", math.prod(shape[a] for a in rule[1]) ** -0.5
    return rule[0], 0.0


def build(style: str, cfg: StyleConfig = StyleConfig(), *, seed: int = 0) -> nnx.Module:
    """The model with values drawn on the host by ``np.random.default_rng(seed)``: kernels
    ``N(0, 1/fan_in)`` (fan_in: the product of the axes the kernel contracts), embeddings
    ``N(0, 1)`` (the tied ``"gemma"`` table ``N(0, 0.02^2)``: it is read back times
    ``sqrt(width)``, and a larger one makes every token predict itself at init), norm scales
    ones, biases zeros; dropout streams keyed from the same generator. Structure from
    ``nnx.eval_shape``, values set in place: nothing compiled that grows with the depth (only
    one tiny key split, for the dropout streams). Unknown ``style``: ValueError."""
    model = abstract(style, cfg)
    rng = np.random.default_rng(seed)
    embed_std = 0.02 if style == "gemma" else 1.0
    graph = list(nnx.iter_graph(model))
    owner = {path: node for path, node in graph}
    seen: set[int] = set()
    for path, var in graph:
        if not isinstance(var, nnx.Variable) or id(var) in seen:
            continue
        seen.add(id(var))
        module, name = owner[path[:-1]], path[-1]
        aval = var.get_value()
        shape, dtype = tuple(aval.shape), aval.dtype
        if isinstance(var, nnx.Param):
            kind, std = _rule(module, name, shape)
            if kind == "embed":
                kind, std = "normal", embed_std
            if kind == "normal":
                value = rng.standard_normal(shape) * std
            else:
                value = np.ones(shape) if kind == "ones" else np.zeros(shape)
            var.set_value(jnp.asarray(value.astype(dtype)))
        elif isinstance(var, nnx.RngKey):
            keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), max(1, math.prod(shape)))
            var.set_value(keys.reshape(shape))
        elif isinstance(var, nnx.RngCount):
            var.set_value(jnp.zeros(shape, dtype))
        else:
            raise ValueError(f"build: no value for {type(var).__name__} at {'/'.join(map(str, path))}")
    left = [path for path, v in nnx.to_flat_state(nnx.state(model)) if isinstance(v.get_value(), jax.ShapeDtypeStruct)]
    if left:
        raise ValueError(f"build({style!r}): variables left without values: {left}")
    return model


def loss_fn(model: Callable, batch) -> jax.Array:
    """Mean next-token cross entropy; ``batch = (inputs [B, T] int32, targets [B, T] int32)``."""
    inputs, targets = batch
    logits = model(inputs).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1))


def make_batch(cfg: StyleConfig, batch: int, seq: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens (numpy int32): ``inputs [batch, seq]`` and ``targets`` shifted by one."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab, (batch, seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]
