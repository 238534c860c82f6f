"""`neurocache`: Neurocache's compressed cache, training-free, over the frame's memory.

The output h_r of decoder layer r (default: layer num_layers // 6; the paper's 3/4 of the depth
needs its trained cache attention, see config.py) is
compressed to c = W_p h_r (d = hidden/4 by default) for every token that enters memory; the
compressed states form the cache (one entry per memory token, FIFO with the frame's m). A
forward chunk makes exactly ONE kNN retrieval (L2, as in the paper) over the cache with its own
compressed states, right after layer r has run; each hit is extended by the retrieval window w
(the hit and its w-1 right neighbours, the paper's w=2 setting), and the sets retrieved by the
previous c-1 forwards are added (extended cache attention: a decode step sees its own and the
previous c-1 tokens' retrievals). Every layer j > r attends to the retrieved positions' stored
keys and values through the frame; layers up to r attend to sinks + local window + chunk.

W_p without training: PCA of the session's own layer-r states. Until the memory holds
`fit_tokens` tokens the cache searches the raw h_r (hidden dims); then W_p (the top-d
principal directions) and the mean are fitted on all states held, and refitted each time the
memory has doubled since (amortised O(1) per token), so directions that only later text
uses are not projected away. The raw states are kept for the refits: hidden floats per token,
about 5% of what the frame's keys and values take (2 x layers x kv_heads x head_dim). A trained
projection ({"weight": (d, hidden), "mean": (hidden,)}) can be named by its id (`projection`)
instead: a file the operator placed in the projection directory (projections.py). The
paper's trained cache-attention weights are not used: layers j > r reuse their own self-attention on the retrieved keys and values, which is
what the paper initialises cache attention with.

A multi-token chunk's one retrieval uses up to `max_queries` of its tokens (evenly spaced, the
last one in); their hits are merged rank by rank, the last token first, and the first k kept
(ranking.fair_union: ranking by raw score lets the chunk's filler rows, which have near-exact
copies in memory, take every slot from the last token's).

Defaults (NeurocacheConfig): k 64 (the paper's setting for adapted pretrained models), w 2,
c 2, r = num_layers // 6, d = hidden/4, fit_tokens 1024, sinks 64, local window 1024, block 64.
"""

from __future__ import annotations

import base64
import copy
import time
import weakref
from collections import deque
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from engine.memory.buffers import LayerStore
from engine.memory.config import NeurocacheConfig
from engine.memory.index import VectorIndex
from engine.memory.projections import PARAM as PROJECTION_PARAM
from engine.memory.projections import Projections
from engine.memory.ranking import fair_union, query_rows
from engine.memory.selector import Selector
from engine.protocol import InvalidRequest
from engine.runner.attention import FRAME_KWARG, KV_KWARG
from engine.runner.rows import RowBatch


class NeurocacheSelector(Selector):
    def __init__(
        self,
        config: NeurocacheConfig,
        model: PreTrainedModel,
        projections: Projections | None = None,
    ) -> None:
        """projections: where `config.projection` is looked up (None: no id is known)."""
        self.config = config
        num_layers = model.config.num_hidden_layers
        self.hidden = model.config.hidden_size
        self.r = config.r if config.r >= 0 else num_layers // 6
        if self.r >= num_layers - 1:
            raise InvalidRequest(
                "memory.r must leave at least one layer above it", param="memory.r"
            )
        self.d = config.d or self.hidden // 4
        if self.d > self.hidden:
            raise InvalidRequest("memory.d must not exceed the hidden size", param="memory.d")
        self.device = next(model.parameters()).device
        self.weight: torch.Tensor | None = None  # (d, hidden)
        self.mean: torch.Tensor | None = None  # (hidden,)
        if config.projection:
            self._load_projection(projections or Projections(None, 0), config.projection)
        self.cache: VectorIndex = VectorIndex(
            self.d if self.weight is not None else self.hidden, "auto", "l2", self.device
        )
        self._raw = VectorIndex(self.hidden, "torch", "l2", self.device)  # raw h_r, for refits
        self._fitted_at = 0
        self.frame = None  # set by the session; the hook acts for it only
        self.seconds = 0.0
        self._chunk_h: torch.Tensor | None = None  # (T, hidden) layer-r output of the chunk
        self._retrieved_window: torch.Tensor | None = None  # the chunk's own, until commit
        self._window_h = torch.empty(0, self.hidden, device=self.device)
        self._previous: deque[torch.Tensor] = deque(maxlen=max(config.c - 1, 1))
        self._current: torch.Tensor | None = None  # memory indices retrieved for this chunk
        self._expanded: tuple[torch.Tensor, torch.Tensor] | None = None  # (_current, its rows)
        self._window: torch.Tensor | None = None  # this chunk's own hits + window (for export)
        self._layer = model.get_decoder().layers[self.r]
        self._hook_layer_r()

    def _hook_layer_r(self) -> None:
        # the hook holds the selector weakly: a bound method in the model's hook dict would
        # keep every selector (and through `frame` its whole session) alive with the model
        selector = weakref.ref(self)

        def after_layer_r(module, args, kwargs, output):
            alive = selector()
            return None if alive is None else alive._after_layer_r(module, args, kwargs, output)

        handle = self._layer.register_forward_hook(after_layer_r, with_kwargs=True)
        weakref.finalize(self, handle.remove)

    def __deepcopy__(self, memo: dict[int, Any]) -> NeurocacheSelector:
        """A forked session's selector: its own state, and its own hook on layer r (the hook
        acts only for the frame it belongs to). `memo` must hold the model's modules."""
        twin = object.__new__(type(self))
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            setattr(twin, name, copy.deepcopy(value, memo))
        twin._hook_layer_r()
        return twin

    def _load_projection(self, projections: Projections, projection_id: str) -> None:
        weight, mean = projections.load(projection_id)
        if weight.shape != (self.d, self.hidden) or mean.shape != (self.hidden,):
            raise InvalidRequest(
                f"projection {projection_id!r} must be ({self.d}, {self.hidden}) with a "
                f"({self.hidden},) mean",
                param=PROJECTION_PARAM,
            )
        self.weight, self.mean = weight.to(self.device), mean.to(self.device)

    # -- the one retrieval, after layer r ---------------------------------------------------

    def _after_layer_r(self, module, args, kwargs, output):
        row = self._row(kwargs)
        if row is None:
            return None
        h = (output[0] if isinstance(output, tuple) else output)[row]  # (T, hidden)
        self._chunk_h = h.float()
        self._current = None
        self._window = None
        if self.cache.ntotal and self.config.retrieves(h.shape[0]):
            start = time.perf_counter()
            self._current = self._retrieve(self._chunk_h)
            self.seconds += time.perf_counter() - start
        return None

    def _row(self, kwargs: dict[str, Any]) -> int | None:
        """The row of the forward that reads this selector's frame: 0 for the frame's own
        forward, the frame's row in a batched decode forward (engine/runner/rows.py), else None."""
        if self.frame is None:
            return None
        if kwargs.get(FRAME_KWARG) is self.frame:
            return 0
        batch = kwargs.get(KV_KWARG)
        return batch.row_of(self.frame) if isinstance(batch, RowBatch) else None

    def _compress(self, h: torch.Tensor) -> torch.Tensor:
        if self.weight is None or self.mean is None:  # set together
            return h
        return (h - self.mean) @ self.weight.T

    def _retrieve(self, h: torch.Tensor) -> torch.Tensor:
        c = self.config
        rows = h[query_rows(h.shape[0], c.max_queries).to(h.device).flip(0)]  # last first
        _, ids = self.cache.search(self._compress(rows), c.k)
        hits = fair_union(ids, c.k)
        window = (hits[:, None] + torch.arange(c.w, device=hits.device)).flatten()
        window = window[window < self.cache.ntotal]
        self._window = window
        retrieved = torch.cat([window, *self._previous]) if c.c > 1 else window
        if c.c > 1:
            self._retrieved_window = window  # joins the history once the forward commits
        return retrieved.unique()  # ascending: document order

    def select(
        self, layer: int, q_pre: torch.Tensor, store: LayerStore, scaling: float
    ) -> torch.Tensor | None:
        if layer <= self.r or self._current is None:
            return None
        # one tensor for every layer of the forward: the frame then rotates the rows' keys at
        # angles it computed once (RowReader.take_rotated)
        kept = self._expanded
        if kept is None or kept[0] is not self._current or kept[1].shape[0] != q_pre.shape[0]:
            rows = self._current[None].expand(q_pre.shape[0], -1).to(q_pre.device)
            kept = self._expanded = (self._current, rows)
        return kept[1]

    # -- bookkeeping, driven by the frame ---------------------------------------------------

    def on_commit(self, num_new: int, to_sinks: int) -> None:
        assert self._chunk_h is not None
        self._window_h = torch.cat((self._window_h, self._chunk_h[to_sinks:]))
        self._chunk_h = None
        if self._retrieved_window is not None:
            self._previous.appendleft(self._retrieved_window)
            self._retrieved_window = None

    def mark_state(self) -> Any:
        return list(self._previous)

    def on_rewind(self, n_local: int, state: Any) -> None:
        self._window_h = self._window_h[:n_local]
        self._previous.clear()
        self._previous.extend(state)

    def export_chunk_state(self, precise: bool = False) -> dict[str, Any]:
        """The forwarded chunk's layer-r states (fp16, or fp32 when precise) and its own
        retrieval window: what rebuilding the cache and the extended cache attention needs
        without the model."""
        assert self._chunk_h is not None, "no forwarded chunk to export"
        kind = "<f4" if precise else "<f2"
        h = self._chunk_h.float().cpu().numpy().astype(kind)  # (T, hidden)
        window = None if self._window is None else self._window.tolist()
        return {
            "neurocache_h": base64.b64encode(h.tobytes()).decode("ascii"),
            "neurocache_h_shape": list(h.shape),
            "neurocache_h_dtype": kind,
            "neurocache_window": window,
        }

    def import_chunk_state(self, state: dict[str, Any], forwarded: bool) -> None:
        shape = tuple(state["neurocache_h_shape"])
        raw = base64.b64decode(state["neurocache_h"])
        h = np.frombuffer(raw, dtype=state.get("neurocache_h_dtype", "<f2")).reshape(shape)
        self._chunk_h = torch.from_numpy(h.astype(np.float32)).to(self.device)
        window = state.get("neurocache_window")
        if not forwarded and window is not None and self.config.c > 1:
            self._previous.appendleft(torch.tensor(window, dtype=torch.long, device=self.device))

    def on_abort(self) -> None:
        self._chunk_h = None
        self._current = None
        self._retrieved_window = None

    def on_memory_added(self, layer: int, k_pre: torch.Tensor, v: torch.Tensor) -> None:
        if layer != 0:
            return
        n = k_pre.shape[1]
        block, self._window_h = self._window_h[:n], self._window_h[n:]
        self.cache.add(self._compress(block))
        c = self.config
        if c.projection:
            return
        self._raw.add(block)
        held = self._raw.ntotal
        if held >= c.fit_tokens and held >= 2 * self._fitted_at:
            self._fit(self._raw.vectors())
            self._fitted_at = held

    def _fit(self, states: torch.Tensor) -> None:
        """PCA of the raw states held; re-index them all compressed."""
        self.mean = states.mean(dim=0)
        _, _, vh = torch.linalg.svd(states - self.mean, full_matrices=False)
        self.weight = vh[: self.d]
        compressed = self._compress(states)
        self.cache = VectorIndex(self.d, "auto", "l2", self.device)
        self.cache.add(compressed)

    def on_memory_dropped(self, layer: int, n: int) -> None:
        if layer != 0:
            return
        self.cache.drop_front(n)
        if self._raw.ntotal:
            self._raw.drop_front(n)
        shifted = [p - n for p in self._previous]
        self._previous.clear()
        self._previous.extend(p[p >= 0] for p in shifted)

    def to(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cache.to(device)
        self._raw.to(device)
        self._window_h = self._window_h.to(device)
        if self.weight is not None and self.mean is not None:
            self.weight, self.mean = self.weight.to(device), self.mean.to(device)
        previous = [p.to(device) for p in self._previous]
        self._previous.clear()
        self._previous.extend(previous)
        self._current = None if self._current is None else self._current.to(device)

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def nbytes(self) -> int:
        window = self._window_h.numel() * self._window_h.element_size()
        return self.cache.nbytes() + self._raw.nbytes() + window
