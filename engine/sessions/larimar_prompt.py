"""Prompt surgery for the `larimar` strategy (engine/sessions/larimar.py), pure functions: the
sentence a memory is read with, a long prompt divided into what is written and what is asked,
and the prompt conditioned on the sentences read back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.protocol import InvalidRequest, Prompt, PromptMessage
from memory_store.client import LarimarHit, split_sentences


def last_sentence(text: str) -> str:
    """The final sentence (or partial sentence) of `text`: the reading query."""
    sentences = split_sentences(text)
    return sentences[-1] if sentences else ""


def _content_text(message: PromptMessage) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))


def _last_user_index(messages: Sequence[PromptMessage]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    raise InvalidRequest("the larimar strategy needs a user message to read with", param="messages")


def reading_query(prompt: Prompt) -> str:
    """The text the memory is read with: the last sentence of the completion prompt, or of the
    last user message."""
    if isinstance(prompt, str):
        query = last_sentence(prompt)
    else:
        query = last_sentence(_content_text(prompt[_last_user_index(prompt)]))
    if not query:
        raise InvalidRequest("the prompt has no text to read the memory with", param="prompt")
    return query


def split_context(prompt: Prompt) -> tuple[str, Prompt]:
    """(document to write, short prompt to answer) of a prompt too long for the window, the way
    the paper divides its context: everything but the final partial sentence is written to
    memory; that sentence is the prompt. For chat, the earlier messages and the last user
    message but its last sentence are the document, and the last user message becomes that
    sentence (system messages are kept)."""
    if isinstance(prompt, str):
        sentences = split_sentences(prompt)
        if len(sentences) < 2:
            return "", prompt
        return " ".join(sentences[:-1]), sentences[-1]
    last = _last_user_index(prompt)
    sentences = split_sentences(_content_text(prompt[last]))
    document = [
        _content_text(m) for i, m in enumerate(prompt) if i < last and m.get("role") != "system"
    ]
    document.append(" ".join(sentences[:-1]))
    kept = [dict(m) for i, m in enumerate(prompt) if i < last and m.get("role") == "system"]
    kept.append({**dict(prompt[last]), "content": sentences[-1] if sentences else ""})
    kept += [dict(m) for m in prompt[last + 1 :]]
    if "tools" in prompt[0]:  # the template's tools ride on the first message
        kept[0]["tools"] = prompt[0]["tools"]
    return "\n\n".join(d for d in document if d), kept


def retrieved_sentences(hits: Sequence[LarimarHit], max_segments: int) -> list[str]:
    """The distinct sentences of the read slots, in document order (first occurrence), capped
    at `max_segments` (nearest slots first when capping)."""
    first_index: dict[str, int] = {}
    for hit in hits:  # nearest slot first
        for index, text in zip(hit.segment_indices, hit.texts, strict=True):
            if text in first_index:
                first_index[text] = min(first_index[text], index)
            elif len(first_index) < max_segments:
                first_index[text] = index
    return sorted(first_index, key=first_index.__getitem__)


def conditioned(prompt: Prompt, sentences: Sequence[str]) -> Prompt:
    """The prompt with the retrieved sentences in front of the question."""
    context = " ".join(sentences)
    if not context:
        return prompt
    if isinstance(prompt, str):
        return f"{context}\n{prompt}"
    last = _last_user_index(prompt)
    messages = [dict(m) for m in prompt]
    messages[last]["content"] = f"{context}\n\n{_content_text(prompt[last])}"
    return messages
