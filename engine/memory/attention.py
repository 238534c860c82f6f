"""The memory attention function, registered with transformers' AttentionInterface.

A model whose `config._attn_implementation` is `ATTN_IMPLEMENTATION` calls `memory_attention`
from every attention layer with the query, key and value it computed (already rotated at the
position ids it was given) and every keyword argument of the forward. The session's frame comes
as the keyword `longserve_memory`; without it the function hands a forward of the plain KV
path (keyword `longserve_kv`, engine/kv_attention.py) to that path's function, and is plain
SDPA attention otherwise, so the same model still serves requests without a session.

The matching `AttentionMaskInterface` entry is SDPA's mask, so the model without a frame gets
exactly the masks SDPA would (KV caches and padding included); with a frame the mask is ignored
and the frame builds its own (sinks, retrieved and local tokens visible, causal in the chunk).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engine.memory.frame import FrameState

ATTN_IMPLEMENTATION = "longserve_memory"
FRAME_KWARG = "longserve_memory"
KV_KWARG = "longserve_kv"  # engine/kv_attention.py's implementation name and keyword


def memory_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, H, T, d), key/value (B, kv_heads, T, d) -> ((B, T, H, d), None)."""
    frame: FrameState | None = kwargs.get(FRAME_KWARG)
    if frame is None and kwargs.get(KV_KWARG) is not None and KV_KWARG in ALL_ATTENTION_FUNCTIONS:
        # A forward of the plain KV path (engine/kv_attention.py) while this one is selected.
        return ALL_ATTENTION_FUNCTIONS[KV_KWARG](
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if frame is None:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out, None
    if query.shape[0] != 1:
        raise ValueError("memory attention reads one sequence at a time (batch size 1)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return frame.attend(module.layer_idx, query, key, value, scaling), None


def use_memory_attention(model: PreTrainedModel) -> None:
    """Register the function (idempotent) and select it on the model."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, memory_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
