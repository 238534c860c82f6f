"""What the memories' text prior (engine/memory/prior.py) embeds, and with which encoder."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.protocol import Prompt
from engine.runner.chat_template import Turn, message_text
from memory_store.client import TextEncoder, bundled_model_path, default_embedder

logger = logging.getLogger(__name__)

# the encoder reads ~256 word pieces: the end of a long question, then the start of the answer
QUESTION_CHARS = 1000
ANSWER_CHARS = 300
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def prior_encoder(config: EngineConfig) -> TextEncoder | None:
    """The sentence encoder behind EmbQ/EmbD (loaded on first use), or None when the engine
    runs without the prior (config.text_prior False, or the encoder is not installed)."""
    if not config.text_prior:
        return None
    try:
        bundled_model_path()
    except RuntimeError as e:
        logger.warning("memory text prior off: %s", e)
        return None
    return default_embedder()


def question_text(text: str) -> str:
    """The question of a message or prompt: its last paragraph (text after the last blank
    line), at most QUESTION_CHARS from its end. A message that is a document followed by its
    question ("<document>\n\n<question>") gives the question, not the document's end; a
    question written before its document gives the document's last paragraph."""
    paragraphs = [p for p in _BLANK_LINE.split(text) if p.strip()]
    return (paragraphs[-1] if paragraphs else text).strip()[-QUESTION_CHARS:]


def prior_query(prompt: Prompt, held: Sequence[Turn] = ()) -> str:
    """EmbQ's input x for a request: the question (question_text) of the last user message
    of a chat, followed by the assistant message before it (sent, or the last one the session
    holds), which a follow-up question may refer to; a completion prompt's question. The
    question comes first, so that the encoder, which reads the start of a long text, reads
    it."""
    if isinstance(prompt, str):
        return question_text(prompt)
    turns = [message_text(message, i) for i, message in enumerate(prompt)]
    users = [i for i, (role, _) in enumerate(turns) if role == "user"]
    if not users:
        return turns[-1][1]
    last = users[-1]
    before = [text for role, text in turns[:last] if role == "assistant"]
    before = before or [text for role, text in held if role == "assistant"]
    question = question_text(turns[last][1])
    return f"{question}\n{before[-1][:ANSWER_CHARS]}" if before else question
