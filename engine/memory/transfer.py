"""A memory's encodings in and out, without the model where it can: a chunk forwarded and
exported for the memory store (`ingest_chunk`), a stored chunk taken back (`import_chunk`),
and the commits of one request recorded as a turn and replayed on another replica
(`start_turn`, `take_turn`, `import_turn`; engine/memory/turns.py). SessionMemory
(session.py) is the one class that uses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.memory.prior import PRIOR_META, pack_rows, unpack_rows
from engine.memory.turns import TurnEncoding
from engine.protocol import InvalidRequest
from memory_store.client import ChunkEncoding

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine.memory.frame import Frame
    from engine.memory.prior import TextPrior
    from engine.memory.selector import Selector


class EncodingTransfer:
    """SessionMemory's encodings in and out; the state below is SessionMemory's."""

    model: PreTrainedModel
    strategy: str
    prior: TextPrior | None
    _frame: Frame
    _selector: Selector
    _last_logits: torch.Tensor | None
    _turn: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor], dict]] | None

    def reload(self) -> None:
        raise NotImplementedError

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _commit(self, ids: torch.Tensor) -> None:
        raise NotImplementedError

    # -- the memory store: one forward's encodings out, and back in without the model --------

    def ingest_chunk(
        self, input_ids: torch.Tensor, text: str = ""
    ) -> tuple[torch.Tensor, ChunkEncoding]:
        """Forward input_ids (T,) as ONE chunk and export its encodings: per layer the
        pre-rotary K/V (kv_heads, T, head_dim) in fp16, plus the strategy's own state.

        The session commits the fp16 copy it exported, so it holds exactly what a session
        rebuilt from the encoding holds (write-through). Returns (logits (vocab,), encoding).
        """
        self.reload()
        ids = input_ids.reshape(-1)
        if ids.numel() == 0:
            raise InvalidRequest("nothing to read: input_ids is empty", param="input_ids")
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            logits = self._forward(ids.to(device))
            try:
                keys, values = self._frame.pending_chunk()
                meta = {"strategy": self.strategy, **self._selector.export_chunk_state()}
                encoding = ChunkEncoding(
                    keys=tuple(k.to(torch.float16).cpu().numpy() for k in keys),
                    values=tuple(v.to(torch.float16).cpu().numpy() for v in values),
                    token_ids=ids.cpu().numpy().astype(np.int64),
                    text=text,
                    embedding=np.zeros(0, dtype=np.float32),
                    meta=meta,
                )
                self._take(encoding, forwarded=True)
            except BaseException:
                self._frame.abort()
                raise
            embedded = self.prior.num_embedded if self.prior is not None else 0
            self._commit(ids)
        if self.prior is not None:  # EmbD of the blocks this chunk moved to memory
            encoding.meta[PRIOR_META] = pack_rows(self.prior.embedded_since(embedded))
        self._last_logits = logits
        return logits, encoding

    def import_chunk(self, encoding: ChunkEncoding) -> None:
        """Append the encoding's tokens as if they had been forwarded (sinks, window, memory
        blocks, summaries, indices), with no model forward. The last logits are forgotten: a
        later append computes fresh ones."""
        num_new = encoding.num_tokens
        if num_new == 0:
            return
        self.reload()
        if len(encoding.keys) != len(self._frame.layers):
            raise InvalidRequest(
                f"encoding has {len(encoding.keys)} layers, the model {len(self._frame.layers)}",
                param="encoding",
            )
        with torch.inference_mode():
            self._frame.begin_import(num_new)
            try:
                self._take(encoding, forwarded=False)
            except BaseException:
                self._frame.abort()
                raise
            self._commit(torch.as_tensor(np.asarray(encoding.token_ids, dtype=np.int64)))
        self._last_logits = None

    # -- turns: what one request committed, out and back in (engine/memory/turns.py) --------

    def start_turn(self) -> None:
        """Record every commit from now on, until `take_turn`."""
        self._turn = []

    def take_turn(self) -> TurnEncoding:
        """What was committed since `start_turn`, in commits; recording stops."""
        turn, self._turn = self._turn or [], None
        return TurnEncoding.of_commits(turn)

    def import_turn(self, enc: TurnEncoding) -> None:
        """Commit a recorded turn's pieces as they were committed, with no model forward."""
        if enc.keys and len(enc.keys) != len(self._frame.layers):
            raise InvalidRequest(
                f"turn has {len(enc.keys)} layers, the model {len(self._frame.layers)}",
                param="turn",
            )
        self.reload()
        with torch.inference_mode():
            for piece, state in enc.pieces():
                self._frame.begin_import(piece.stop - piece.start)
                try:
                    self._frame.replace_pending(
                        [k[:, piece] for k in enc.keys], [v[:, piece] for v in enc.values]
                    )
                    self._selector.import_chunk_state(state, forwarded=False)
                except BaseException:
                    self._frame.abort()
                    raise
                self._commit(torch.tensor(enc.token_ids[piece], dtype=torch.long))
        self._last_logits = None

    def _take(self, encoding: ChunkEncoding, forwarded: bool) -> None:
        self._frame.replace_pending(
            [torch.from_numpy(np.array(k, dtype=np.float16)) for k in encoding.keys],
            [torch.from_numpy(np.array(v, dtype=np.float16)) for v in encoding.values],
        )
        self._selector.import_chunk_state(encoding.meta, forwarded)
        if not forwarded and self.prior is not None and PRIOR_META in encoding.meta:
            self.prior.give(unpack_rows(encoding.meta[PRIOR_META]))
