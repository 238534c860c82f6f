"""The reading band: the attention of a chunk read once memory is in use, and its precision.

A document's body is read without retrieval (FrameConfig.read_retrieval 0, the default); once
the session is longer than sinks + local window, each of a reading chunk's tokens attends the
sinks and a band of at least `read_window` tokens before it instead of the whole local window
(docs/decisions/012-read-band.md), in FrameConfig.read_dtype (docs/decisions/013-read-dtype.md).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.memory.chunk import chunk_mask
from engine.memory.rotary import Angles

if TYPE_CHECKING:
    from engine.memory.frame_state import FrameState

BAND_ROWS = 128  # query rows per attention call of a reading chunk (attend_band)


@functools.cache
def _native_bfloat16(device_type: str) -> bool:
    """Whether this machine multiplies bfloat16 matrices natively (so attention in bfloat16 is
    faster than in fp32 rather than emulated): a CPU with AMX or AVX512-BF16, a CUDA GPU that
    supports bfloat16."""
    if device_type == "cpu":
        cpu = torch.cpu
        return any(
            bool(getattr(cpu, name, lambda: False)())
            for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        )
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return False


def read_dtype(setting: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a reading chunk's band attention computes in (FrameConfig.read_dtype)."""
    if setting == "bfloat16":
        return torch.bfloat16
    if setting == "auto" and model_dtype == torch.float32 and _native_bfloat16(device.type):
        return torch.bfloat16
    return model_dtype


def attend_band(
    frame: FrameState,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window_angles: Angles,
    skip: int,
    scaling: float,
    group: int,
) -> torch.Tensor:
    """Attention of a reading chunk once memory is in use (nothing retrieved): every token
    attends the sinks and at least the `read_window` tokens before it, at most
    read_window + BAND_ROWS - 1 (the window's oldest `skip` tokens are seen by none). Query rows
    go in blocks of BAND_ROWS; the block starting at chunk row s attends the window tokens from
    its s-th newest of the last read_window on, the sinks, and the chunk up to itself, which
    with keys laid out as [window | sinks | chunk] is one contiguous slice: no copy, and a third
    fewer (query, key) pairs than one block attending everything (rotary attention depends only
    on q, k and their distance, so the order of the keys in the slice is free). It computes
    in FrameConfig.read_dtype (bfloat16 on native hardware for an fp32 model)."""
    store = frame.layers[layer]
    window_k = frame.rotary.rotate(store.local_k[:, skip:], window_angles)
    rw, S, T = window_k.shape[1], frame.n_sinks, query.shape[2]
    k_all = torch.cat((window_k, frame.rotated_sinks(layer), key[0]), dim=1)[None]
    v_all = torch.cat((store.local_v[:, skip:], store.sink_v, value[0]), dim=1)[None]
    out = query.new_empty(1, T, query.shape[1], query.shape[3])
    dtype = read_dtype(frame.config.read_dtype, query.dtype, query.device)
    # see FrameConfig.read_dtype (the output is cast back); sinks and window may be float16
    query, k_all, v_all = query.to(dtype), k_all.to(dtype), v_all.to(dtype)
    for s in range(0, T, BAND_ROWS):
        rows = min(BAND_ROWS, T - s)
        start, end = min(s, rw), rw + S + s + rows
        mask = chunk_mask(frame, end - start - rows, None, rows, group, dtype)
        out[:, s : s + rows] = F.scaled_dot_product_attention(
            query[:, :, s : s + rows],
            k_all[:, :, start:end],
            v_all[:, :, start:end],
            attn_mask=mask,
            scale=scaling,
            enable_gqa=group > 1,
        ).transpose(1, 2)
    return out
