"""Text to token ids without holding the GIL for long, so that a huge prompt tokenized on a
preprocessing thread does not stall the asyncio loop (docs/decisions/057).

A fast tokenizer encodes with the GIL released, but turning its result into Python ints holds
it: 0.5 s for the ids of a 30 MB text, 0.6 s more for `torch.tensor` of them. A long text is
therefore encoded in pieces of about PIECE_CHARS characters, cut where the tokenizer itself
splits (checked on a window around each cut: the window encoded whole and in two halves must
agree), and its ids are converted piece by piece. A text with no such cut is encoded whole.
`encode_ids` builds the tensor from the pieces without ever holding one long list of Python
ints (the garbage collector walks such a list at every pass: 37 ms for 7.2 M ids).

Pieces are encoded one after another (the server turns the tokenizer's own thread pool off:
it took every core, 5.7 CPU-seconds in 3.1 s for 24 MB on 2 cores), each as a batch of one
(`encode` holds the GIL throughout, `encode_batch` releases it), and with a `limit` the
encoding stops at the first piece past it (TooManyTokens): refusing a prompt costs what the
limit allows, not what the client sent (docs/decisions/061).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from engine.protocol import InvalidRequest, TooManyTokens

PIECE_CHARS = 1 << 18  # ids of ~60K tokens per conversion: a few ms of GIL
_CHECK_CHARS = 256  # each side of a cut, encoded whole and in halves
_CUT_TRIES = 16  # candidate cuts tried past each piece's end before encoding the rest whole
_BOUNDARY = re.compile(r"(?<=\S)[ \n](?=\S)")


def encode_text(
    tokenizer: Any,
    text: str,
    *,
    add_special_tokens: bool = True,
    split_special_tokens: bool = False,
    limit: int | None = None,
) -> list[int]:
    """`tokenizer(text, ...).input_ids`, the same ids, with short GIL holds for long texts;
    PromptTooLong once they are more than `limit`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if len(text) <= 2 * PIECE_CHARS or backend is None:
        encoded = tokenizer(
            text, add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens
        )
        return check_limit(list(encoded.input_ids), limit)
    ids: list[int] = []
    for part in _piece_ids(backend, text, add_special_tokens, split_special_tokens):
        ids.extend(part)
        check_limit(ids, limit)
    return ids


def check_limit(ids: Any, limit: int | None) -> Any:
    """ids, or TooManyTokens (without a param: the caller names it) if there are more than
    `limit` of them."""
    if limit is not None and len(ids) > limit:
        raise TooManyTokens(len(ids), limit)
    return ids


def encode_ids(
    tokenizer: Any,
    text: str,
    *,
    add_special_tokens: bool = True,
    split_special_tokens: bool = False,
    limit: int | None = None,
) -> torch.Tensor:
    """encode_text's ids as a tensor (T,), never held as one long list of Python ints: a list
    of millions costs the garbage collector tens of ms at every pass while it lives."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if len(text) <= 2 * PIECE_CHARS or backend is None:
        ids = encode_text(
            tokenizer,
            text,
            add_special_tokens=add_special_tokens,
            split_special_tokens=split_special_tokens,
            limit=limit,
        )
        return torch.tensor(ids, dtype=torch.long)
    parts: list[torch.Tensor] = []
    count = 0
    for part in _piece_ids(backend, text, add_special_tokens, split_special_tokens):
        parts.append(torch.tensor(part, dtype=torch.long))
        count += len(part)
        if limit is not None and count > limit:
            raise TooManyTokens(count, limit)
    return torch.cat(parts)  # (T,)


def _piece_ids(
    backend: Any, text: str, add_special_tokens: bool, split_special_tokens: bool
) -> Iterator[list[int]]:
    """The ids of a long text: the special head, each piece's (converted, then freed, one at a
    time), the special tail. The backend's truncation is off meanwhile."""
    truncation = backend.truncation
    if truncation is not None:
        backend.no_truncation()
    backend.encode_special_tokens = split_special_tokens
    try:
        head, tail = _special_ends(backend) if add_special_tokens else ([], [])
        yield list(head)
        for piece in _pieces(backend, text):
            # a batch of one: encode_batch releases the GIL, encode holds it (1.7 s for 3 MB)
            yield backend.encode_batch([piece], add_special_tokens=False)[0].ids
        yield list(tail)
    finally:
        if truncation is not None:
            backend.enable_truncation(**truncation)


def _special_ends(backend: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after a text (a BOS, an EOS), if any."""
    bare = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    return [], []


def _pieces(backend: Any, text: str) -> Iterator[str]:
    """text cut into pieces of about PIECE_CHARS characters at cuts the tokenizer agrees with."""
    start = 0
    while len(text) - start > 2 * PIECE_CHARS:
        cut = _cut_after(backend, text, start + PIECE_CHARS)
        if cut is None:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def _cut_after(backend: Any, text: str, at: int) -> int | None:
    """A position past `at`, before whitespace that follows a non-space character, where the
    text encodes the same cut or not (checked on a window around it); None if none is found."""
    position = at
    for _ in range(_CUT_TRIES):
        cut = _next_boundary(text, position, at + PIECE_CHARS)
        if cut is None:
            return None
        window = text[cut - _CHECK_CHARS : cut + _CHECK_CHARS]
        left, right = text[cut - _CHECK_CHARS : cut], text[cut : cut + _CHECK_CHARS]
        whole = backend.encode(window, add_special_tokens=False).ids
        halves = [backend.encode(half, add_special_tokens=False).ids for half in (left, right)]
        if whole == halves[0] + halves[1]:
            return cut
        position = cut + 1
    return None


def _next_boundary(text: str, position: int, limit: int) -> int | None:
    """The first index in [position, limit) of a space or newline between two non-space
    characters: where word-level pre-tokenizers start a new word."""
    match = _BOUNDARY.search(text, position, min(limit, len(text) - _CHECK_CHARS))
    return match.start() if match is not None else None


def checked_ids(tokenizer: Any, ids: Any, param: str, limit: int | None = None) -> list[int]:
    """ids as a list, each a token id of `tokenizer`'s vocabulary (InvalidRequest naming
    param[i] otherwise), no more than `limit` of them (TooManyTokens)."""
    vocab = len(tokenizer)
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise InvalidRequest(
                f"{param}[{i}] is {token}, not a token id of this model (0 to {vocab - 1}).",
                param=param,
            )
    return check_limit(list(ids), limit)
