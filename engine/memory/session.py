"""A session's memory: the object the generation loop reads tokens into.

    memory = SessionMemory(model, MemorySpec("segments", {"k": 8}))
    logits = memory.append(prompt_ids)          # (vocab,) at the last position
    logits = memory.append(next_token[None])    # decode is an append of one token

`append` forwards the tokens in chunks of `chunk_size`; every chunk attends to the frame
(sinks, the memory its strategy selects, the local window) and then joins it, so every token
appended, prompt or generated, is context for every later append. The frame reaches the
model's layers as a forward keyword of longserve's attention function (engine/runner/attention.py),
which the model must have selected (the loader does); a forward without a session still runs
plain SDPA attention.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from engine.memory.buffers import private_copies
from engine.memory.config import parse_memory_spec
from engine.memory.decode_row import MemoryRow
from engine.memory.frame import Frame
from engine.memory.frame_state import FrameMark
from engine.memory.mapped import DiskArena
from engine.memory.prior import TextPrior
from engine.memory.projections import Projections
from engine.memory.rotary import RotaryTable
from engine.memory.strategies import new_selector
from engine.memory.transfer import EncodingTransfer
from engine.protocol import InvalidRequest, MemorySpec
from engine.runner.attention import FRAME_KWARG, require_longserve_attention
from memory_store.client import TextEncoder, chain_hash


@dataclass(frozen=True)
class MemoryMark:
    """Where a memory stood (SessionMemory.mark): what `rewind` takes it back to."""

    frame: FrameMark
    state_hash: str | None
    last_logits: torch.Tensor | None


class SessionMemory(EncodingTransfer):
    def __init__(
        self,
        model: PreTrainedModel,
        spec: MemorySpec | None = None,
        kv_dtype: str = "model",
        projections: Projections | None = None,
        arena: DiskArena | None = None,
        spill_bytes: int = 0,
    ) -> None:
        """kv_dtype: what the frame's sinks and local window hold keys and values in, the
        engine's resolved EngineConfig.kv_dtype ("model" or "float16"); memory blocks follow
        FrameConfig.memory_dtype. projections: the operator's neurocache projections, which
        `memory.projection` names by id (None: none can be named). arena: the server's disk
        tier (mapped.py), where tier "disk" keeps memory blocks and where they move once they
        pass spill_bytes (0: never); None: no disk tier."""
        cfg = model.config
        max_positions = int(cfg.max_position_embeddings)
        require_longserve_attention(model)
        config = parse_memory_spec(spec, max_positions=max_positions)
        if config.tier == "disk" and arena is None:
            raise InvalidRequest(
                'memory.tier "disk" is not offered by this server (memory_disk_bytes is 0)',
                param="memory.tier",
            )
        # the prior's budget is frame positions: kept only once a prior is attached, so a
        # memory without one has no gap of unused positions between sinks and retrieved rows
        self._prior_k = config.prior_k
        self.config = dataclasses.replace(config, prior_k=0)
        self.strategy = (spec or MemorySpec()).strategy
        self.model = model
        num_layers = cfg.num_hidden_layers
        kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        dtype, device = param.dtype, param.device
        selector = new_selector(
            self.config, model, projections, (num_layers, kv_heads, head_dim), dtype, device
        )
        self._selector = selector
        self._frame = Frame(
            self.config,
            selector,
            RotaryTable(model, max_positions),
            num_layers,
            kv_heads,
            head_dim,
            dtype,
            device,
            None if kv_dtype in ("model", "auto") else getattr(torch, kv_dtype),
            arena,
            spill_bytes,
        )
        selector.frame = self._frame
        self.prior: TextPrior | None = None  # attach_prior: DCP's EmbQ . EmbD (prior.py)
        self._last_logits: torch.Tensor | None = None
        # chain hash of every forward (or imported chunk) so far; None for an empty session
        self.state_hash: str | None = None
        self._offloaded = False
        # while a turn is recorded (start_turn): each commit's ids, keys, values, state
        self._turn: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor], dict]] | None
        self._turn = None

    def __del__(self) -> None:
        # frame and selector refer to each other (selector.frame): break the cycle so that a
        # dropped session's keys and values are freed at once, not at the next full gc pass
        selector = self.__dict__.get("_selector")
        if selector is not None:
            selector.frame = None

    def attach_prior(self, encoder: TextEncoder, decode: Callable[[Sequence[int]], str]) -> None:
        """Give this memory the text prior (prior.py): `encoder` embeds texts, `decode` turns
        token ids into text. Attach before the first append: the prior keeps every token id
        read after this call."""
        if self._prior_k and self.prior is None and self.num_tokens == 0:
            self.config = dataclasses.replace(self.config, prior_k=self._prior_k)
            self._frame.config = c = self.config  # selectors do not read the prior's budget
            by_relevance = c.prior_order == "relevance"
            lexical, named = c.prior_match in ("hybrid", "named"), c.prior_match == "named"
            self.prior = TextPrior(
                encoder, decode, c.prior_k, c.prior_u, c.block, by_relevance, lexical, named
            )

    def embed_prior(self) -> None:
        """Compute the text prior's EmbD of every memory block now, not at the first question
        that needs it (a copy kept for later prompts then carries them)."""
        if self.prior is not None:
            self.prior.embed(self._frame)

    def reads_by_question(self, num_tokens: int) -> bool:
        """Whether forwards of num_tokens retrieve with the question's text prior, so what
        the memory keeps of a document read in them depends on the question asked."""
        return self.prior is not None and self.config.retrieves(num_tokens)

    def set_query(self, text: str | None) -> None:
        """The question x of the request under way (EmbQ(x) for the text prior), or None."""
        if self.prior is not None:
            self.prior.set_query(text)

    def end_request(self) -> None:
        """A request on this memory ended: drop the decode steps' caches, so a session between
        requests holds its memory only (docs/decisions/018-decode-step-caches.md). The next
        decode step rebuilds them (one rotation of the window per layer). The request's
        question is forgotten."""
        self._frame.release_step_caches()
        self.set_query(None)

    def end_document(self) -> None:
        """A document (or a collection) was read whole: once memory is in use, the window's
        whole blocks move to memory, so the conversation after it reaches the document through
        retrieval, evidence right before the question (Frame.flush_window)."""
        self.reload()
        with torch.inference_mode():
            self._frame.flush_window()

    def frame_ids(self) -> list[int] | None:
        """The tokens of the last forward's frame in frame order: sinks, the last layer's
        retrieved rows, the window (engine/sessions/frame_text.py). None when that forward
        retrieved nothing, or the token ids are not kept (no text prior)."""
        frame = self._frame
        if not frame.last_selected or self.prior is None:
            return None
        ids = self.prior.token_ids()
        if ids.size != frame.num_tokens:
            return None
        selected = frame.last_selected[max(frame.last_selected)][0]
        at = frame.n_sinks + frame.moved - frame.n_memory  # token position of memory row 0
        rows = selected[selected >= 0].cpu().numpy() + at
        window = ids[frame.n_sinks + frame.moved :]
        return np.concatenate([ids[: frame.n_sinks], ids[rows], window]).tolist()

    def forget_selection(self) -> None:
        """Drop what the last forward retrieved, so `frame_ids` tells whether the next one did."""
        self._frame.last_selected.clear()

    def mark(self) -> MemoryMark:
        """Where this memory stands now, for a later `rewind`."""
        return MemoryMark(self._frame.mark(), self.state_hash, self._last_logits)

    def can_rewind(self, mark: MemoryMark) -> bool:
        """Whether `rewind(mark)` would succeed."""
        return self._frame.can_rewind(mark.frame)

    def rewind(self, mark: MemoryMark) -> bool:
        """Forget every token read after `mark` (a conversation after the documents), when
        none of them has reached memory yet; False, changing nothing, otherwise."""
        self.reload()
        with torch.inference_mode():
            if not self._frame.rewind(mark.frame):
                return False
        if self.prior is not None:
            self.prior.truncate(mark.frame.num_tokens)
        logits = mark.last_logits
        device = next(self.model.parameters()).device
        self.state_hash = mark.state_hash
        self._last_logits = None if logits is None else logits.to(device)
        return True

    # -- tiers: an idle session leaves the device ------------------------------------------

    @property
    def on_disk(self) -> bool:
        """Whether memory blocks are held in the disk tier (tier "disk", or spilled)."""
        return self._frame.on_disk

    def memory_nbytes(self) -> int:
        """Bytes of the memory blocks' keys and values, in whatever tier they are."""
        return self._frame.memory_nbytes()

    def memory_row_bytes(self) -> int:
        """Bytes one more token takes in memory blocks."""
        return self._frame.memory_row_bytes()

    @property
    def disk_arena(self) -> DiskArena | None:
        return self._frame.arena

    def reserve(self, n_tokens: int) -> None:
        """Room for a document of n_tokens in memory blocks before it is read
        (FrameState.reserve)."""
        self._frame.reserve(n_tokens)

    def spill(self) -> bool:
        """Move the memory blocks to the disk tier; False when there is none or it is full
        (FrameState.spill)."""
        return self._frame.spill()

    @property
    def offloaded(self) -> bool:
        """True while the session sits in host memory instead of beside the model."""
        return self._offloaded

    def offload(self) -> None:
        """Move the whole session (keys, values, summaries, indices) to host memory. The next
        append, ingest or import brings it back first. On a CPU model this changes nothing
        but the bookkeeping: host and device are the same memory."""
        host = torch.device("cpu")
        self._frame.to(host)
        if self._last_logits is not None:
            self._last_logits = self._last_logits.to(host)
        self._offloaded = True

    def reload(self) -> None:
        """Bring an offloaded session back to the model's device (no-op when it is there)."""
        if not self._offloaded:
            return
        device = next(self.model.parameters()).device
        self._frame.to(device)
        if self._last_logits is not None:
            self._last_logits = self._last_logits.to(device)
        self._offloaded = False

    @property
    def num_tokens(self) -> int:
        """Tokens read so far (memory + sinks + local window; FIFO-dropped ones included)."""
        return self._frame.num_tokens

    @property
    def memory_tokens(self) -> int:
        """Tokens held in memory now (outside sinks and local window)."""
        return self._frame.n_memory

    def append(
        self,
        input_ids: torch.Tensor,
        *,
        on_progress: Callable[[int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        document: bool = False,
    ) -> torch.Tensor:
        """Read input_ids (T,) in chunks; return the logits (vocab,) at the last token read.

        Chunks are chunk_size tokens, except that the last `tail` tokens go on their own (they
        end a question, and retrieve for themselves); document=True reads a document, whose
        end asks nothing: chunk_size pieces only, no tail forward.

        should_stop() is checked before every chunk but the first; stopping leaves the memory
        holding exactly the chunks read. on_progress(tokens_done) follows every chunk.
        """
        self.reload()
        input_ids = input_ids.reshape(-1)
        if input_ids.numel() == 0:
            if self._last_logits is None:
                raise InvalidRequest("nothing to read: input_ids is empty", param="input_ids")
            return self._last_logits
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            for done, end in self._chunks(input_ids.numel(), tail=not document):
                if done and should_stop is not None and should_stop():
                    break
                self._last_logits = self._forward(input_ids[done:end].to(device))
                self._commit(input_ids[done:end])
                if on_progress is not None:
                    on_progress(end)
        assert self._last_logits is not None
        return self._last_logits

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """One forward of ids (T,) over the frame, left pending (commit or abort it);
        returns the logits (vocab,) at its last token. A selector that votes (segments'
        consensus) gets a voting pass first: the same forward, run and thrown away, whose
        layers' summed block scores then choose the blocks of every layer of the real one."""
        if self._selector.wants_vote(ids.numel()):
            self._forward_once(ids)
            self._frame.abort()
            self._selector.hold_vote()
        return self._forward_once(ids)

    def _begin_forward(self, num_tokens: int) -> torch.Tensor:
        """Fix the frame (the text prior's rows, positions (num_tokens,)) for a forward."""
        retrieves = self._frame.n_memory and self.config.retrieves(num_tokens)
        prior = self.prior
        self._frame.pinned = prior.rows(self._frame) if prior is not None and retrieves else None
        return self._frame.begin(num_tokens)

    def _forward_once(self, ids: torch.Tensor) -> torch.Tensor:
        positions = self._begin_forward(ids.numel())
        try:
            out = self.model(
                input_ids=ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=1,
                **{FRAME_KWARG: self._frame},
            )
        except BaseException:
            self._frame.abort()
            raise
        return out.logits[0, -1]

    def decode_row(self, token_id: int) -> MemoryRow:
        """This memory's row in a batched decode forward (engine/runner/rows.py): reading token_id
        there does what `append` of that one token does."""
        return MemoryRow(self, token_id)

    def _commit(self, ids: torch.Tensor) -> None:
        """The pending chunk of ids joins the frame (and the prior's token ids). Blocks it
        moved to memory get their EmbD now, a chunk's worth at a time: embedding a whole
        document at its first question stalled every other request for seconds."""
        if self._turn is not None:  # a turn being recorded keeps what each commit adds
            keys, values = self._frame.pending_chunk()
            state = self._selector.export_chunk_state(precise=True)
            self._turn.append((ids.reshape(-1).tolist(), keys, values, state))
        self._frame.commit()
        if self.prior is not None:
            self.prior.read(ids)
            self.prior.embed(self._frame)
        self._advance_hash(ids)

    def _advance_hash(self, ids: torch.Tensor) -> None:
        self.state_hash = chain_hash(self.state_hash, ids.reshape(-1).cpu().numpy())

    @property
    def window_dtype(self) -> torch.dtype:
        """What the frame's sinks and local window hold keys and values in."""
        return self._frame.window_dtype

    @property
    def model_dtype(self) -> torch.dtype:
        return self._frame._dtype

    def fork(self, private: bool = False) -> SessionMemory:
        """An independent copy of this memory (frame, blocks, summaries, indices, chain hash)
        sharing the model: what one request reads extra chunks into (a collection's EmbQ
        selection) without changing the session: no forward; keys and values shared until
        a write would touch the other's rows (buffers.py), or, `private`, copied."""
        shared: dict[int, object] = {}
        for module in self.model.modules():
            shared[id(module)] = module
        for tensor in (*self.model.parameters(), *self.model.buffers()):
            shared[id(tensor)] = tensor
        with torch.inference_mode(), private_copies(private):
            return copy.deepcopy(self, shared)

    def _chunks(self, total: int, tail: bool = True) -> list[tuple[int, int]]:
        """[start, end) of each forward: chunk_size pieces, the last `tail` tokens apart."""
        c = self.config
        body = c.tail_start(total) if tail else total
        bounds = [(s, min(s + c.chunk_size, body)) for s in range(0, body, c.chunk_size)]
        return bounds + ([(body, total)] if body < total else [])

    def nbytes(self) -> int:
        """Bytes of keys, values, summaries and indices this session holds."""
        return self._frame.nbytes() + (self.prior.nbytes() if self.prior is not None else 0)

    def pop_retrieval_seconds(self) -> float:
        """Seconds spent selecting memory since the last call."""
        seconds, self._frame.retrieval_seconds = self._frame.retrieval_seconds, 0.0
        prior = self.prior.pop_seconds() if self.prior is not None else 0.0
        return seconds + self._selector.pop_seconds() + prior
