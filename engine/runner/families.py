"""The causal LMs whose decode step engine/runner/decode_step.py computes, and where each keeps
the weights it reads (docs/decisions/065-lean-decode-families.md).

Every family here has Llama's layer: rms_norm -> q|k|v -> rotary -> attention -> o -> residual
-> rms_norm -> silu(gate) * up -> down -> residual. They differ in where the weights are and in
a few optional pieces:

    Llama, Mistral   separate q/k/v and gate/up projections, fused here (weights.fuse_linears)
    Qwen2 / Qwen2.5  biased q, k and v: the fused q|k|v carries the three biases
    Qwen3            an RMSNorm per head on q and on k (q_norm, k_norm), before rotary
    Phi-3            q|k|v and gate|up fused in the checkpoint; rotary may turn only the first
                     partial_rotary_factor of each head

`unsupported` names what the step cannot reproduce; such a model keeps transformers' forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.runner.weights import fuse_linears

Matmul = Callable[[torch.Tensor], torch.Tensor]
# a layer: input norm weight, q|k|v, o, post-attention norm weight, gate|up, down
Layer = tuple[torch.Tensor, Matmul, Matmul, torch.Tensor, Matmul, Matmul]

FAMILIES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
PARTIAL_ROTARY = ("Phi3ForCausalLM",)  # whose forward turns only part of a head
SEQUENCE_ROTARY = ("dynamic", "longrope")  # rope types whose angles follow the sequence length


def unsupported(model: Any) -> str | None:
    """Why the lean step cannot reproduce this model's forward, or None if it can."""
    cfg, name = model.config, type(model).__name__
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap is not None:
        return (
            f"attention logit soft-capping (attn_logit_softcapping={softcap}): a decode row "
            "(engine/runner/rows.py) attends with a plain softmax"
        )
    window = _short_window(cfg)
    if window is not None:
        return window
    if name not in FAMILIES:
        return f"{name} is not one of the lean step's families ({', '.join(FAMILIES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}: the lean step's MLP is silu(gate) * up"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return f"pretraining_tp {cfg.pretraining_tp}: a tensor-parallel split of the linears"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type in SEQUENCE_ROTARY:
        return (
            f"rope_type {rope_type!r}: rotary angles that depend on the sequence length "
            "(one cached table cannot hold them)"
        )
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial not in (None, 1.0) and name not in PARTIAL_ROTARY:
        return f"partial_rotary_factor {partial} on {name}, whose forward turns whole heads"
    return None


def attention_window(cfg: Any) -> int | None:
    """The sliding window of a model some of whose layers attend to fewer keys than it holds
    (sliding_window < max_position_embeddings), or None."""
    window = getattr(cfg, "sliding_window", None)
    positions = getattr(cfg, "max_position_embeddings", None)
    if window is None or (positions is not None and window >= positions):
        return None
    types = getattr(cfg, "layer_types", None)  # Mistral and Phi-3 window every layer
    if types is not None and not any(t == "sliding_attention" for t in types):
        return None
    return int(window)


def _short_window(cfg: Any) -> str | None:
    """The reason a sliding window would cut some decode row's keys, or None: a window of at
    least max_position_embeddings keys never does (transformers keeps key j for the query at i
    while j > i - sliding_window)."""
    window = getattr(cfg, "sliding_window", None)
    positions = getattr(cfg, "max_position_embeddings", None)
    if window is None or (positions is not None and window >= positions):
        return None
    layers = int(cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None)  # Mistral and Phi-3 window every layer
    windowed = layers if types is None else sum(t == "sliding_attention" for t in types)
    if not windowed:
        return None
    return (
        f"sliding-window attention on {windowed} of {layers} layers (sliding_window={window} < "
        f"max_position_embeddings={positions}): a decode row (engine/runner/rows.py) attends "
        "every key it holds"
    )


def layer_weights(model: Any) -> list[Layer]:
    """Every decoder layer's norms and products, q|k|v and gate|up fused (their parts become
    views of the fused rows; Phi-3's come fused)."""
    layers: list[Layer] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "qkv_proj"):
            qkv, gate_up = attn.qkv_proj, mlp.gate_up_proj
        else:
            qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        post = layer.post_attention_layernorm.weight
        layers.append(
            (layer.input_layernorm.weight, qkv, attn.o_proj, post, gate_up, mlp.down_proj)
        )
    return layers


def qk_norm_weights(model: Any, heads: int, kv_heads: int) -> list[torch.Tensor] | None:
    """Qwen3's per-head RMSNorm weights, one (heads + kv_heads, head_dim) tensor per layer (q's
    rows, then k's), so one norm covers both; None for a family without them. Their eps is the
    model's rms_norm_eps."""
    attns = [layer.self_attn for layer in model.model.layers]
    if not hasattr(attns[0], "q_norm"):
        return None
    return [
        torch.cat((a.q_norm.weight.expand(heads, -1), a.k_norm.weight.expand(kv_heads, -1)))
        for a in attns
    ]
