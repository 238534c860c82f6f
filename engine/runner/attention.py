"""The one attention function longserve registers with transformers' AttentionInterface.

`use_longserve_attention(model)` (the loader calls it once per model) selects `longserve_attention`
for every attention layer. Each layer calls it with the query, key and value it computed (already
rotated at the position ids it was given) and every keyword argument of the forward, and the
keywords pick the path:

    FRAME_KWARG  a session's Frame        -> the frame's attention (engine/memory/frame.py)
    KV_KWARG     a KVBatch                -> per-request KV caches (engine/runner/kv_cache.py)
    neither                               -> plain SDPA, the model's own attention

so one model serves every request, with or without a session, and nothing switches the model's
attention implementation per forward. The matching `AttentionMaskInterface` entry is SDPA's mask,
so a forward on the plain path gets exactly the masks SDPA would (KV caches and padding
included); the frame and the KV caches ignore it and build their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

if TYPE_CHECKING:
    from engine.memory.frame import Frame
    from engine.runner.kv_cache import KVBatch

ATTENTION_NAME = "longserve"  # the model's config._attn_implementation once selected
FRAME_KWARG = "longserve_memory"
KV_KWARG = "longserve_kv"


def longserve_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query (B, H, T, d), key/value (B, kv_heads, T, d) -> ((B, T, H, d), None)."""
    frame: Frame | None = kwargs.get(FRAME_KWARG)
    batch: KVBatch | None = kwargs.get(KV_KWARG)
    if frame is None and batch is None:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out, None
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer: int = module.layer_idx  # type: ignore[assignment]
    if frame is not None:
        if query.shape[0] != 1:
            raise ValueError("memory attention reads one sequence at a time (batch size 1)")
        attended = frame.attend(layer, query, key, value, scaling)
        assert isinstance(attended, torch.Tensor), "only the lean decode step defers attention"
        return attended, None
    assert batch is not None
    return batch.attend(layer, query, key, value, scaling), None


AttentionInterface.register(ATTENTION_NAME, longserve_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_longserve_attention(model: PreTrainedModel) -> None:
    """Select `longserve_attention` on the model (once, after loading it; idempotent)."""
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)


def require_longserve_attention(model: PreTrainedModel) -> None:
    """Raise unless `use_longserve_attention(model)` ran: without it a forward would ignore the
    frame or caches passed to it and attend only the tokens it was given."""
    if model.config._attn_implementation != ATTENTION_NAME:
        raise ValueError(
            f"the model's attention is {model.config._attn_implementation!r}, not longserve's: "
            "call engine.runner.attention.use_longserve_attention(model) once after loading it"
        )


def forward_through(
    model: Any, ids: torch.Tensor, positions: torch.Tensor, batch: Any
) -> torch.Tensor:
    """One forward of ids (B, T) at positions (B, T) whose attention goes through `batch` (the
    forward keyword KV_KWARG: a KVBatch, or engine/runner/rows.py's RowBatch); logits
    (B, vocab) at each row's last position. The batch aborts when the forward fails; the
    caller commits it."""
    try:
        out = model(
            input_ids=ids,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=1,
            **{KV_KWARG: batch},
        )
    except BaseException:
        batch.abort()
        raise
    return out.logits[:, -1]
