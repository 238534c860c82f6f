"""The encoder-output store's chunk codec and types (Decoupled Context Processing).

The engine encodes a document chunk once: per layer, the pre-rotary keys and values it computed
(each `(kv_heads, T, head_dim)`), together with the chunk's text, its token ids and an embedding
`EmbD(c)`. Those encodings are stored keyed by the model fingerprint and a prefix-chain
hash of the tokens (`h_i = sha256(h_{i-1} || tokens of chunk i)`), so identical documents are
stored once however many sessions read them (content addressing), and any engine replica can
rebuild a session's memory without running the model again. A session's document manifest
lists its chunk hashes in order.

This module is the codec and its types; `memory_store.encoding_store` keeps them over a backend.

Chunk wire format (also the HTTP body): `LSCE`, a version byte, a little-endian u32 header
length, a UTF-8 JSON header, then the arrays' raw little-endian bytes in header order.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from memory_store.errors import InvalidStoreRequest
from memory_store.keys import validate_id

Quantization = Literal["fp16", "int8"]

_MAGIC = b"LSCE"
_VERSION = 1
_MAX_HEADER = 16 * 1024 * 1024
_ROOT_HASH = b"\x00" * 32


# ---------------------------------------------------------------------------------------------
# Prefix-chain hashes.
# ---------------------------------------------------------------------------------------------


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or (arr.size and (arr.min() < 0 or arr.max() >= 2**32)):
        raise InvalidStoreRequest("token ids must be a 1-D sequence of ids in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def chain_hash(previous: str | None, token_ids: Sequence[int] | np.ndarray) -> str:
    """h_i = sha256(h_{i-1} || tokens of chunk i), hex; h_{-1} is 32 zero bytes."""
    prev = _ROOT_HASH if previous is None else bytes.fromhex(previous)
    return hashlib.sha256(prev + _token_bytes(token_ids)).hexdigest()


def chain_hashes(chunks: Sequence[Sequence[int] | np.ndarray]) -> list[str]:
    """The chain hashes of a document's chunks, in order."""
    out: list[str] = []
    prev: str | None = None
    for tokens in chunks:
        prev = chain_hash(prev, tokens)
        out.append(prev)
    return out


# ---------------------------------------------------------------------------------------------
# One chunk's encodings.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkEncoding:
    """What the engine stores for one chunk.

    keys[l], values[l]: layer l's pre-rotary K and V, `(kv_heads, T, head_dim)`; any float dtype
    goes in, fp16 comes out (int8-stored chunks come back dequantized to fp16).
    token_ids: `(T,)`. embedding: `EmbD(c)`, `(d,)` float32.
    """

    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    token_ids: np.ndarray
    text: str
    embedding: np.ndarray
    layers: tuple[int, ...] | None = None  # model layer indices of keys/values; None = 0..L-1
    meta: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if len(self.keys) != len(self.values) or not self.keys:
            raise InvalidStoreRequest(
                "a chunk needs the same number (>= 1) of key and value layers"
            )
        if self.layers is not None and len(self.layers) != len(self.keys):
            raise InvalidStoreRequest("layers must name one model layer per stored layer")
        t = int(np.asarray(self.token_ids).shape[0])
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k.ndim != 3 or k.shape != v.shape:
                raise InvalidStoreRequest(
                    f"layer {i}: K and V must both be (kv_heads, T, head_dim)"
                )
            if k.shape[1] != t:
                raise InvalidStoreRequest(f"layer {i}: T={k.shape[1]} but {t} token ids")
        if np.asarray(self.embedding).ndim != 1:
            raise InvalidStoreRequest("embedding must be 1-D")

    @property
    def num_tokens(self) -> int:
        return int(np.asarray(self.token_ids).shape[0])


def _quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row (last axis) int8: x ~= q * scale, scale `(..., 1)` float32."""
    x = np.asarray(x, dtype=np.float32)
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127.0
    safe = np.where(scale == 0, 1.0, scale)
    q = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def encode_chunk(chunk: ChunkEncoding, quantization: Quantization = "fp16") -> bytes:
    """Serialize to the chunk wire format."""
    chunk.validate()
    if quantization not in ("fp16", "int8"):
        raise InvalidStoreRequest(f"unknown quantization {quantization!r}")
    arrays: list[tuple[str, np.ndarray]] = []
    for i, (k, v) in enumerate(zip(chunk.keys, chunk.values, strict=True)):
        for name, x in (("k", k), ("v", v)):
            if quantization == "fp16":
                arrays.append((f"{name}{i}", np.asarray(x, dtype="<f2")))
            else:
                q, scale = _quantize_int8(x)
                arrays.append((f"{name}{i}", q))
                arrays.append((f"{name}{i}.scale", scale.astype("<f4")))
    arrays.append(("token_ids", np.asarray(chunk.token_ids).astype("<u4")))
    arrays.append(("embedding", np.asarray(chunk.embedding, dtype="<f4")))
    header = {
        "quantization": quantization,
        "num_layers": len(chunk.keys),
        "layers": list(chunk.layers) if chunk.layers is not None else None,
        "text": chunk.text,
        "meta": chunk.meta,
        "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in arrays],
    }
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    parts = [_MAGIC, struct.pack("<BI", _VERSION, len(head)), head]
    parts.extend(np.ascontiguousarray(a).tobytes() for _, a in arrays)
    return b"".join(parts)


def decode_chunk(data: bytes) -> ChunkEncoding:
    """Parse the chunk wire format; raises InvalidStoreRequest on anything malformed."""
    view = memoryview(data)
    if len(view) < 9 or bytes(view[:4]) != _MAGIC:
        raise InvalidStoreRequest("not a longserve chunk encoding (bad magic)")
    version, head_len = struct.unpack("<BI", view[4:9])
    if version != _VERSION or head_len > _MAX_HEADER or 9 + head_len > len(view):
        raise InvalidStoreRequest("unsupported or truncated chunk encoding header")
    try:
        header = json.loads(bytes(view[9 : 9 + head_len]).decode("utf-8"))
        offset = 9 + head_len
        arrays: dict[str, np.ndarray] = {}
        for name, dtype, shape in header["arrays"]:
            dt = np.dtype(dtype)
            if dt.str not in ("<f2", "<f4", "|i1", "<u4"):
                raise InvalidStoreRequest(f"unexpected dtype {dtype}")
            count = int(np.prod(shape)) if shape else 1
            nbytes = count * dt.itemsize
            if offset + nbytes > len(view):
                raise InvalidStoreRequest("truncated chunk encoding payload")
            arrays[name] = np.frombuffer(view[offset : offset + nbytes], dtype=dt).reshape(shape)
            offset += nbytes
        if offset != len(view):
            raise InvalidStoreRequest("trailing bytes after chunk encoding payload")
        quant = header["quantization"]
        keys, values = [], []
        for i in range(int(header["num_layers"])):
            pair = []
            for name in ("k", "v"):
                x = arrays[f"{name}{i}"]
                if quant == "int8":
                    x = (x.astype(np.float32) * arrays[f"{name}{i}.scale"]).astype(np.float16)
                pair.append(x.astype(np.float16, copy=False))
            keys.append(pair[0])
            values.append(pair[1])
        layers = header.get("layers")
        chunk = ChunkEncoding(
            keys=tuple(keys),
            values=tuple(values),
            token_ids=arrays["token_ids"].astype(np.int64),
            text=str(header["text"]),
            embedding=arrays["embedding"].astype(np.float32),
            layers=tuple(layers) if layers is not None else None,
            meta=dict(header.get("meta") or {}),
        )
    except InvalidStoreRequest:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidStoreRequest(f"malformed chunk encoding: {e}") from e
    chunk.validate()
    return chunk


# ---------------------------------------------------------------------------------------------
# Manifests and collection hits.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DocumentManifest:
    """A session's document: the model it was encoded with and its chunk hashes, in order."""

    doc_id: str
    fingerprint: str
    chunk_hashes: tuple[str, ...]
    name: str = ""
    num_tokens: int = 0
    created_at: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        return {
            "doc_id": self.doc_id,
            "fingerprint": self.fingerprint,
            "chunk_hashes": list(self.chunk_hashes),
            "name": self.name,
            "num_tokens": self.num_tokens,
            "created_at": self.created_at,
            "meta": self.meta,
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> DocumentManifest:
        try:
            return cls(
                doc_id=validate_id(str(rec["doc_id"]), "document id"),
                fingerprint=validate_id(str(rec["fingerprint"]), "model fingerprint"),
                chunk_hashes=tuple(validate_id(str(h), "chain hash") for h in rec["chunk_hashes"]),
                name=str(rec.get("name", "")),
                num_tokens=int(rec.get("num_tokens", 0)),
                created_at=float(rec.get("created_at", 0.0)),
                meta=dict(rec.get("meta") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, InvalidStoreRequest):
                raise
            raise InvalidStoreRequest(f"malformed manifest: {e}") from e


@dataclass(frozen=True)
class ChunkRef:
    """One hit of `select_chunks`: which chunk, and its score `EmbQ(x) . EmbD(c)`."""

    fingerprint: str
    chain_hash: str
    score: float


def embeddings_to_bytes(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x, dtype="<f4").tobytes()


def embeddings_from_bytes(data: bytes, dim: int) -> np.ndarray:
    arr = np.frombuffer(data, dtype="<f4")
    if dim <= 0 or arr.size % dim:
        raise InvalidStoreRequest("embedding bytes do not divide into rows of the given dimension")
    return arr.reshape(-1, dim).astype(np.float32)
