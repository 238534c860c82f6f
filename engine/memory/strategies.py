"""The strategies a session memory can use, and the selector each one plugs into the frame."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.memory.config import FrameConfig, NeurocacheConfig, SegmentsConfig, TokensConfig
from engine.memory.neurocache import NeurocacheSelector
from engine.memory.projections import Projections
from engine.memory.segments import SegmentSelector
from engine.memory.selector import Selector
from engine.memory.tokens import TokenSelector
from engine.protocol import InvalidRequest

if TYPE_CHECKING:
    from transformers import PreTrainedModel

STRATEGIES: tuple[str, ...] = ("segments", "tokens", "neurocache")


def new_selector(
    config: FrameConfig,
    model: PreTrainedModel,
    projections: Projections | None,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
) -> Selector:
    """The selector of `config`'s strategy; shape: (layers, kv_heads, head_dim) of the model."""
    num_layers, kv_heads, head_dim = shape
    if isinstance(config, SegmentsConfig):
        return SegmentSelector(config, num_layers, kv_heads, head_dim, dtype, device)
    if isinstance(config, TokensConfig):
        return TokenSelector(config, num_layers, kv_heads, head_dim, device)
    if isinstance(config, NeurocacheConfig):
        return NeurocacheSelector(config, model, projections)
    raise InvalidRequest(
        f"unknown strategy config {type(config).__name__}", param="memory.strategy"
    )
