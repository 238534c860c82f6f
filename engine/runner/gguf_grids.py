"""The grids a GGUF file holds its linear layers on, read from the file's own blocks, so each
linear can be multiplied on exactly the weights the file holds
(docs/decisions/067-gguf-types-kept.md).

Every type read here is an integer code per weight times a scale per block of inputs, plus a
minimum per block of 32 for the asymmetric ones; llama.cpp's block layouts (ggml-quants.c):

    type   codes         scale per       minimum per 32    blocks of bytes
    Q4_0   0..15         32: d           -8 d              d, 16 B of nibbles
    Q4_1   0..15         32: d           m                 d, m, 16 B of nibbles
    Q4_K   0..15         32: d sc        -dmin mn          256 inputs: d, dmin, 12 B of 6-bit
                                                           sc and mn, 128 B of nibbles
    Q5_0   -16..15       32: d           -                 d, 4 B of fifth bits, nibbles
    Q5_1   0..31         32: d           m                 d, m, 4 B of fifth bits, nibbles
    Q5_K   0..31         32: d sc        -dmin mn          Q4_K's, with 32 B of fifth bits
    Q6_K   -32..31       16: d sc        -                 256 inputs: 128 B of low nibbles,
                                                           64 B of high pairs, 16 int8 sc, d
    Q8_0   -128..127     32: d           -                 d, 32 int8

(d, m, dmin fp16; a product of an fp16 and a small integer is exact in fp32, so
`Grid.dequantized` gives back what gguf-py's dequantize gives, bit for bit.) 4-bit codes go to
quant_linears.Int4Linear, the others to quant_linears.Int8Linear (engine/runner/gguf_linears.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
KEPT_TYPES = (*FOUR_BIT, "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")

# A GGUF decoder linear's name in the file (blk.N.<name>.weight) -> its module in a
# transformers Llama-shaped model (model.layers.N.<module>)
DECODER_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
HEAD = "lm_head"


@dataclass(frozen=True)
class Grid:
    """One linear's weights as its file holds them: w = code * scale (+ min), by block."""

    kind: str  # the GGUF type, one of KEPT_TYPES
    codes: torch.Tensor  # (N, K) int8
    scales: torch.Tensor  # (N, K / 32) fp32, or (N, K / 16) for Q6_K
    mins: torch.Tensor | None  # (N, K / 32) fp32; None where the type has none

    def dequantized(self) -> torch.Tensor:
        """The weights (N, K) in fp32."""
        n, k = self.codes.shape
        per_scale = k // self.scales.shape[1]
        w = self.codes.float().reshape(n, -1, per_scale) * self.scales[..., None]
        if self.mins is not None:
            w = w.reshape(n, -1, 32) + self.mins[..., None]
        return w.reshape(n, k)

    def rows(self, order: torch.Tensor) -> Grid:
        """The same grid with its rows in `order` (row i is this grid's row order[i])."""
        mins = None if self.mins is None else self.mins[order]
        return Grid(self.kind, self.codes[order], self.scales[order], mins)


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at bytes [at, at + 2) of each block, as fp32 (n, 1)."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes (n, 16) holding inputs j (low nibble) and j + 16 (high) -> codes (n, 32)."""
    return np.concatenate((packed & 15, packed >> 4), axis=1)


def _fifth_bits(packed: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's 4 bytes (n, 4), bit j the fifth bit of input j -> (n, 32) of 0 or 16."""
    return np.unpackbits(packed, axis=1, bitorder="little") << 4


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes (n, 12) -> the 6-bit scales and minimums (n, 8) of the 8 blocks of
    32: blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); blocks 4-7 take
    their low 4 bits from bytes 8-11 (scale low nibble, min high) and their top 2 from the
    spare top bits of bytes 0-3 and 4-7."""
    low, high, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate((low & 63, (extra & 15) | ((low >> 6) << 4)), axis=1)
    mins = np.concatenate((high & 63, (extra >> 4) | ((high >> 6) << 4)), axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


# Each decoder: blocks (n, bytes) of one type -> codes (n, inputs), scales (n, inputs / 32 or
# / 16) and minimums (n, inputs / 32) or None.
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _q4_0(b: np.ndarray) -> Decoded:
    d = _half(b, 0)
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 4:20]), _half(b, 0), _half(b, 2)


def _q5_0(b: np.ndarray) -> Decoded:
    codes = (_nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6])).astype(np.int8) - 16
    return codes, _half(b, 0), None


def _q5_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8]), _half(b, 0), _half(b, 2)


def _q8_0(b: np.ndarray) -> Decoded:
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8), _half(b, 0), None


def _k_low_nibbles(packed: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes (n, 128): each 32 bytes hold blocks 2i (low nibbles) and
    2i + 1 (high nibbles) of 32 inputs -> (n, 8, 32)."""
    pairs = packed.reshape(-1, 4, 1, 32)
    return np.concatenate((pairs & 15, pairs >> 4), axis=2).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray) -> Decoded:
    sc, mn = _k_scales(b[:, 4:16])
    codes = _k_low_nibbles(b[:, 16:144]).reshape(-1, 256)
    return codes, _half(b, 0) * sc, -(_half(b, 2) * mn)


def _q5_k(b: np.ndarray) -> Decoded:
    sc, mn = _k_scales(b[:, 4:16])
    # byte j of the 32 holds the fifth bit of input j of block i in its bit i
    fifth = np.unpackbits(b[:, 16:48, None], axis=2, bitorder="little").transpose(0, 2, 1)
    codes = (_k_low_nibbles(b[:, 48:176]) | (fifth << 4)).reshape(-1, 256)
    return codes, _half(b, 0) * sc, -(_half(b, 2) * mn)


def _q6_k(b: np.ndarray) -> Decoded:
    # two halves of 128 inputs, each four runs of 32: run t's low nibbles are the low (t 0, 1)
    # or high (t 2, 3) nibbles of bytes 0-31 (t even) or 32-63 (t odd) of the half's 64, and
    # its top 2 bits are bits 2t, 2t + 1 of the half's 32 high bytes
    low = b[:, 0:128].reshape(-1, 2, 1, 2, 32)
    low = np.concatenate((low & 15, low >> 4), axis=2).reshape(-1, 2, 4, 32)
    high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    codes = (low | ((high & 3) << 4)).astype(np.int8).reshape(-1, 256) - 32
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return codes, _half(b, 208) * scales, None


_DECODERS: dict[str, tuple[int, int, Callable[[np.ndarray], Decoded]]] = {
    # type: (inputs per block, bytes per block, decoder)
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
}


def decode(data: np.ndarray, kind: str) -> Grid:
    """A 2-D tensor's bytes as GGUFReader gives them, (N rows, bytes per row) uint8, of type
    `kind` (one of KEPT_TYPES) -> its Grid, rows in the file's order."""
    inputs, size, decoder = _DECODERS[kind]
    rows = data.shape[0]
    k = data.shape[1] // size * inputs
    codes, scales, mins = decoder(np.ascontiguousarray(data).reshape(-1, size))
    return Grid(
        kind,
        torch.from_numpy(codes.astype(np.int8).reshape(rows, k)),
        torch.from_numpy(np.ascontiguousarray(scales, np.float32).reshape(rows, -1)),
        None
        if mins is None
        else torch.from_numpy(np.ascontiguousarray(mins, np.float32).reshape(rows, -1)),
    )


def rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The order transformers' GGUF loader gives a llama q or k projection's rows (`heads` its
    heads: kv heads for k): llama.cpp's converter interleaved each head's two rotary halves,
    and the loader undoes that. Row i of the loaded weight is row order[i] of the file's."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def module_name(tensor: str, tied: bool) -> str | None:
    """The module of a transformers Llama-shaped model that the GGUF tensor `tensor` (its name)
    fills with a linear's weight, or None: blk.N.attn_q.weight -> model.layers.N.self_attn.q_proj,
    output.weight (or token_embd.weight where the head is tied to it) -> lm_head."""
    if tensor == "output.weight" or (tied and tensor == "token_embd.weight"):
        return HEAD
    parts = tensor.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight":
        module = DECODER_LINEARS.get(parts[2])
        return None if module is None else f"model.layers.{parts[1]}.{module}"
    return None


def linear_types(path: Path) -> dict[str, str]:
    """Module name -> GGUF type of every decoder linear and the output head of the GGUF at
    `path`; empty where its header cannot be read."""
    try:
        from gguf import GGUFReader

        tensors = GGUFReader(path).tensors
    except Exception as e:  # an unreadable header: nothing is kept on the file's grids
        logger.warning("cannot read the tensor types of %s: %s", path, e)
        return {}
    tied = all(t.name != "output.weight" for t in tensors)
    named = ((module_name(t.name, tied), t.tensor_type.name) for t in tensors)
    return {module: kind for module, kind in named if module is not None}


def read_grids(path: Path, heads: int, kv_heads: int) -> Iterator[tuple[str, Grid]]:
    """(module name, Grid) of every decoder linear and the output head of the GGUF at `path`
    whose type is in KEPT_TYPES, rows in the order transformers loads them (llama's q and k
    reordered by `rope_rows`, with the model's `heads` and `kv_heads`)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    field = reader.fields.get("general.architecture")
    arch = None if field is None else field.contents()
    tied = all(t.name != "output.weight" for t in reader.tensors)
    for tensor in reader.tensors:
        module = module_name(tensor.name, tied)
        kind = tensor.tensor_type.name
        if module is None or kind not in KEPT_TYPES or tensor.data.ndim != 2:
            continue
        grid = decode(tensor.data, kind)
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):
            count = heads if module.endswith("q_proj") else kv_heads
            grid = grid.rows(rope_rows(grid.codes.shape[0], count))
        yield module, grid
