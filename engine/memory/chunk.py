"""The attention of a chunk over the whole frame: a session's first chunks, and chunks that
retrieve (a question read as a prompt), concatenated into one frame for SDPA.

A decode step once memory is in use runs step_cache.py instead, and a reading chunk once memory
is in use attends a band (band.py), which masks with `chunk_mask` as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.memory.frame_state import FrameState


def attend_chunk(
    frame: FrameState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    retrieved_ok: torch.Tensor | None,
    scaling: float,
    group: int,
) -> torch.Tensor:
    """query (1, H, T, d), key/value (1, kv_heads, T, d), both rotated; keys/values the frame's
    prefix pieces (kv_heads, n, d) in order: sinks, retrieved rows, local window. Each token
    attends the prefix and causally the chunk -> (1, T, H, d)."""
    T = key.shape[2]
    # (1, kv_heads, F, d) in the query's dtype (sinks and window may be held in float16)
    k_frame = torch.cat([*keys, key[0]], dim=1)[None].to(query.dtype)
    v_frame = torch.cat([*values, value[0]], dim=1)[None].to(query.dtype)
    P = k_frame.shape[2] - T
    # the session's first chunk attends only itself: plain causal attention, which SDPA's
    # kernels compute without the blocks above the diagonal that an explicit mask costs
    causal = P == 0 and T > 1
    mask = None if causal else chunk_mask(frame, P, retrieved_ok, T, group, query.dtype)
    out = F.scaled_dot_product_attention(
        query,
        k_frame,
        v_frame,
        attn_mask=mask,
        is_causal=causal,
        scale=scaling,
        enable_gqa=group > 1,
    )
    return out.transpose(1, 2)


def chunk_mask(
    frame: FrameState,
    P: int,
    retrieved_ok: torch.Tensor | None,
    T: int,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """Additive mask (1, 1 or H, T, P + T) for a chunk of T tokens after a prefix of P slots,
    all visible except retrieval padding (retrieved_ok (kv_heads, R) False, the R slots right
    after the sinks); None when nothing is hidden (one token, no padding). Without padding
    (reading a chunk, or retrieval that filled its budget) one (1, 1, T, P + T) mask is shared
    by all heads and, cached per forward (FrameState.mask_cache), by all layers
    (docs/decisions/017-frame-copies-and-masks.md)."""
    hidden = torch.finfo(dtype).min
    device = frame.device
    if retrieved_ok is None:
        if T == 1:
            return None
        cached = frame.mask_cache.get((P, T, dtype))
        if cached is None:
            cached = torch.zeros(T, P + T, dtype=dtype, device=device)
            cached[:, P:].masked_fill_(
                torch.ones(T, T, dtype=torch.bool, device=device).triu(1), hidden
            )
            cached = frame.mask_cache[(P, T, dtype)] = cached[None, None]
        return cached
    kvh, R = retrieved_ok.shape
    prefix = torch.zeros(kvh, P, dtype=dtype, device=device)
    prefix[:, frame.n_sinks : frame.n_sinks + R].masked_fill_(~retrieved_ok, hidden)
    causal = torch.zeros(T, T, dtype=dtype, device=device)
    causal.masked_fill_(torch.ones_like(causal, dtype=torch.bool).triu(1), hidden)
    mask = torch.cat(
        (prefix[:, None, :].expand(kvh, T, P), causal[None].expand(kvh, T, T)), dim=2
    )  # (kv_heads, T, F)
    return mask.repeat_interleave(group, dim=0)[None]
