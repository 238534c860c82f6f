"""A lean decode step for Llama-shaped models: the next token of every decode row (plain KV
caches and memory frames alike, engine/runner/rows.py), without transformers' module tree.

A decode token on a CPU is a few milliseconds of arithmetic wrapped in thousands of small eager
ops: transformers' forward builds masks, position embeddings and per-layer casts, and calls seven
linears per layer. `LeanDecoder.forward` computes the same function directly from the model's
own weights (docs/decisions/037-lean-decode-step.md):

    per layer   rms_norm -> one q|k|v linear -> [q/k norm per head] -> rotary (a cached cos/sin
                row at each row's position) -> each row attends -> o linear -> residual
                -> rms_norm -> one gate|up linear -> silu * up -> down linear -> residual

The families it computes (Llama, Mistral, Qwen2 / Qwen2.5, Qwen3, Phi-3) and what each needs
are engine/runner/families.py's; `unsupported` says why any other model, or a configuration the
step cannot reproduce (sliding windows, soft-capping, length-dependent rotary), keeps
transformers' forward (docs/decisions/065-lean-decode-families.md).

Every row gets the same query, key and value transformers' forward would hand it and attends
through its own DecodeRow: a plain row to its KVCache (engine/runner/cpu_attention.py's split-key
kernel on a float32 CPU model, engine/runner/kv_cache.py), a memory row to its frame.

With int4 linears and engine/runner/csrc/quant_matmul.cpp built, a step of at most SMALL_M rows of
a model with Llama's own layer (no biases, no q/k norms, rotary over whole heads) runs each
layer's work before attention (norm, q|k|v, rotary) and after it (o, residual, norm, gated MLP,
residual) as one C++ call each (docs/decisions/038), wherever those products are int4 or int8
kernel products (a GGUF keeps its linears in several types: docs/decisions/067).

The fused linears share their weights with the model's (the model's projections become views of
the fused rows), so nothing is kept twice. Prefill and reading go through transformers' forward
as before; `attach_decoder` decides once, at load.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.runner.attention import KV_KWARG, forward_through
from engine.runner.cpu_attention import Deferred, deferring, kernel_ready, key_splits
from engine.runner.cpu_extensions import load_extension
from engine.runner.families import Layer, layer_weights, qk_norm_weights, unsupported
from engine.runner.quant_linears import (
    GROUP,
    SMALL_M,
    Int4Linear,
    Int8Linear,
    quant_kernels,
    small_matmul,
)
from engine.runner.rows import DecodeRow, KVRow, RowBatch

DECODER_ATTR = "longserve_decoder"  # the model attribute holding its LeanDecoder, if any
logger = logging.getLogger(__name__)


class LeanDecoder:
    """One decode token for B decode rows (engine/runner/rows.py) of a model of one of
    engine/runner/families.py's families (`unsupported` is None). Built once the model is on
    its device: its fused weights and rotary tables are made there and do not follow a move."""

    def __init__(self, model: Any) -> None:
        cfg, inner = model.config, model.model
        self.hidden = int(cfg.hidden_size)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden // self.heads)
        self.eps = float(cfg.rms_norm_eps)
        self.embed, self.rotary, self.head = inner.embed_tokens, inner.rotary_emb, model.lm_head
        self.norm = inner.norm.weight
        self.layers: list[Layer] = layer_weights(model)
        self.qk_norms = qk_norm_weights(model, self.heads, self.kv_heads)  # Qwen3's, else None
        self._modules = list(inner.layers)  # for their forward hooks
        # the same layers with the int4/int8 kernels called bare, for steps of <= SMALL_M rows
        self.small: list[Layer] = [
            (a, small_matmul(b), small_matmul(c), d, small_matmul(e), small_matmul(f))
            for a, b, c, d, e, f in self.layers
        ]
        self._small_head = small_matmul(self.head)
        self._cos = self._sin = torch.empty(0)  # (positions, rotary_dim), grown on demand
        self._grow_table(1024)
        self.rotary_dim = int(self._cos.shape[1])  # Phi-3's partial_rotary_factor of head_dim
        self._q4 = self._q4_layers()
        self._quantized = self._all_quantized()
        self._plain = self._plain_kernel()
        self.scaling = float(inner.layers[0].self_attn.scaling)
        kernel_ready(self.norm)  # build the attention kernel at load, not at the first token

    @property
    def invariant_rows(self) -> int:
        """The most rows one forward may take with every row's arithmetic independent of the
        others: the int4 and int8 kernels quantize and accumulate each row on its own up to
        SMALL_M rows; torch's GEMM may reduce in another order for another number of rows."""
        return SMALL_M if self._quantized else 1

    def _all_quantized(self) -> bool:
        """Whether every product of a step (the layers' and the head) is an Int4Linear or
        Int8Linear multiplied by quant_matmul.cpp, so that small steps never reach a GEMM."""
        products = [m for layer in self.layers for m in layer[1:3] + layer[4:]] + [self.head]
        if not all(isinstance(m, (Int4Linear, Int8Linear)) for m in products):
            return False
        return quant_kernels() is not None

    def _q4_layers(self) -> tuple[Any, list[tuple[tuple | None, tuple | None]]] | None:
        """The quant kernels and, per layer, the arguments of quant_matmul.cpp's pre_attention
        (q|k|v's codes, scales and mins) and of its post_attention (o's, gate|up's and down's),
        each None where one of its products is not a bare Int4Linear or Int8Linear (a linear
        kept in float, parts of different kinds, a biased product): small steps run the
        layer's work before and after attention in one call each where it is not None. None where no layer has either,
        the kernels are not built, the norms are not fp32, or the layer is not Llama's own (q/k
        norms, rotary over part of a head)."""
        if self.qk_norms is not None or self.rotary_dim != self.head_dim:
            return None

        def codes(*products: Any) -> tuple | None:
            if all(_one_call_product(m) for m in products):
                empty = torch.empty(0)  # an int8 product without minimums
                return tuple(
                    (m.codes, m.block_scales, empty if m.block_mins is None else m.block_mins)
                    for m in products
                )
            return None

        layers = []
        for w_in, qkv, o_proj, w_post, gate_up, down in self.layers:
            if w_in.dtype != torch.float32 or w_post.dtype != torch.float32:
                return None
            pre = codes(qkv)
            layers.append((None if pre is None else pre[0], codes(o_proj, gate_up, down)))
        if all(pre is None and post is None for pre, post in layers):
            return None
        kernels = quant_kernels()  # built only for models with quantized linears
        return None if kernels is None else (kernels, layers)

    def _plain_kernel(self) -> tuple[Any, list[torch.Tensor]] | None:
        """plain_step.cpp's module and its weights (per layer: w_in, q|k|v's, w_post, o's,
        gate|up's, down's) where every layer takes the one-call path before and after
        attention and the kernel builds; else None."""
        if self._q4 is None or any(pre is None or post is None for pre, post in self._q4[1]):
            return None
        kernel = load_extension("plain_step")
        if kernel is None:
            return None
        weights: list[torch.Tensor] = []
        for (w_in, _, _, w_post, _, _), (pre, post) in zip(self.layers, self._q4[1], strict=True):
            assert pre is not None and post is not None  # checked above
            weights += [w_in, *pre, w_post, *post[0], *post[1], *post[2]]
        return kernel, weights

    def _plain_layers(
        self, batch: RowBatch, x: torch.Tensor, positions: torch.Tensor, cos, sin
    ) -> torch.Tensor | None:
        """Every layer of a step whose rows are all plain KV rows in one C++ call
        (engine/runner/csrc/plain_step.cpp); None where the step is not one it takes."""
        caches = [row.cache for row in batch.rows if type(row) is KVRow]
        if (
            self._plain is None
            or len(caches) != len(batch.rows)
            or any(c._buffer is None or c._buffer.dtype not in _CACHE_DTYPES for c in caches)
            or any(m._forward_hooks for m in self._modules)
        ):
            return None
        kernel, weights = self._plain
        starts = positions.tolist()
        splits = [key_splits(p + 1, self.kv_heads) for p in starts]
        rows, d = x.shape[0], self.head_dim
        return kernel.plain_layers(
            x,
            weights,
            [c._buffer for c in caches],
            starts,
            cos.view(rows, d),
            sin.view(rows, d),
            self.eps,
            self.scaling,
            self.heads,
            splits,
        )

    def _grow_table(self, size: int) -> None:
        """cos and signed sin (size, rotary_dim) for positions 0..size-1: x*cos + roll(x)*sin
        is transformers' x*cos + rotate_half(x)*sin."""
        ids = torch.arange(size, device=self.norm.device).view(1, -1)
        cos, sin = self.rotary(self.norm.new_zeros(1), ids)  # (1, size, rotary_dim)
        half = cos.shape[-1] // 2
        self._cos, self._sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1)

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows (B, 1, rotary_dim) for positions (B,)."""
        needed = int(positions.max()) + 1
        if needed > self._cos.shape[0]:
            self._grow_table(max(needed, 2 * self._cos.shape[0]))
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, heads, head_dim) turned at its rows' positions: the first rotary_dim of each
        head, the rest as it is (Phi-3's partial rotary)."""
        r = self.rotary_dim
        if r == self.head_dim:
            return torch.addcmul(x * cos, x.roll(r // 2, -1), sin)
        turned, kept = x[..., :r], x[..., r:]
        return torch.cat((torch.addcmul(turned * cos, turned.roll(r // 2, -1), sin), kept), -1)

    def _layer_hooks(
        self, layer: int, x_in: torch.Tensor, x: torch.Tensor, batch: RowBatch
    ) -> torch.Tensor:
        """Run the decoder layer's forward hooks on its output (B, hidden), as transformers'
        forward would with the rows passed as KV_KWARG; a hook's return replaces it."""
        module = self._modules[layer]
        args, out = (x_in.unsqueeze(1),), x.unsqueeze(1)  # (B, 1, hidden), as the layer gives
        for key, hook in list(module._forward_hooks.items()):
            if key in module._forward_hooks_with_kwargs:
                result = hook(module, args, {KV_KWARG: batch}, out)
            else:
                result = hook(module, args, out)
            out = out if result is None else result
        return out.squeeze(1)

    def _adapt(
        self,
        layer: int,
        qkv_out: torch.Tensor,
        h: torch.Tensor,
        adapted: list[tuple[int, Any]],
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> None:
        """Add each adapted row's update (engine/runner/adapter.py) of its normed input h (B,
        hidden) to its q|k|v (B, n, d) in place, row by row; with cos and sin, q's and k's
        turned as the kernel turned them."""
        n = self.heads + self.kv_heads
        for b, adapter in adapted:
            delta = adapter.delta(layer, h[b : b + 1].float()).view(1, -1, self.head_dim)
            if cos is not None and sin is not None:
                turned = self._rotate(delta[:, :n], cos[b : b + 1], sin[b : b + 1])
                delta = torch.cat((turned, delta[:, n:]), 1)
            qkv_out[b : b + 1] += delta.to(qkv_out.dtype)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Llama's RMSNorm in six small ops (F.rms_norm on the CPU takes twice as long)
        return x * (x.square().mean(-1, keepdim=True) + self.eps).rsqrt() * weight

    def _attend(
        self, batch: RowBatch, layer: int, qk: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Each row's attention to its cache or frame, (B, heads * d). Several rows' memory
        frames are attended by one kernel call after every row has made its pieces ready
        (engine/runner/cpu_attention.py's PiecesBatch), not by a call per row."""
        heads, d = self.heads, self.head_dim
        out: list[torch.Tensor | Deferred] = []
        with deferring() if len(batch.rows) > 1 else contextlib.nullcontext() as pieces:
            for b, row in enumerate(batch.rows):
                q, k, v = (t.view(1, -1, 1, d) for t in (qk[b, :heads], qk[b, heads:], value[b]))
                out.append(row.attend(layer, q, k, v, self.scaling))
        if pieces is not None:
            pieces.run()
        done = [o.result() if isinstance(o, Deferred) else o for o in out]
        flat = [o.reshape(1, heads * d) for o in done]
        return flat[0] if len(flat) == 1 else torch.cat(flat)

    @torch.inference_mode()
    def forward(self, rows: Sequence[DecodeRow], token_ids: Sequence[int]) -> torch.Tensor:
        """Append token_ids[b] to rows[b] for every b; logits (B, vocab). On failure no row has
        changed (engine/runner/rows.py's contract, as transformers' forward keeps it)."""
        device = self.norm.device
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)  # (B,)
        batch = RowBatch(rows)
        positions = batch.begin(device).view(-1)  # (B,)
        try:
            logits = self._forward(batch, ids, positions)
            batch.commit(logits)
        except BaseException:
            batch.abort()
            raise
        return logits

    def _forward(self, batch: RowBatch, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        rows = ids.shape[0]
        cos, sin = self._rotation(positions)
        x = self.embed(ids)  # (B, hidden)
        small = rows <= SMALL_M
        q4 = self._q4 if small and x.dtype == torch.float32 else None
        kernels: Any = None if q4 is None else q4[0]
        adapted = [(b, a) for b, r in enumerate(batch.rows) if (a := getattr(r, "adapter", None))]
        if q4 is not None:
            cos_rows, sin_rows = cos.view(rows, d), sin.view(rows, d)
            plain = None if adapted else self._plain_layers(batch, x, positions, cos, sin)
            if plain is not None:
                return self._small_head(self._rms(plain, self.norm)).float()
        for layer, (w_in, qkv, o_proj, w_post, gate_up, down) in enumerate(
            self.small if small else self.layers
        ):
            x_in = x  # the layer's input, for its forward hooks
            pre, post = (None, None) if q4 is None else q4[1][layer]
            if pre is not None:  # norm, q|k|v and rotary in one call
                qkv_out = kernels.pre_attention(
                    x, w_in, self.eps, *pre, cos_rows, sin_rows, (heads + kv_heads) * d
                ).view(rows, heads + 2 * kv_heads, d)
                if adapted:  # q and k come turned: so do their updates
                    self._adapt(layer, qkv_out, self._rms(x, w_in), adapted, cos, sin)
                qk = qkv_out[:, : heads + kv_heads]
            else:
                h = self._rms(x, w_in)
                qkv_out = qkv(h).float().view(rows, heads + 2 * kv_heads, d)
                if adapted:
                    self._adapt(layer, qkv_out, h, adapted)
                qk = qkv_out[:, : heads + kv_heads]  # (B, heads + kv_heads, d)
                if self.qk_norms is not None:
                    qk = self._rms(qk, self.qk_norms[layer])
                qk = self._rotate(qk, cos, sin)
            value = qkv_out[:, heads + kv_heads :]
            attn = self._attend(batch, layer, qk, value)
            if post is not None:  # o, residual, norm, gated MLP, residual in one call
                o_codes, gu_codes, down_codes = post
                x = kernels.post_attention(
                    x, attn, *o_codes, w_post, self.eps, *gu_codes, *down_codes
                )
            else:
                x = x + o_proj(attn.to(x.dtype))
                gate, up = gate_up(self._rms(x, w_post)).chunk(2, -1)
                x = x + down(F.silu(gate) * up)
            if self._modules[layer]._forward_hooks:  # Neurocache reads layer r's output
                x = self._layer_hooks(layer, x_in, x, batch).contiguous()
        head = self._small_head if small else self.head
        return head(self._rms(x, self.norm)).float()  # (B, vocab)


_CACHE_DTYPES = (torch.float32, torch.float16)  # what the attention kernel reads


def _one_call_product(m: Any) -> bool:
    """Whether quant_matmul.cpp's layer calls can multiply `m`: an unbiased Int4Linear, or an
    unbiased Int8Linear with scales per 32 or 16 inputs."""
    if isinstance(m, Int4Linear):
        return m.bias is None
    return isinstance(m, Int8Linear) and m.bias is None and m.group in (GROUP, GROUP // 2)


def attach_decoder(model: Any) -> LeanDecoder | None:
    """Give the model a LeanDecoder (the attribute DECODER_ATTR) if it can have one."""
    reason = unsupported(model)
    if reason is not None:
        logger.info("decode steps keep transformers' forward: %s", reason)
    decoder = None if reason is not None else LeanDecoder(model)
    setattr(model, DECODER_ATTR, decoder)
    return decoder


def decoder_of(model: Any) -> LeanDecoder | None:
    return getattr(model, DECODER_ATTR, None)


@torch.inference_mode()
def decode_rows(model: Any, rows: Sequence[DecodeRow], token_ids: Sequence[int]) -> torch.Tensor:
    """Append token_ids[b] to rows[b] for every b in one forward; logits (B, vocab). On failure
    no row has changed."""
    decoder = decoder_of(model)
    if decoder is not None:
        return decoder.forward(rows, token_ids)
    device = next(model.parameters()).device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device).view(-1, 1)  # (B, 1)
    batch = RowBatch(rows)
    positions = batch.begin(device)
    logits = forward_through(model, ids, positions, batch)  # (B, vocab)
    try:
        batch.commit(logits)
    except BaseException:
        batch.abort()
        raise
    return logits
