"""A lean decode step for Llama-family models: the next token of every decode row (plain KV
caches and memory frames alike, engine/runner/rows.py), without transformers' module tree.

A decode token on a CPU is a few milliseconds of arithmetic wrapped in thousands of small eager
ops: transformers' forward builds masks, position embeddings and per-layer casts, and calls seven
linears per layer. `LeanDecoder.forward` computes the same function directly from the model's
own weights (docs/decisions/037-lean-decode-step.md):

    per layer   rms_norm -> one q|k|v linear -> rotary (a cached cos/sin row at each row's
                position) -> each row attends -> o linear -> residual -> rms_norm
                -> one gate|up linear -> silu * up -> down linear -> residual

Every row gets the same query, key and value transformers' forward would hand it and attends
through its own DecodeRow: a plain row to its KVCache (engine/runner/cpu_attention.py's split-key
kernel on a float32 CPU model, engine/runner/kv_cache.py), a memory row to its frame.

With int4 linears and engine/runner/csrc/quant_matmul.cpp built, a step of at most SMALL_M rows runs
each layer's work before attention (norm, q|k|v, rotary) and after it (o, residual, norm, gated
MLP, residual) as one C++ call each (docs/decisions/038).

The fused linears share their weights with the model's (the model's projections become views of
the fused rows), so nothing is kept twice. Prefill, reading and every model that is not a plain
Llama go through transformers' forward as before; `attach_decoder` decides once, at load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.runner.attention import KV_KWARG, forward_through
from engine.runner.cpu_attention import kernel_ready
from engine.runner.rows import DecodeRow, RowBatch
from engine.runner.weights import SMALL_M, Int4Linear, fuse_linears, quant_kernels, small_matmul

Matmul = Callable[[torch.Tensor], torch.Tensor]
# a layer: input norm weight, q|k|v, o, post-attention norm weight, gate|up, down
Layer = tuple[torch.Tensor, Matmul, Matmul, torch.Tensor, Matmul, Matmul]
DECODER_ATTR = "longserve_decoder"  # the model attribute holding its LeanDecoder, if any


def unsupported(model: Any) -> str | None:
    """Why `LeanDecoder` cannot reproduce this model's forward, or None if it can."""
    cfg = model.config
    if type(model).__name__ != "LlamaForCausalLM":
        return f"{type(model).__name__} is not LlamaForCausalLM"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "biased projections"
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return "an activation or tensor-parallel split other than Llama's"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        return (
            "rotary angles that depend on the sequence length (one cached table cannot hold them)"
        )
    return None


class LeanDecoder:
    """One decode token for B decode rows (engine/runner/rows.py) of a LlamaForCausalLM (`unsupported`
    is None)."""

    def __init__(self, model: Any) -> None:
        cfg, inner = model.config, model.model
        self.hidden = int(cfg.hidden_size)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden // self.heads)
        self.eps = float(cfg.rms_norm_eps)
        self.embed, self.rotary, self.head = inner.embed_tokens, inner.rotary_emb, model.lm_head
        self.norm = inner.norm.weight
        self.layers: list[Layer] = []
        self._modules = list(inner.layers)  # for their forward hooks
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]),
                    attn.o_proj,
                    layer.post_attention_layernorm.weight,
                    fuse_linears([mlp.gate_proj, mlp.up_proj]),
                    mlp.down_proj,
                )
            )
        # the same layers with the int4/int8 kernels called bare, for steps of <= SMALL_M rows
        self.small: list[Layer] = [
            (a, small_matmul(b), small_matmul(c), d, small_matmul(e), small_matmul(f))
            for a, b, c, d, e, f in self.layers
        ]
        self._small_head = small_matmul(self.head)
        self._q4 = self._q4_layers()
        self.scaling = float(inner.layers[0].self_attn.scaling)
        self._cos = self._sin = torch.empty(0)  # (positions, head_dim), grown on demand
        kernel_ready(self.norm)  # build the attention kernel at load, not at the first token

    @property
    def invariant_rows(self) -> int:
        """The most rows one forward may take with every row's arithmetic independent of the
        others: the int4 kernels quantize and accumulate each row on its own up to SMALL_M
        rows; torch's GEMM may reduce in another order for another number of rows."""
        return SMALL_M if self._q4 is not None else 1

    def _q4_layers(self) -> tuple[Any, list[tuple]] | None:
        """The quant kernels and every layer's norm weights and 4-bit codes (codes, scales,
        mins per product), when every product is an Int4Linear in fp32 and the kernels are
        built: then small steps run quant_matmul.cpp's pre_attention / post_attention."""
        layers = []
        for w_in, qkv, o_proj, w_post, gate_up, down in self.layers:
            products = (qkv, o_proj, gate_up, down)
            int4 = [m for m in products if isinstance(m, Int4Linear) and m.bias is None]
            if len(int4) != len(products) or w_in.dtype != torch.float32:
                return None
            codes = [(m.codes, m.block_scales, m.block_mins) for m in int4]
            layers.append((w_in, codes[0], codes[1], w_post, codes[2], codes[3]))
        kernels = quant_kernels() if layers else None  # built only for int4 models
        return None if kernels is None else (kernels, layers)

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows (B, 1, head_dim) for positions (B,): x*cos + roll(x)*sin
        is transformers' x*cos + rotate_half(x)*sin."""
        needed = int(positions.max()) + 1
        if needed > self._cos.shape[0]:
            size = max(needed, 2 * self._cos.shape[0], 1024)
            ids = torch.arange(size, device=self.norm.device).view(1, -1)
            cos, sin = self.rotary(self.norm.new_zeros(1), ids)  # (1, size, head_dim)
            half = self.head_dim // 2
            self._cos, self._sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1)
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)

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

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Llama's RMSNorm in six small ops (F.rms_norm on the CPU takes twice as long)
        return x * (x.square().mean(-1, keepdim=True) + self.eps).rsqrt() * weight

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
        if q4 is not None:
            cos_rows, sin_rows = cos.view(rows, d), sin.view(rows, d)
        for layer, (w_in, qkv, o_proj, w_post, gate_up, down) in enumerate(
            self.small if small else self.layers
        ):
            x_in = x  # the layer's input, for its forward hooks
            if q4 is not None:  # norm, q|k|v and rotary in one call
                q4_layer = q4[1][layer]
                qkv_out = (
                    q4[0]
                    .pre_attention(
                        x, w_in, self.eps, *q4_layer[1], cos_rows, sin_rows, (heads + kv_heads) * d
                    )
                    .view(rows, heads + 2 * kv_heads, d)
                )
                qk = qkv_out[:, : heads + kv_heads]
            else:
                qkv_out = qkv(self._rms(x, w_in)).float().view(rows, heads + 2 * kv_heads, d)
                qk = qkv_out[:, : heads + kv_heads]
                qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)  # (B, heads + kv_heads, d)
            value = qkv_out[:, heads + kv_heads :]
            out = []
            for b, row in enumerate(batch.rows):  # each row attends to its cache or frame
                q, k, v = (t.view(1, -1, 1, d) for t in (qk[b, :heads], qk[b, heads:], value[b]))
                out.append(row.attend(layer, q, k, v, self.scaling).reshape(1, heads * d))
            attn = out[0] if rows == 1 else torch.cat(out)
            if q4 is not None:  # o, residual, norm, gated MLP, residual in one call
                _, _, o_codes, _, gu_codes, down_codes = q4_layer
                x = q4[0].post_attention(
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


def attach_decoder(model: Any) -> LeanDecoder | None:
    """Give the model a LeanDecoder (the attribute DECODER_ATTR) if it can have one."""
    decoder = None if unsupported(model) else LeanDecoder(model)
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
