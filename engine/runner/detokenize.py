"""Incremental detokenization that is safe for UTF-8 and for stop strings.

Two layers. `IncrementalDecoder` turns token ids into text only once they decode to whole
characters: byte-level BPE and byte-fallback tokens can split one character over several tokens,
and a partial sequence decodes to U+FFFD, so a suffix ending in U+FFFD is held back. It decodes a
short window of preceding tokens with the new ones (the TGI / vLLM "prefix offset" method) so
tokenizers that drop a leading space at the start of a decode still get spaces right.

`StopStringFilter` sits on top: it never lets any part of a stop string out. It holds back the
longest suffix of the pending text that is a prefix of some stop string, and when a stop string
appears it truncates there and reports the stop.
"""

from __future__ import annotations

import functools
import re
from typing import Any

REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class IncrementalDecoder:
    """Feeds token ids, returns the new whole-character text each time."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window decoded with the new tokens
        self._read_offset = 0  # ids before this one have been turned into emitted text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""  # nothing new yet, or an incomplete multi-byte character at the end
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""


class StopStringFilter:
    """Holds back text that could still become a stop string; truncates at one that appears."""

    def __init__(self, stop: tuple[str, ...] | list[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._pending = ""
        self.stopped = False

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def add(self, text: str) -> str:
        """The text that is safe to emit now; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        self._pending += text
        if not self._stop:
            out, self._pending = self._pending, ""
            return out
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[: min(hits)], ""
            return out
        keep = self._held_suffix_len(self._pending)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """At the end of generation the held-back text was not a stop string: release it."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


class Detokenizer:
    """Token ids in, emit-ready text out, honouring UTF-8 boundaries and stop strings."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] | list[str] = ()) -> None:
        self._decoder = IncrementalDecoder(tokenizer)
        self._stop = StopStringFilter(stop)

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def add(self, token_id: int) -> str:
        return self._stop.add(self._decoder.add(token_id))

    def finish(self) -> str:
        """The rest of the text when generation ends for a reason other than a stop string."""
        text = self._stop.add(self._decoder.flush())
        return text + self._stop.flush()


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@functools.lru_cache(maxsize=16)
def _special_tokens(tokenizer: Any) -> frozenset[str]:
    return frozenset(getattr(tokenizer, "all_special_tokens", ()))


@functools.lru_cache(maxsize=65536)
def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes one token stands for (for logprobs' `bytes`), for byte-level BPE,
    SentencePiece byte fallback, and plain vocabularies."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return b""
    match = _BYTE_TOKEN.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if piece in _special_tokens(tokenizer):
        return piece.encode()
    table = _byte_decoder()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return piece.replace("\u2581", " ").encode()


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token as text for logprobs; a partial UTF-8 sequence shows as U+FFFD like OpenAI."""
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")
