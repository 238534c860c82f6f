"""Chat messages to token ids through the model's chat template.

Message contents never become control tokens: the template is rendered around placeholders and
each content is tokenized on its own with split_special_tokens=True (see `encode_chat`). A
template that renders tools gets them, an assistant's calls and a tool result's call id as its
own fields (engine/runner/tool_template.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.protocol import InvalidRequest, TooManyTokens
from engine.runner.tokenize import encode_ids, encode_text
from engine.runner.tool_template import template_tools, tool_fields

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
_ROLE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,31}")
_PLACEHOLDER = "\ue000{}\ue001"  # private-use characters: never produced by a chat template
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")


def end_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> frozenset[int]:
    """EOS and the chat template's end-of-turn tokens: generating one ends with "stop"."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(int(i) for i in ([gen_eos] if isinstance(gen_eos, int) else gen_eos))
    added = tokenizer.get_added_vocab()
    ids.update(added[t] for t in _END_OF_TURN_TOKENS if t in added)
    return frozenset(ids)


def message_text(message: Any, index: int) -> tuple[str, str]:
    """(role, content text) of one chat message; content may be a str or a list of text parts."""
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"message {index} must be an object", param="messages")
    role = message.get("role")
    if not isinstance(role, str) or not _ROLE.fullmatch(role):
        raise InvalidRequest(f"message {index} has an invalid role", param="messages")
    content = message.get("content")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise InvalidRequest(
                    f"message {index}: only text content parts are supported", param="messages"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"message {index}: a text part needs text", param="messages")
            texts.append(text)
        return role, "\n".join(texts)
    raise InvalidRequest(f"message {index} content must be a string or a list", param="messages")


Turn = tuple[str, str]
"""One chat message as a session remembers it: (role, content text)."""


def message_turns(messages: Sequence[Any]) -> list[Turn]:
    """(role, text) of each message; InvalidRequest for malformed ones."""
    if isinstance(messages, str | bytes) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    return [message_text(message, i) for i, message in enumerate(messages)]


def _render(
    tokenizer: PreTrainedTokenizerBase,
    turns: Sequence[Turn],
    offset: int,
    generation_prompt: bool,
    fields: Sequence[dict[str, Any]] = (),
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The chat template around placeholders: turn i's content is placeholder offset + i;
    fields[i]: turn i's tool fields (an empty content beside them is left empty, so the
    template sees a call without text); tools: for a template that renders them."""
    templated = []
    for i, (role, text) in enumerate(turns):
        extra = fields[i] if i < len(fields) else {}
        content = _PLACEHOLDER.format(offset + i) if text or not extra else ""
        templated.append({"role": role, "content": content, **extra})
    options: dict[str, Any] = {} if tools is None else {"tools": tools}
    try:
        return str(
            tokenizer.apply_chat_template(
                templated, tokenize=False, add_generation_prompt=generation_prompt, **options
            )
        )
    except Exception as e:  # templates raise on role orders they do not support
        raise InvalidRequest(f"chat template rejected the messages: {e}", param="messages") from e


def _tokenize_rendered(
    tokenizer: PreTrainedTokenizerBase,
    rendered: str,
    contents: Sequence[str],
    limit: int | None = None,
) -> torch.Tensor:
    """Token ids (T,) of a rendered template: its own text with special tokens recognised, each
    placeholder's content with split_special_tokens=True (so it never becomes control tokens).
    PromptTooLong as soon as they are more than `limit`."""
    parts: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)]
    count = 0

    def add(ids: torch.Tensor) -> None:
        nonlocal count
        parts.append(ids)
        count += len(ids)
        if limit is not None and count > limit:
            raise TooManyTokens(count, limit)

    def template(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)

    pos = 0
    for match in _PLACEHOLDER_RE.finditer(rendered):
        if match.start() > pos:
            add(template(rendered[pos : match.start()]))
        content = contents[int(match.group(1))]
        if content:
            room = None if limit is None else limit - count
            try:
                ids = encode_ids(
                    tokenizer,
                    content,
                    add_special_tokens=False,
                    split_special_tokens=True,
                    limit=room,
                )
            except TooManyTokens as exc:  # counted within the room left: the whole prompt's
                raise TooManyTokens(count + exc.at_least, limit or 0) from None
            add(ids)
        pos = match.end()
    if pos < len(rendered):
        add(template(rendered[pos:]))
    return torch.cat(parts)


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Any],
    history: Sequence[Turn] = (),
    generation_prompt: bool = True,
) -> list[int]:
    """encode_chat_ids as a list."""
    return list(encode_chat_ids(tokenizer, messages, history, generation_prompt).tolist())


def encode_chat_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Any],
    history: Sequence[Turn] = (),
    generation_prompt: bool = True,
    limit: int | None = None,
) -> torch.Tensor:
    """Token ids (T,) of chat messages rendered by the chat template, with a generation prompt
    (without one for generation_prompt=False: a document read into a session as a user turn).

    With a history (the turns a session's memory already holds), only the continuation is
    encoded: the template rendered over history + messages, minus its rendering of the history
    alone. So what a template adds once per conversation (SmolLM2's default system prompt when
    the first message is not a system message) is not repeated in the middle of a session. A
    template whose rendering of the history is not a prefix of the whole (one that rewrites
    earlier turns), or refuses the two joined (one that wants user and assistant turns in
    turn, after a document's user turn), gets the messages rendered on their own, without a
    second start-of-sequence token. The history is rendered without
    tools: a template that puts them in front of the conversation gets the messages on their
    own, with the tools, so the model reads them.

    Message contents never become control tokens: the template is rendered around placeholders,
    the template's own text is tokenized with special tokens recognised, and each content is
    tokenized with split_special_tokens=True, so a user typing "<|im_start|>system" gets text.
    """
    if isinstance(messages, str | bytes) or not (messages or history):
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    turns = [message_text(message, i) for i, message in enumerate(messages)]
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template; use completions", param="messages")
    contents = [text for _, text in history] + [text for _, text in turns]
    fields = [tool_fields(tokenizer, message, i) for i, message in enumerate(messages)]
    tools = template_tools(tokenizer, messages)
    if not history:
        rendered = _render(tokenizer, turns, 0, generation_prompt, fields, tools)
        return _tokenize_rendered(tokenizer, rendered, contents, limit)
    history_fields: list[dict[str, Any]] = [{} for _ in history]
    try:
        rendered = _render(
            tokenizer, [*history, *turns], 0, generation_prompt, history_fields + fields, tools
        )
        before = _render(tokenizer, history, 0, False)
    except InvalidRequest:
        # Templates that want strict user/assistant turns (Mistral's) refuse a session's
        # document turn followed by a user turn: the messages alone, as one more exchange.
        rendered = before = ""
    if before and rendered.startswith(before):
        rendered = rendered[len(before) :]
    else:
        rendered = _render(tokenizer, turns, len(history), generation_prompt, fields, tools)
        rendered = _without_opening_bos(tokenizer, rendered)  # in memory already
    return _tokenize_rendered(tokenizer, rendered, contents, limit)


def _without_opening_bos(tokenizer: PreTrainedTokenizerBase, rendered: str) -> str:
    """`rendered` without the start-of-sequence token a template writes in front of every
    rendering (`{{ bos_token }}`: Llama 3, Mistral). ChatML templates never write it, and
    SmolLM2's bos_token is "<|im_start|>", which opens each of their turns."""
    bos = getattr(tokenizer, "bos_token", None)
    if bos and "bos_token" in str(tokenizer.chat_template) and rendered.startswith(bos):
        return rendered[len(bos) :]
    return rendered


def encode_document(
    tokenizer: PreTrainedTokenizerBase, text: str, history: Sequence[Turn] = ()
) -> list[int]:
    """A document as a session reads it: with a chat template, a user turn continuing the
    conversation held (the first one opens with the template's system prompt, which then sits
    in the sinks), so a question asked by chat continues a conversation that holds the
    document (docs/decisions/021-documents-as-turns.md); without one, its text as it is.
    Contents never become control tokens."""
    if not text or not getattr(tokenizer, "chat_template", None):
        return encode_text(tokenizer, text, add_special_tokens=False, split_special_tokens=True)
    message = {"role": "user", "content": text}
    return encode_chat(tokenizer, [message], history, generation_prompt=False)


def assistant_turn_end(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids the chat template puts after an assistant message's content (SmolLM2:
    "<|im_end|>\n"): what closes a generated answer in a session's memory, so that the next
    turn follows the template. Empty for a model without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    turns = [("user", ""), ("assistant", "")]
    try:
        rendered = _render(tokenizer, turns, 0, False)
    except InvalidRequest:
        return []
    end = _PLACEHOLDER.format(1)
    if end not in rendered:
        return []
    closing = rendered[rendered.index(end) + len(end) :]
    return list(tokenizer(closing, add_special_tokens=False).input_ids) if closing else []
