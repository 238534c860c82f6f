"""`segments`: CacheFormer's segment caching over the frame's memory blocks.

Each memory block (a segment of `block` tokens) gets a compressed summary per layer and KV
head. A forward chunk scores the summaries with its pre-rotary queries, takes the top-k blocks
per KV head (one retrieval per layer, shared by the query heads of a KV group) and brings them
in uncompressed together with their u neighbouring blocks on each side (CacheFormer's cache
line), in document order.

Scoring a multi-token chunk: every (query head of the group, chunk token) row turns its block
scores into a softmax over blocks; a block's score is the mean of that attention mass over the
rows. A block that matters to a few tokens of a long chunk still scores, and a single decode
token reduces to its own softmax (the same ranking as its raw scores).

Who chooses (`select`): by default the top-k is a consensus. The block scores of a forward
add up over the KV heads and, layer by layer, over the layers so far: layer l retrieves the
top-k of the sum over layers 0..l for all its KV heads. One head's ranking is noisy on prose,
the sum is not. "head" keeps CacheFormer's own choice, per layer and head.

Summaries (`score`): "bound" (default) is an upper bound of the best single-token score in
the block, sum_i max(q_i * max_i, q_i * min_i) over the per-dimension key extremes (as in
Quest), which does not let one strong token drown among 63 ordinary ones; "mean" is the mean
pre-rotary key of the block (CacheFormer's compressed segment).

Why these defaults, with the figures: docs/decisions/014-segments-ranking.md (and
011-read-without-retrieval.md for reading without retrieval).

Defaults (SegmentsConfig): sinks 64, block 64, k 8, u 1, score "bound", select "consensus",
local window 1024, chunk 512, tail 32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.memory.buffers import GrowingBuffer, LayerStore, storage_dtype
from engine.memory.config import SegmentsConfig
from engine.memory.quantized import rounded_outward
from engine.memory.selector import Selector
from engine.runner.cpu_attention import step_kernels


class SegmentSelector(Selector):
    def __init__(
        self,
        config: SegmentsConfig,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        names = ("mean",) if config.score == "mean" else ("max", "min")
        # held as memory blocks are (memory_dtype: float16 for an fp32 model): a decode step
        # reads every summary, and at 32K tokens they are a fifth of what it reads besides weights
        held = storage_dtype(config.memory_dtype, dtype)
        self.held_for_kernels = dtype == torch.float32  # as FrameState.held_for_kernels
        self.summaries = [
            {n: GrowingBuffer(kv_heads, head_dim, held, device) for n in names}
            for _ in range(num_layers)
        ]
        # consensus (select "consensus"): this forward's scores so far, the last finished
        # forward's sum, and the vote that decides for every layer of the forward under way
        self._running: torch.Tensor | None = None
        self._last_layer = -1
        self._last_sum: torch.Tensor | None = None
        self._vote: torch.Tensor | None = None
        # per layer, the last (chosen blocks, their token rows): most decode steps choose the
        # blocks the step before chose, and building rows is a dozen small ops. The choice is a
        # tuple of block indices when every KV head has the same blocks, else a (kv_heads,
        # blocks) mask.
        self._rows: dict[int, tuple[tuple[int, ...] | torch.Tensor, torch.Tensor]] = {}

    def on_memory_added(self, layer: int, k_pre: torch.Tensor, v: torch.Tensor) -> None:
        summary = self.summaries[layer]
        kvh, n, d = k_pre.shape
        blocks = k_pre.reshape(kvh, n // self.config.block, self.config.block, d)
        if self.config.score == "mean":
            summary["mean"].append(blocks.mean(dim=2))
        else:
            held = summary["max"].data.dtype
            summary["max"].append(rounded_outward(blocks.amax(dim=2), held, up=True))
            summary["min"].append(rounded_outward(blocks.amin(dim=2), held, up=False))

    def on_memory_dropped(self, layer: int, n: int) -> None:
        for buf in self.summaries[layer].values():
            buf.drop_front(n // self.config.block)
        if layer == 0 and self._last_sum is not None:
            # the carry scores blocks by where they were: block i is now block i - dropped
            self._last_sum = self._last_sum[n // self.config.block :]

    def block_scores(self, layer: int, q_pre: torch.Tensor, scaling: float) -> torch.Tensor:
        """q_pre (kv_heads, group, T, d) -> attention mass per block (kv_heads, blocks)."""
        kvh, d = q_pre.shape[0], q_pre.shape[-1]
        rows = q_pre.reshape(kvh, -1, d)  # (kv_heads, group*T, d)
        summary = self.summaries[layer]
        one = q_pre.shape[2] == 1 and self.held_for_kernels
        kernels = step_kernels(q_pre) if one else None
        if kernels is not None:  # a decode step: one call (engine/runner/csrc/memory_step.cpp)
            if self.config.score == "mean":
                high, low = summary["mean"].view(), _NONE
            else:
                high, low = summary["max"].view(), summary["min"].view()
            return kernels.block_scores(rows.contiguous(), high, low, scaling)
        views = {name: buf.view().to(rows.dtype).transpose(1, 2) for name, buf in summary.items()}
        if self.config.score == "mean":
            logits = rows @ views["mean"]
        else:
            logits = rows.clamp(min=0) @ views["max"] + rows.clamp(max=0) @ views["min"]
        return (logits * scaling).softmax(dim=-1).mean(dim=1)

    def select(
        self, layer: int, q_pre: torch.Tensor, store: LayerStore, scaling: float
    ) -> torch.Tensor | None:
        c = self.config
        if not c.retrieves(q_pre.shape[2]):
            return None
        num_blocks = store.mem_k.size // c.block
        kvh = q_pre.shape[0]
        device = q_pre.device
        wanted = c.k * (2 * c.u + 1)
        if num_blocks <= wanted:
            return self._same_blocks(layer, range(num_blocks), kvh, device)
        if c.select == "consensus" and q_pre.shape[2] == 1 and self._vote is None:
            kernels = step_kernels(q_pre) if self.held_for_kernels else None
            if kernels is not None:  # a decode step's whole choice in one call
                voted, rows = self._consensus_step(kernels, layer, q_pre, scaling, num_blocks)
                return self._same_blocks(layer, voted, kvh, device, rows)
        scores = self.block_scores(layer, q_pre, scaling)
        if c.select == "consensus":  # the same blocks for every KV head
            scores = self._consensus(layer, scores.sum(dim=0), q_pre.shape[2])
            best = scores.topk(c.k).indices.tolist()
            near = range(-c.u, c.u + 1)
            blocks = {min(max(t + o, 0), num_blocks - 1) for t in best for o in near}
            return self._same_blocks(layer, sorted(blocks), kvh, device)
        top = scores.topk(c.k, dim=-1).indices  # (kv_heads, k)
        lines = top[..., None] + torch.arange(-c.u, c.u + 1, device=device)
        lines = lines.clamp(0, num_blocks - 1).reshape(kvh, -1)
        chosen = torch.zeros(kvh, num_blocks, dtype=torch.bool, device=device)
        chosen.scatter_(1, lines, True)
        last = self._rows.get(layer)
        if last is not None and _same_choice(last[0], chosen):
            return last[1]
        rows = blocks_to_tokens(chosen, c.block)
        self._rows[layer] = (chosen, rows)
        return rows

    def _same_blocks(
        self,
        layer: int,
        blocks: Sequence[int],
        kvh: int,
        device: torch.device,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token rows (kv_heads, R) of these blocks (ascending) for every KV head (`rows`, when
        the caller has them); the tensor the layer's last step returned when it chose the same
        blocks."""
        chosen = tuple(blocks)
        last = self._rows.get(layer)
        if last is not None and last[0] == chosen:
            return last[1]
        if rows is not None:
            self._rows[layer] = (chosen, rows)
            return rows
        block = self.config.block
        starts = torch.tensor(chosen, dtype=torch.long, device=device) * block
        rows = (starts[:, None] + torch.arange(block, device=device)).reshape(1, -1)
        rows = rows.expand(kvh, -1).contiguous()
        self._rows[layer] = (chosen, rows)
        return rows

    def _consensus_step(
        self, kernels: Any, layer: int, q_pre: torch.Tensor, scaling: float, num_blocks: int
    ) -> tuple[list[int], torch.Tensor]:
        """A decode step's blocks under "consensus", and their rows (kv_heads, R), from
        engine/runner/csrc/memory_step.cpp: what block_scores, _consensus (running sum plus the carry),
        topk, the neighbours and _same_blocks compute in Python, in one call (a layer's
        selection was a dozen small ops)."""
        summary = self.summaries[layer]
        if self.config.score == "mean":
            high, low = summary["mean"].view(), _NONE
        else:
            high, low = summary["max"].view(), summary["min"].view()
        running = self._running
        if layer <= self._last_layer or running is None or running.shape[0] != num_blocks:
            running = _NONE  # a new forward (or memory grew): start the sum
        carry = _NONE if self._last_sum is None else self._last_sum
        kvh, d = q_pre.shape[0], q_pre.shape[-1]
        rows = q_pre.reshape(kvh, -1, d).contiguous()
        c = self.config
        self._running, blocks, token_rows = kernels.consensus_step(
            rows, high, low, scaling, running, carry, c.k, c.u, c.block
        )
        self._last_layer = layer
        return blocks, token_rows

    def _consensus(self, layer: int, scores: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Add a layer's block scores (blocks,) to this forward's running sum (a forward
        selects layer by layer, 0 upwards) and return what this layer ranks by: the vote, when
        a voting pass ran for this forward; for a single token (a decode step) the running sum
        plus the last forward's whole sum, so its lower layers, which have few votes of their
        own yet, follow what the previous token's layers agreed on; else the running sum."""
        running = self._running
        if layer <= self._last_layer or running is None or running.shape != scores.shape:
            running = scores.clone()
        else:
            running = running + scores
        self._running, self._last_layer = running, layer
        if self._vote is not None:
            return _fit(self._vote, scores.shape[0])
        if num_tokens == 1 and self._last_sum is not None:
            return running + _fit(self._last_sum, scores.shape[0])
        return running

    def wants_vote(self, num_tokens: int) -> bool:
        """Whether a forward of num_tokens should first run as a voting pass: a question's
        tail (more than one token, retrieving, not a reading chunk) under "consensus", when
        memory holds more blocks than it would bring in anyway."""
        c = self.config
        blocks = next(iter(self.summaries[0].values())).size if self.summaries else 0
        return (
            c.select == "consensus"
            and 1 < num_tokens <= c.tail
            and c.retrieves(num_tokens)
            and blocks > c.k * (2 * c.u + 1)
        )

    def hold_vote(self) -> None:
        """The finished (aborted) voting pass's sum over every layer decides, for every layer,
        the next forward's blocks."""
        self._vote = self._last_sum

    def mark_state(self) -> Any:
        return self._last_sum

    def on_rewind(self, n_local: int, state: Any) -> None:
        self._last_sum = state

    def on_commit(self, num_new: int, to_sinks: int) -> None:
        self._finish()

    def on_abort(self) -> None:
        self._finish()

    def _finish(self) -> None:
        self._last_sum = self._running
        self._running, self._last_layer, self._vote = None, -1, None

    def to(self, device: torch.device) -> None:
        self._running, self._last_layer, self._vote = None, -1, None
        self._rows = {}
        if self._last_sum is not None:
            self._last_sum = self._last_sum.to(device)
        for summary in self.summaries:
            for buf in summary.values():
                buf.to(device)

    def nbytes(self) -> int:
        return sum(b.nbytes() for s in self.summaries for b in s.values())


def _same_choice(last: torch.Tensor | tuple, chosen: torch.Tensor) -> bool:
    return (
        isinstance(last, torch.Tensor) and last.shape == chosen.shape and torch.equal(last, chosen)
    )


def _fit(scores: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Scores of an earlier forward, cut or zero-padded to num_blocks (memory grows between
    forwards; FIFO drops shift the carry in on_memory_dropped, and a vote lasts one forward)."""
    if scores.shape[0] >= num_blocks:
        return scores[:num_blocks]
    return torch.cat((scores, scores.new_zeros(num_blocks - scores.shape[0])))


_NONE = torch.empty(0)  # block_scores' low summaries under score "mean"


def blocks_to_tokens(chosen: torch.Tensor, block: int) -> torch.Tensor:
    """chosen (kv_heads, blocks) bool -> token indices (kv_heads, R) ascending, -1 padded."""
    counts = chosen.sum(dim=1)
    width = int(counts.max()) if chosen.numel() else 0
    # Stable sort puts each head's chosen blocks first, in document order.
    order = (~chosen).to(torch.int8).sort(dim=1, stable=True).indices[:, :width]
    valid = torch.arange(width, device=chosen.device)[None] < counts[:, None]
    tokens = order[..., None] * block + torch.arange(block, device=chosen.device)
    valid = valid[..., None].expand_as(tokens)
    return torch.where(valid, tokens, -1).reshape(chosen.shape[0], -1)
