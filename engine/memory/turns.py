"""A turn's encodings: everything a session's memory committed during one request, exported
so that another replica rebuilds the same memory with no model forward (docs/decisions/032).

A turn is committed piece by piece (prompt chunks, then one token per decode step), and the
strategies keep state per commit (neurocache's layer-r states, its retrieval windows), so the
encoding keeps the commits apart and an import replays them in order: the memory it builds is
the one the turn left, bit for bit, in the frame's own dtype.

Bytes: a 4-byte little-endian header length, the JSON header, then the keys and the values,
each (layers, kv_heads, T, head_dim) in the frame's dtype.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

FORMAT = "lstu1"  # bump when what a turn's encodings mean changes
_DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16)}


@dataclass
class TurnEncoding:
    """Commits of one turn: tokens per commit, their ids, per layer the pre-rotary keys and
    values (kv_heads, T, head_dim) of all of them, and each commit's strategy state."""

    commits: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    metas: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of_commits(
        cls, commits: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor], dict[str, Any]]]
    ) -> TurnEncoding:
        """From recorded commits: (ids, keys and values per layer, strategy state) each."""
        enc = cls(metas=[state for _, _, _, state in commits])
        for ids, _, _, _ in commits:
            enc.commits.append(len(ids))
            enc.token_ids += ids
        if commits:
            layers = range(len(commits[0][1]))
            enc.keys = [torch.cat([k[i] for _, k, _, _ in commits], dim=1).cpu() for i in layers]
            enc.values = [torch.cat([v[i] for _, _, v, _ in commits], dim=1).cpu() for i in layers]
        return enc

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes of its keys and values."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def pieces(self) -> list[tuple[slice, dict[str, Any]]]:
        """[start, end) of each commit in the tokens, with its strategy state."""
        out, start = [], 0
        for n, meta in zip(self.commits, self.metas, strict=True):
            out.append((slice(start, start + n), meta))
            start += n
        return out

    def to_bytes(self) -> bytes:
        keys = torch.stack(self.keys).cpu().contiguous()  # (layers, kv_heads, T, d)
        values = torch.stack(self.values).cpu().contiguous()
        header = {
            "format": FORMAT,
            "dtype": str(keys.dtype),
            "shape": list(keys.shape),
            "commits": self.commits,
            "token_ids": self.token_ids,
            "metas": self.metas,
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        body = [_raw(keys), _raw(values)]
        return b"".join([struct.pack("<I", len(head)), head, *body])

    @classmethod
    def from_bytes(cls, data: bytes) -> TurnEncoding:
        """The encoding `to_bytes` wrote; ValueError for anything else."""
        try:
            (n,) = struct.unpack_from("<I", data)
            header = json.loads(bytes(data[4 : 4 + n]))
            if header.get("format") != FORMAT:
                raise ValueError(f"turn encoding format {header.get('format')!r}")
            dtype = _DTYPES[header["dtype"]]
            shape = tuple(int(x) for x in header["shape"])
            size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            start = 4 + n
            if len(data) != start + 2 * size:
                raise ValueError("turn encoding has the wrong size")
            keys = _tensor(data[start : start + size], dtype, shape)
            values = _tensor(data[start + size :], dtype, shape)
            enc = cls(
                commits=[int(c) for c in header["commits"]],
                token_ids=[int(t) for t in header["token_ids"]],
                keys=list(keys.unbind(0)),
                values=list(values.unbind(0)),
                metas=list(header["metas"]),
            )
        except (KeyError, TypeError, struct.error, json.JSONDecodeError) as e:
            raise ValueError(f"malformed turn encoding: {e}") from e
        if sum(enc.commits) != enc.num_tokens or len(enc.metas) != len(enc.commits):
            raise ValueError("turn encoding's commits do not cover its tokens")
        if shape[2] != enc.num_tokens:
            raise ValueError("turn encoding's keys do not match its tokens")
        return enc


def _raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
