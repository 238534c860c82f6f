"""What the memories' text prior (engine/memory/prior.py) embeds, and with which encoder."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.chat_template import Turn, message_text
from engine.config import EngineConfig
from engine.protocol import Prompt
from memory_store.client import TextEncoder, bundled_model_path, default_embedder

logger = logging.getLogger(__name__)

# the encoder reads ~256 word pieces: the end of a long question, then the start of the answer
QUESTION_CHARS = 1000
ANSWER_CHARS = 300


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


def prior_query(prompt: Prompt, held: Sequence[Turn] = ()) -> str:
    """EmbQ's input x for a request: the last user message of a chat, followed by the
    assistant message before it (sent, or the last one the session holds), which a follow-up
    question may refer to; a completion prompt's text. The question comes first, so that the
    encoder, which reads the start of a long text, reads it; a user message longer than the
    encoder reads (an inline document followed by its question) is cut to its end by the
    prior (engine/memory/prior.py QUERY_CHARS)."""
    if isinstance(prompt, str):
        return prompt
    turns = [message_text(message, i) for i, message in enumerate(prompt)]
    users = [i for i, (role, _) in enumerate(turns) if role == "user"]
    if not users:
        return turns[-1][1]
    last = users[-1]
    before = [text for role, text in turns[:last] if role == "assistant"]
    before = before or [text for role, text in held if role == "assistant"]
    question = turns[last][1][-QUESTION_CHARS:]
    return f"{question}\n{before[-1][:ANSWER_CHARS]}" if before else question
