"""Answer adapters: low-rank updates (LoRA, Hu et al. 2021) to every layer's q, k and v that a
request names by model id (as vLLM serves LoRA modules), applied only where the request
speaks: the prompt's last `lead` tokens (the assistant header) and every token it generates.

The base model reads everything else (documents, sessions, questions), so memories, stored
chunks and prefix caches are the same with or without an adapter, and one session can be
asked with or without one. `longserve adapt` (bench/adapt.py) trains one the same way. The
updates run in the lean decode step (engine/runner/decode_step.py) for the rows whose
`adapter` is set, one row at a time, so a row's numbers do not depend on its batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.runner.decode_state import decode_batch
from engine.runner.decode_step import decoder_of

logger = logging.getLogger(__name__)

SHIPPED = Path(__file__).resolve().parent.parent / "adapters"  # engine/adapters/*.safetensors
TARGETS = ("q", "k", "v")


class AdapterError(ValueError):
    """An adapter file that does not fit the model, or cannot be read."""


@dataclass
class AnswerAdapter:
    """One adapter: per layer, A (3r, hidden) stacking q's, k's and v's, and B (q|k|v out, 3r)
    block-diagonal, so that a row's update of the fused q|k|v output is (h A^T) B^T."""

    name: str
    rank: int
    lead: int  # prompt tokens at the end read with the adapter
    a: list[torch.Tensor]
    b: list[torch.Tensor]
    model: Any

    def delta(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The update (1, q|k|v out) of one row's normed hidden state h (1, hidden)."""
        return (h @ self.a[layer].T) @ self.b[layer].T

    def step(self, state: Any, token_id: int) -> torch.Tensor:
        """Append token_id to a decode state with the adapter; logits (vocab,)."""
        return decode_batch(self.model, [state], [token_id], [self])[0]


def read_adapter(path: Path, model: Any, name: str | None = None) -> AnswerAdapter:
    """An adapter file (safetensors: layers.N.{q,k,v}.{A,B}, metadata rank, alpha, lead)
    checked against the model's shapes. AdapterError where it does not fit."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
        rank, alpha, lead = int(meta["rank"]), float(meta["alpha"]), int(meta["lead"])
    except (OSError, KeyError, ValueError, SafetensorError) as e:
        raise AdapterError(f"cannot read adapter {path}: {e}") from e
    layers = model.model.layers
    if not all(hasattr(layer.self_attn, f"{t}_proj") for layer in layers for t in TARGETS):
        raise AdapterError(f"adapter {path.name}: this model has no separate q, k, v projections")
    dtype = torch.float32
    a_all, b_all = [], []
    for i, layer in enumerate(layers):
        a_parts, b_parts = [], []
        for target in TARGETS:
            linear = getattr(layer.self_attn, f"{target}_proj")
            a = tensors.get(f"layers.{i}.{target}.A")
            b = tensors.get(f"layers.{i}.{target}.B")
            want_a, want_b = (rank, linear.in_features), (linear.out_features, rank)
            if a is None or b is None or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise AdapterError(
                    f"adapter {path.name} does not fit this model at layer {i} {target}: "
                    f"A {None if a is None else tuple(a.shape)} (want {want_a}), "
                    f"B {None if b is None else tuple(b.shape)} (want {want_b})"
                )
            a_parts.append(a.to(dtype))
            b_parts.append(b.to(dtype) * (alpha / rank))
        a_all.append(torch.cat(a_parts).contiguous())
        b_all.append(torch.block_diag(*b_parts).contiguous())
    if len(tensors) != 6 * len(layers):
        raise AdapterError(
            f"adapter {path.name} has {len(tensors)} tensors, want {6 * len(layers)}"
        )
    return AnswerAdapter(name or path.stem, rank, lead, a_all, b_all, model)


def load_adapters(model: Any, model_id: str, paths: Sequence[str] = ()) -> dict[str, AnswerAdapter]:
    """The adapters a model serves, by model id: `<model_id>:<name>` for each shipped adapter
    that fits it (others are skipped, with a log line) and each operator-named one
    ("name=path" or a path, whose stem names it; AdapterError where one does not fit). None
    without the lean decode step, which is where they run."""
    if decoder_of(model) is None:
        if paths:
            raise AdapterError(
                "adapters need the lean decode step (lean_decode, a Llama-family model)"
            )
        return {}
    found: dict[str, AnswerAdapter] = {}
    for path in sorted(SHIPPED.glob("*.safetensors")):
        try:
            adapter = read_adapter(path, model)
        except AdapterError as e:
            logger.info("shipped adapter %s not served: %s", path.name, e)
            continue
        found[f"{model_id}:{adapter.name}"] = adapter
    for spec in paths:
        name, _, where = spec.rpartition("=") if "=" in spec else ("", "", spec)
        adapter = read_adapter(Path(where), model, name or None)
        found[f"{model_id}:{adapter.name}"] = adapter
    for model_name in found:
        logger.info("serving adapter %s", model_name)
    return found
