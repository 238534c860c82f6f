"""A session's memory and the conversation it holds: which messages of a request are new, where
a new chat starts, and the turns it took, recorded for the memory store and imported back on
another replica (docs/decisions/032). Device thread only.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.memory.session import MemoryMark, SessionMemory
from engine.memory.turns import TurnEncoding
from engine.protocol import (
    CollectionAttachment,
    InvalidRequest,
    MemoryBudgetExceeded,
    Prompt,
    PromptTooLong,
    SessionTurn,
)
from engine.runner.chat_template import Turn, encode_chat, message_turns

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def check_memory_room(grows: int, room: int) -> None:
    """A request that may grow a session's memory by `grows` tokens, with `room` left in its
    tenant's budget: MemoryBudgetExceeded when it does not fit."""
    if grows > room:
        raise MemoryBudgetExceeded(
            f"the request may add {grows} tokens to the session's memory; this API key's "
            f"memory budget has {max(room, 0)} left",
            needed=grows,
            room=room,
        )


def check_memory_cap(tokens: int, limit: int) -> None:
    """A request that needs `tokens` of memory, over the engine's `limit`
    (max_memory_tokens): PromptTooLong."""
    if tokens > limit:
        raise PromptTooLong(
            f"the request needs {tokens} tokens of memory; the limit is {limit}",
            param="messages",
        )


@dataclass
class Collection:
    """A collection attached to a session. `order` maps each chunk's chain hash to its place
    in the collection (document order), to put a query's selection back in reading order."""

    attachment: CollectionAttachment
    order: dict[str, int]


@dataclass(frozen=True)
class TurnCount:
    """How many turns, and their tokens, a memory holds (documents and collections apart). A
    turn is an answer held: a chat request adds its answer and every assistant message it
    brought, so a conversation counts the same whether it was read message by message or
    resent whole as a new chat (docs/api.md, "Turns")."""

    turns: int = 0
    tokens: int = 0

    def plus(self, tokens: int, answers: int = 1) -> TurnCount:
        return TurnCount(self.turns + answers, self.tokens + tokens)


@dataclass
class Conversation:
    """A session's memory and the conversation it holds (device thread only)."""

    memory: SessionMemory
    strategy: str
    # Every chat message the memory holds, in order, each request's messages followed by the
    # answer generated for them (see FrameBackend._session_steps): what a resent
    # conversation is matched against.
    turns: list[Turn] = dataclasses.field(default_factory=list)
    # What the chat template has rendered into the memory, in order: the chat turns above
    # and each document read, as a user turn (see FrameBackend._ingest_steps).
    rendered: list[Turn] = dataclasses.field(default_factory=list)
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    collections: dict[str, Collection] = dataclasses.field(default_factory=dict)
    # The memory right after its last document (or collection), and what was rendered by then:
    # where a chat that does not continue the conversation held starts (`start_chat`).
    documents_end: MemoryMark | None = None
    documents_rendered: list[Turn] = dataclasses.field(default_factory=list)
    # Turns taken (`seq` of the last), held now, and held at the end of the documents.
    seq: int = 0
    held: TurnCount = dataclasses.field(default_factory=TurnCount)
    documents_held: TurnCount = dataclasses.field(default_factory=TurnCount)
    # Turns taken here that no finished request has carried out to the server yet (an aborted
    # one whose tokens had reached memory and could not be forgotten).
    unsent: list[SessionTurn] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.documents_end = self.memory.mark()

    def add_turns(self, new: list[Turn], answer: str) -> None:
        """A chat request's messages and its answer joined the memory."""
        self.turns = [*self.turns, *new, ("assistant", answer)]
        self.rendered = [*self.rendered, *new, ("assistant", answer)]

    def read_document(self, rendered: Turn | None) -> None:
        """A document or collection was read whole: it closes the conversation held, moves to
        memory (SessionMemory.end_document) and is where later new chats start."""
        if rendered is not None:
            self.rendered = [*self.rendered, rendered]
        self.memory.end_document()
        self.turns = []
        self.documents_end, self.documents_rendered = self.memory.mark(), list(self.rendered)
        self.documents_held = self.held

    def plan_chat(self, sent: list[Turn]) -> tuple[list[Turn], bool]:
        """The messages of a chat request that the memory must read, and whether it must
        first go back to the end of its documents (`restart`): the messages past the
        conversation held when `sent` continues it; else all of them after the documents
        (the conversation held is forgotten), as OpenAI's stateless chat API reads them. A
        conversation too long to forget (some of it has reached memory) is kept and the new
        chat follows it."""
        held = self.turns
        if sent[: len(held)] == held:
            return sent[len(held) :], False
        if self.documents_end is not None and self.memory.can_rewind(self.documents_end):
            return sent, True
        logger.info("a new chat follows the conversation held: part of it reached memory")
        return sent, False

    @property
    def restart_tokens(self) -> int:
        """Tokens the memory holds at the end of its documents."""
        return self.documents_end.frame.num_tokens if self.documents_end else 0

    def restart(self) -> None:
        """Go back to the end of the documents (after `plan_chat` said so)."""
        assert self.documents_end is not None and self.memory.rewind(self.documents_end)
        self.turns, self.rendered = [], list(self.documents_rendered)
        self.held = self.documents_held

    def check_room(self, grows: int, restart: bool, room: int | None) -> None:
        """A request may grow the memory by `grows` tokens, after a `restart` frees the
        conversation held; MemoryBudgetExceeded when that passes `room` (None: no budget)."""
        if room is not None:
            freed = self.held.tokens - self.documents_held.tokens if restart else 0
            check_memory_room(grows - freed, room)

    @property
    def selected(self) -> list[Collection]:
        """Collections searched per request (too large to load whole)."""
        return [c for c in self.collections.values() if c.attachment.loading == "selected"]

    # -- turns for the memory store --------------------------------------------------------

    def begin_turn(self) -> tuple[MemoryMark, str | None]:
        """Start recording a request's commits; where the memory stood (for `drop_turn`)."""
        self.memory.start_turn()
        return self.memory.mark(), self.memory.state_hash

    def drop_turn(self, mark: MemoryMark) -> bool:
        """An aborted or failed request: forget what it read, if none of it reached memory
        (False, still recording, when some did)."""
        if not self.memory.can_rewind(mark):
            return False
        self.memory.take_turn()
        return self.memory.rewind(mark)

    def finish_turn(
        self,
        restart: bool,
        new: list[Turn] | None,
        answer: str,
        hash_before: str | None,
        max_bytes: int,
    ) -> SessionTurn:
        """The request's commits as a turn for the store (recording stops); its encodings
        only up to `max_bytes` (past it, a restore reads its tokens again)."""
        enc = self.memory.take_turn()
        encoding = enc.to_bytes() if 0 < enc.nbytes <= max_bytes else None
        self.seq += 1
        brought = sum(role == "assistant" for role, _ in new or ())
        self.held = self.held.plus(enc.num_tokens, 1 + brought)
        return SessionTurn(
            seq=self.seq,
            restart=restart,
            messages=None if new is None else [(role, text) for role, text in new],
            answer=answer,
            token_ids=enc.token_ids,
            commits=enc.commits,
            hash_before=hash_before,
            hash_after=self.memory.state_hash,
            turns=self.held.turns,
            turn_tokens=self.held.tokens,
            encoding=encoding,
        )

    def end_request(
        self,
        mark: MemoryMark,
        hash_before: str | None,
        new: list[Turn] | None,
        restart: bool,
        tail: list[int],
        answer: str,
        *,
        finished: bool,
        max_bytes: int,
    ) -> SessionTurn | None:
        """After a request: the turn it took, or None when it left nothing or did not finish.

        A finished request has read its whole turn (the end of turn fed in batched steps). An
        aborted or failed one is forgotten (`drop_turn`) unless some of it reached memory;
        then `tail` (what it generated and the end of turn, unread) is read too, so the memory
        still holds whole turns, and the turn waits in `unsent` for the next finished request."""
        self.last_used = time.monotonic()
        if not finished and self.drop_turn(mark):
            return None
        if tail:
            try:
                with torch.inference_mode():
                    self.memory.append(torch.tensor(tail, dtype=torch.long))
            except Exception:
                logger.exception("closing a turn of a session failed")
        if new is not None:
            self.add_turns(new, answer)
        turn = self.finish_turn(restart, new, answer, hash_before, max_bytes)
        if not finished:
            self.unsent.append(turn)
            return None
        return turn

    def take_unsent(self, turn: SessionTurn) -> tuple[SessionTurn, ...]:
        """`turn`, after any turn kept here that no finished request carried out yet."""
        turns, self.unsent = (*self.unsent, turn), []
        return turns

    def import_turn(self, turn: SessionTurn) -> None:
        """Take a turn another replica's session took: the memory must stand where it began."""
        # a restart, said or not: a new chat that was aborted went back to the documents
        # and left no turn, so the next turn begins at their end
        ends = self.documents_end
        begins_there = ends is not None and ends.state_hash == turn.hash_before
        if turn.restart or (begins_there and self.memory.state_hash != turn.hash_before):
            if ends is None or not self.memory.can_rewind(ends):
                raise InvalidRequest("the turn restarts a chat this memory cannot go back to")
            self.restart()
        if self.memory.state_hash != turn.hash_before:
            raise InvalidRequest(f"turn {turn.seq} does not follow what this memory holds")
        if turn.encoding is not None:
            self.memory.import_turn(TurnEncoding.from_bytes(turn.encoding))
        else:  # its encodings are lost: read its tokens again, commit by commit
            ids = torch.tensor(turn.token_ids, dtype=torch.long)
            start = 0
            with torch.inference_mode():
                for n in turn.commits:
                    self.memory.append(ids[start : start + n])
                    start += n
        if self.memory.state_hash != turn.hash_after:
            raise InvalidRequest(f"turn {turn.seq} was not rebuilt as it was taken")
        if turn.messages is not None:
            self.add_turns([(role, text) for role, text in turn.messages], turn.answer)
        self.seq = turn.seq
        self.held = TurnCount(turn.turns, turn.turn_tokens)
        self.memory.end_request()


def turn_prompt(
    session: Conversation,
    prompt: Prompt,
    prompt_ids: torch.Tensor,
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[torch.Tensor, list[Turn] | None, bool]:
    """What a request appends to a session (device thread): a completion prompt as it is;
    chat messages as Conversation.plan_chat says, rendered after what the memory will
    hold. Returns the ids (T,), the chat messages appended (None for a completion) and
    whether the session must `restart` from its documents first (not done here, so a
    refused request changes nothing)."""
    if isinstance(prompt, str):
        return prompt_ids, None, False
    sent = message_turns(prompt)
    new, restart = session.plan_chat(sent)
    messages = prompt[len(sent) - len(new) :]
    history = session.documents_rendered if restart else session.rendered
    ids = encode_chat(tokenizer, messages, history)
    return torch.tensor(ids, dtype=torch.long), new, restart
