"""`tokens`: Unlimiformer for decoder-only models, over the frame's memory.

Every augmented layer keeps one kNN index per KV head over its memory tokens' pre-rotary keys
(engine/memory/index.py); a forward chunk searches it with its pre-rotary queries and the
layer attends to the top-k tokens per KV head, in document order, through the frame. Layers
that are not augmented attend to sinks + local window + chunk only. Keys, not hidden states,
are indexed: with GQA the query heads of a group share one key space, so one index per KV head
serves them all (Unlimiformer's decoder path indexes hidden states and breaks on GQA).

Staleness fix: every token appended - prompt, document or generated - is indexed the moment it
leaves the local window (until then it is attended directly), so no token is ever out of
reach; the paper's fix adds each generated token to the indices at once, which in a frame
with a local window is the same thing.

Overlapping chunk encoding: each chunk attends to the previous `local_window` tokens (the
overlap), and each token is stored once, on its first reading ("keep every non-overlapping
token").

Multi-token chunks: up to `max_queries` rows per KV head (query heads of the group x evenly
spaced chunk tokens, the last token always in) each fetch their top-k; the hits are merged
rank by rank with the last token's rows first and the first k distinct kept (ranking.fair_union).

Scoring: queries are rotated by their distance to the retrieved span before the search
(FrameState.query_at_retrieval_distance), so a key's score is the logit it will get in the
frame, not the logit it would get at distance zero. Both are departures from the paper, which
searches with each token's own query for that token alone
(docs/decisions/016-tokens-search.md).

Search (`index`): "sketch", what "auto" picks on a CPU, keeps a float16 dimension-major copy
of the keys (key_sketch.py) and scores every key exactly from it, streamed
(docs/decisions/051-tokens-exact-scan.md). The other backends keep one VectorIndex per KV head
over fp32 keys (index.py), exact under "torch".

Defaults (TokensConfig): k 256, all layers augmented (the paper tunes a few upper layers per
model; without tuning, all layers keep the model's own attention pattern everywhere), index
"auto", sinks 64, local window 1024, block 64, chunk 512.
"""

from __future__ import annotations

import torch

from engine.memory.buffers import LayerStore
from engine.memory.config import TokensConfig, parse_layers
from engine.memory.frame_state import FrameState
from engine.memory.index import VectorIndex
from engine.memory.key_sketch import KeySketch, search
from engine.memory.ranking import fair_union, padded_rows, query_rows
from engine.memory.selector import Selector


class TokenSelector(Selector):
    def __init__(
        self,
        config: TokensConfig,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device,
    ) -> None:
        self.config = config
        self.layers = set(parse_layers(config.layers, num_layers))
        self.frame: FrameState | None = None  # set by the session: query positions
        # "sketch": one KeySketch per layer; else one VectorIndex per layer and KV head
        self.sketched = config.index == "sketch" or (
            config.index == "auto" and torch.device(device).type == "cpu"
        )
        self.sketches: dict[int, KeySketch] = {}
        self.indices: dict[int, list[VectorIndex]] = {}
        for layer in self.layers:
            if self.sketched:
                self.sketches[layer] = KeySketch(kv_heads, head_dim, device)
            else:
                self.indices[layer] = [
                    VectorIndex(head_dim, config.index, "ip", device) for _ in range(kv_heads)
                ]

    def on_memory_added(self, layer: int, k_pre: torch.Tensor, v: torch.Tensor) -> None:
        if layer in self.sketches:
            self.sketches[layer].add(k_pre)
        for head, index in enumerate(self.indices.get(layer, ())):
            index.add(k_pre[head])

    def on_memory_dropped(self, layer: int, n: int) -> None:
        if layer in self.sketches:
            self.sketches[layer].drop_front(n)
        for index in self.indices.get(layer, ()):
            index.drop_front(n)

    def select(
        self, layer: int, q_pre: torch.Tensor, store: LayerStore, scaling: float
    ) -> torch.Tensor | None:
        if layer not in self.layers or not self.config.retrieves(q_pre.shape[2]):
            return None
        kvh, group, T, d = q_pre.shape
        if self.sketched and T == 1 and self.frame is not None:
            # a decode step: its group's rows as they come, rotated to the retrieval distance
            # inside the search (the torch ops below cost ~5 ms a step at 32K: decision 048)
            distance = self.frame.step_retrieval_distance()
            return self._search_sketch(layer, q_pre.reshape(kvh, group, d), distance)
        rows_t = query_rows(T, max(1, self.config.max_queries // group)).to(q_pre.device)
        queries = q_pre[:, :, rows_t]  # (kv_heads, group, rows, d)
        if self.frame is not None:
            queries = self.frame.query_at_retrieval_distance(queries, rows_t)
        # rank order wants the last token's rows first: (kv_heads, rows * group, d)
        queries = queries.flip(2).transpose(1, 2).reshape(kvh, -1, d)
        if self.sketched:
            return self._search_sketch(layer, queries)
        picked = []
        for head, index in enumerate(self.indices[layer]):
            _, ids = index.search(queries[head], self.config.k)
            picked.append(fair_union(ids, self.config.k))
        return padded_rows(picked, q_pre.device)

    def _search_sketch(
        self, layer: int, queries: torch.Tensor, position: int | None = None
    ) -> torch.Tensor:
        """queries (kv_heads, rows, d) in rank order, rotated by `position` first if given ->
        memory rows (kv_heads, width)."""
        frame = self.frame
        assert frame is not None, "the session sets the frame before it forwards"
        sketch = self.sketches[layer]
        rows = search(queries.to(sketch.data.device), sketch, frame.rotary, self.config.k, position)
        return rows.to(queries.device)

    def to(self, device: torch.device) -> None:
        for sketch in self.sketches.values():
            sketch.to(device)
        for per_layer in self.indices.values():
            for index in per_layer:
                index.to(device)

    def nbytes(self) -> int:
        held = sum(s.nbytes() for s in self.sketches.values())
        return held + sum(i.nbytes() for per_layer in self.indices.values() for i in per_layer)
