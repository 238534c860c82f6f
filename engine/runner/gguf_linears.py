"""A GGUF model's linear layers kept on the grids its file holds them on, type by type
(docs/decisions/067-gguf-types-kept.md): transformers' GGUF loader dequantizes every tensor to
float; `keep_gguf_linears` replaces each decoder linear and the output head whose type
engine/runner/gguf_grids.py reads with a layer that multiplies the file's own codes.

    Q4_0, Q4_1, Q4_K         Int4Linear (4-bit codes, a scale and a minimum per 32)
    Q5_0, Q5_1, Q5_K, Q8_0   Int8Linear (int8 codes, a scale per 32, minimums where the type has)
    Q6_K                     Int8Linear (int8 codes, a scale per 16)
    any other type           the decoder linear stays as loaded (float); the head goes to
                             Int8Linear's own Q8_0 grid, as under linear_dtype "int4"

A grid is kept only where it gives back, to within rounding, the weights transformers loaded
for that module: a file whose rows it reorders some other way keeps that module as loaded.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from engine.runner.gguf_grids import FOUR_BIT, HEAD, Grid, read_grids
from engine.runner.quant_linears import Int4Linear, Int8Linear

logger = logging.getLogger(__name__)

FLOAT = "float"  # the count of `keep_gguf_linears` for decoder linears left as loaded


def keep_gguf_linears(model: Any, path: Path) -> Counter[str]:
    """Replace the linears of `model` (a Llama-shaped causal LM transformers loaded from the
    GGUF at `path`) that the file holds on a grid read here; returns how many linears each type
    kept, FLOAT for the decoder linears left as loaded."""
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(cfg.num_key_value_heads or heads)
    modules = dict(model.named_modules())
    kept: Counter[str] = Counter()
    for name, grid in read_grids(path, heads, kv_heads):
        linear = modules.get(name)
        if not isinstance(linear, torch.nn.Linear) or not _gives_back(grid, linear.weight):
            logger.warning(
                "%s (%s): the file's grid is not the loaded weight; kept as loaded", name, grid.kind
            )
            continue
        _replace(model, name, kept_linear(grid, linear.bias, head=name == HEAD))
        kept[grid.kind] += 1
    head = modules.get(HEAD)  # still the loaded one where no grid replaced it
    if (
        head is model.get_output_embeddings()
        and isinstance(head, torch.nn.Linear)
        and head.bias is None
    ):
        _replace(model, HEAD, Int8Linear(head))  # as under "int4": the largest single read
        kept["Q8_0 (re-quantized head)"] += 1
    kept[FLOAT] = sum(
        1
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("model.layers.")
    )
    return kept


def kept_linear(grid: Grid, bias: torch.Tensor | None, head: bool = False) -> torch.nn.Module:
    """The layer multiplying `grid`'s weights (plus `bias`): an Int4Linear for 4-bit types,
    else an Int8Linear, which keeps a dense copy for prefill unless it is the `head`."""
    bias = None if bias is None else bias.detach()
    if grid.kind in FOUR_BIT:
        assert grid.mins is not None  # every 4-bit type has a minimum per 32
        return Int4Linear.from_grid(grid.codes, grid.scales, grid.mins, bias)
    return Int8Linear.from_grid(grid.codes, grid.scales, grid.mins, bias, dense=not head)


def _gives_back(grid: Grid, weight: torch.Tensor) -> bool:
    """Whether the grid's weights are `weight` (N, K) to within its dtype's rounding."""
    if grid.codes.shape != weight.shape:
        return False
    want = weight.detach().float()
    got = grid.dequantized().to(weight.dtype).float()
    rtol = 1e-6 if weight.dtype == torch.float32 else float(torch.finfo(weight.dtype).eps)
    return torch.allclose(got, want, rtol=rtol, atol=1e-6 * float(want.abs().max()))


def _replace(model: Any, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
