"""Hyperparameters of the memory strategies: one frozen dataclass per strategy.

Knob names follow the papers (k, u, w, c, m, r, d). Every config shares the frame knobs
(`sinks`, `local_window`, `chunk_size`) and says how many retrieved tokens it may put in the
frame (`retrieval_budget`); `parse_memory_spec` turns a client's `MemorySpec` into one of these,
refusing unknown knobs, bad values and frames that would not fit in the model's window with
`InvalidRequest(param="memory.<knob>")`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from engine.protocol import InvalidRequest, MemorySpec


@dataclass(frozen=True)
class FrameConfig:
    """The frame every forward attends to: [sinks | retrieved | local window | current chunk].

    sinks: first tokens of the session, always attended (attention sinks).
    local_window: most recent tokens, always attended; older ones go to memory.
    chunk_size: tokens per forward while reading a prompt or document.
    block: tokens moved from the local window to memory at a time (and, for `segments`, the
        unit retrieved).
    m: memory capacity in tokens (FIFO, as in Neurocache); 0 keeps everything.
    tail: the last `tail` tokens of an append longer than that are forwarded on their own, so
        the tokens whose logits are returned (the end of a question) retrieve for themselves
        instead of sharing a retrieval with a whole chunk of document; 0 disables it.
    read_retrieval: 1 lets every forward retrieve from memory; 0 (default) lets only forwards
        of at most `tail` tokens retrieve (the question's tail forward and decode steps),
        while the chunks of a long append (document reading) attend to sinks + local window +
        chunk only. Every token is still stored and retrievable later (its upper-layer keys
        and values were computed without long-range context). With chunk_size <= tail, or
        tail 0 (no forward of its own for the question), every forward retrieves
        (docs/decisions/011-read-without-retrieval.md).
    read_window: how much of the local window a reading chunk attends (a forward that does
        not retrieve, once the session is longer than sinks + local window): every token of
        the chunk attends the sinks and at least the `read_window` tokens before it, at most
        read_window + 127 (query rows go in blocks of 128, each attending one contiguous
        slice: see band.attend_band); 0 (or anything from local_window up) means the whole
        window. The question's tail, decode steps and every forward while the session still
        fits attend the whole window, so a session that fits is still exactly the model's own
        attention (docs/decisions/012-read-band.md).
    read_dtype: the precision of a reading chunk's band attention (the read_window
        attention above; nothing else). "model" computes it in the model's dtype; "bfloat16"
        rounds its queries, keys and values to bfloat16 (the kernels accumulate in fp32) and
        casts the output back; "auto" (default) is "bfloat16" for an fp32 model on a device
        with native bfloat16 matrix units (a CPU with AMX or AVX512-BF16, a CUDA GPU that
        supports bfloat16) and "model" elsewhere (docs/decisions/013-read-dtype.md). The keys
        and values a session stores stay in the model's dtype.
    prior_k, prior_u: the text prior (prior.py): a question retrieves, besides what the
        strategy picks, the prior_k memory blocks whose sentence embedding EmbD is nearest
        the question's EmbQ, each with prior_u neighbouring blocks on either side (the
        Decoupled Context Processing seed's k-argmax); prior_k 0 turns it off. Left unset,
        prior_k is 8, or fewer when the frame would not fit the model's window. It needs the
        engine's sentence encoder; a memory without one reserves no frame positions for it
        (docs/decisions/022-text-prior.md).
    prior_order: where the prior's blocks sit among the retrieved rows. "relevance"
        (default): the strategy's own rows in document order, then the prior's blocks from the
        least to the most relevant, so the block nearest EmbQ sits right before the window and
        the question (docs/decisions/024-prior-order-relevance.md). "document": every
        retrieved row in document order.
    prior_match: how the prior scores a block. "named" (default): hybrid, and the margin
        also keeps every line whose block holds all the names the question gives (its
        capitalized words and words with digits), so all of a key's facts stay (decisions 086,
        099). "hybrid": EmbQ . EmbD plus half the IDF-weighted share of the question's words
        the block holds (lexical.py), pinning only the lines within 0.1 of the best when those
        words single blocks out, so fewer same-kind sentences reach an answer read afresh.
        "dense": EmbQ . EmbD alone, the prior_k best (docs/decisions/074-lexical-prior.md,
        082-hybrid-prior-with-answers-read-afresh.md).
    answer_read: how a question's answer reads what its retrieval chose. "afresh" (default):
        the frame's tokens (sinks, the retrieved rows of the last layer, the window with the
        question) read again by the model's own attention in a plain cache, and the answer
        generated there; the session still reads the question and the answer into memory
        (engine/sessions/frame_text.py; docs/decisions/076-answer-read-afresh.md). Needs the
        text prior's token ids; without them the answer reads memory. "memory": attention over
        the frame's stored keys and values, as the seeds do.
    contrast: context-aware decoding's alpha (CAD, Shi et al. 2023) for an answer read
        afresh: each next token is scored (1 + alpha) log p(y | frame) - alpha log p(y | the
        request without retrieved rows or window), so tokens the model would write without
        the document (counting on from a number it copied) lose to those the frame supports.
        It costs a second, short row in every decode step. 0.5 by default; 0 turns it off
        (engine/runner/contrast.py; docs/decisions/097-context-aware-decoding.md, 099).
    copy_numbers: for an answer read afresh, the shortest digit run that must copy a number
        the frame holds: once the answer's run reaches this many digits it may only continue
        as a prefix of one of the frame's numbers and end where that number ends, so codes,
        amounts and dates are copied, not invented or counted on (engine/runner/copy_numbers.py;
        docs/decisions/098-numbers-copied.md). Shorter runs are free. 0 (default) turns it off;
        needs a tokenizer with one token per digit.
    tier: where memory blocks live. "device" (default) keeps them beside the model; "host"
        keeps them in (page-locked) host memory and copies only the rows a forward retrieves
        to the device, so a GPU holds sinks, window, summaries and indices while the bulk of
        a long session sits in host RAM. Sinks and window always stay on the device. On a
        CPU-only machine both tiers are the same memory. "disk" keeps them in files the
        server maps (engine/memory/mapped.py): what a step reads comes through the page
        cache, the rest stays on disk. Any session also moves there once its blocks pass the
        server's session_ram_bytes (docs/decisions/077-memory-on-disk.md).
    memory_dtype: what memory blocks hold their keys and values in. "int8" (default): 8-bit
        codes, keys with a scale per channel over each block and values a scale per token
        (KIVI's split; quantized.py), about half of float16's bytes, widened where a block is
        read; held-out answers at 32K, passkey and the decode step as float16's
        (docs/decisions/070-int8-memory-blocks.md). "float16" half precision, as the memory
        store keeps them (the CPU kernel widens them as it reads; other paths cast the rows
        they take to the model's dtype). "model" the model's dtype. "auto": "float16" for a
        float32 model, else "model" (a bfloat16 model's range is kept). segments' block
        summaries are held in the same dtype (maxima rounded up, minima down), as "auto" under
        "int8". Sinks and the local window follow the engine's kv_dtype (float16 under int4
        weights, else the model's dtype; docs/decisions/041-float16-memory.md,
        045-memory-step-fixed-cost.md).
    """

    sinks: int = 64
    local_window: int = 1024
    chunk_size: int = 512
    block: int = 64
    m: int = 0
    tail: int = 32
    read_retrieval: int = 0
    read_window: int = 512
    read_dtype: str = "auto"
    tier: str = "device"
    memory_dtype: str = "int8"
    prior_k: int = 8
    prior_u: int = 1
    prior_order: str = "relevance"
    prior_match: str = "named"
    answer_read: str = "afresh"
    contrast: float = 0.5
    copy_numbers: int = 0

    def tail_start(self, total: int) -> int:
        """Where the last `tail` tokens of an append of `total` tokens begin (they are
        forwarded on their own); `total` when they are not split off."""
        return total - self.tail if self.tail and total > self.tail else total

    def retrieves(self, num_tokens: int) -> bool:
        """Whether a forward of num_tokens tokens retrieves from memory (see read_retrieval)."""
        return bool(self.read_retrieval) or not self.tail or num_tokens <= self.tail

    @property
    def retrieval_budget(self) -> int:
        """Frame slots for retrieved memory: the strategy's own and the text prior's."""
        return self.strategy_budget + self.prior_k * (2 * self.prior_u + 1) * self.block

    @property
    def strategy_budget(self) -> int:
        return 0


@dataclass(frozen=True)
class SegmentsConfig(FrameConfig):
    """CacheFormer: top-k segments (blocks of `block` tokens), scored on compressed summaries,
    retrieved uncompressed together with u neighbouring segments on each side.

    score: block summary used for scoring. "bound" (default) is a Quest-style upper bound of
        the best token score in the block (per-dimension max/min of its keys); "mean" is
        CacheFormer's compressed segment (the mean pre-rotary key of the block, per KV head).
    select: who picks the top-k. "consensus" (default): a forward's block scores add up over
        the KV heads and the layers, and layer l takes the top-k of the sum over layers 0..l,
        the same blocks for all its KV heads. "head": every layer and KV head picks its own
        top-k, as CacheFormer does per head.
    Defaults: sinks 64, block 64, k 8, u 1, local window 1024, chunk 512: frame
    64 + 8*3*64 + 1024 + 512 = 3136 tokens (docs/decisions/014-segments-ranking.md).
    """

    k: int = 8
    u: int = 1
    score: str = "bound"
    select: str = "consensus"

    @property
    def strategy_budget(self) -> int:
        return self.k * (2 * self.u + 1) * self.block


@dataclass(frozen=True)
class TokensConfig(FrameConfig):
    """Unlimiformer for decoder-only models: per augmented layer and KV head, the top-k
    individual memory tokens from a kNN index over pre-rotary keys.

    layers: augmented layers ("all", "upper" = upper half, or a comma list "20,22,24").
    index: "auto" | "sketch" | "torch" | "faiss-flat" | "faiss-hnsw" | "faiss-ivf". "sketch"
        (key_sketch.py): every key scored exactly from a float16 dimension-major copy of the
        keys, streamed (docs/decisions/051-tokens-exact-scan.md); "auto" is "sketch" on a CPU
        and index.py's "auto" elsewhere; "torch" scans every key exactly (index.py).
    max_queries: query rows of a chunk used to search (evenly spaced, the last one always in).

    Unlimiformer's overlapping chunk encoding needs no knob here: every chunk attends to the
    local window (the previous `local_window` tokens), which is the overlap, and each token is
    stored exactly once, when it first leaves the window (the "keep every non-overlapping token"
    rule).
    """

    k: int = 256
    layers: str = "all"
    index: str = "auto"
    max_queries: int = 64

    @property
    def strategy_budget(self) -> int:
        return self.k


@dataclass(frozen=True)
class NeurocacheConfig(FrameConfig):
    """Neurocache: compressed states c = W_p h_r at layer r (d dims), one kNN retrieval per
    forward, each hit extended by the retrieval window w (the hit and its w-1 right
    neighbours), plus the retrievals of the previous c-1 forwards; layers j > r attend to the
    retrieved positions. m (FIFO capacity) defaults to unbounded here.

    r: layer whose output is compressed; -1 means layer num_layers // 6. The paper puts r at
        3/4 of the depth, where its trained cache attention takes over; without that training
        the upper quarter alone cannot use what it retrieves
        (docs/decisions/015-neurocache-layer.md).
    d: compressed size; 0 means hidden/4.
    fit_tokens: W_p is the PCA of the session's first fit_tokens memory states (fitted once).
    projection: the id of a trained W_p to use instead, {"weight": (d, hidden), "mean":
        (hidden,)} in the operator's projection directory (projections.py); never a path.
    """

    k: int = 64
    w: int = 2
    c: int = 2
    r: int = -1
    d: int = 0
    fit_tokens: int = 1024
    projection: str = ""
    max_queries: int = 64

    @property
    def strategy_budget(self) -> int:
        return self.k * self.w * self.c


CONFIGS: dict[str, type[FrameConfig]] = {
    "segments": SegmentsConfig,
    "tokens": TokensConfig,
    "neurocache": NeurocacheConfig,
}

_CHOICES = {
    "score": ("mean", "bound"),
    "select": ("consensus", "head"),
    "index": ("auto", "sketch", "torch", "faiss-flat", "faiss-hnsw", "faiss-ivf"),
    "tier": ("device", "host", "disk"),
    "memory_dtype": ("auto", "model", "float16", "int8"),
    "read_dtype": ("auto", "model", "bfloat16"),
    "prior_order": ("document", "relevance"),
    "prior_match": ("hybrid", "named", "dense"),
    "answer_read": ("memory", "afresh"),
}
_MAY_BE_ZERO = {
    "m",
    "u",
    "d",
    "fit_tokens",
    "tail",
    "read_retrieval",
    "read_window",
    "prior_k",
    "prior_u",
    "copy_numbers",
}
_MAY_BE_NEGATIVE = {"r"}


def parse_memory_spec(spec: MemorySpec | None, *, max_positions: int) -> FrameConfig:
    """Validate a client's MemorySpec against the strategy's config and the model's window."""
    spec = spec or MemorySpec()
    if spec.strategy not in CONFIGS:
        raise InvalidRequest(
            f"unknown memory strategy {spec.strategy!r}; choose one of {sorted(CONFIGS)}",
            param="memory.strategy",
        )
    cls = CONFIGS[spec.strategy]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for name, value in dict(spec.params or {}).items():
        if name not in fields:
            raise InvalidRequest(
                f"unknown knob {name!r} for memory strategy {spec.strategy!r}",
                param=f"memory.{name}",
            )
        values[name] = _check_value(name, value, type(fields[name].default))
    config = cls(**values)
    if "prior_k" not in values:  # the default, cut to what the model's window leaves
        spare = max_positions - config.sinks - config.local_window - config.chunk_size
        line = (2 * config.prior_u + 1) * config.block
        fits = max(0, spare - config.strategy_budget) // line
        config = dataclasses.replace(config, prior_k=min(config.prior_k, fits))
    _check_config(config, max_positions)
    return config


MAX_LEAST = 32  # copy_numbers: a run this long is a code by any reading
MAX_CONTRAST = 4.0  # CAD's alpha: the paper uses 0.5-1; far above, the frame alone decides


def _check_value(name: str, value: Any, kind: type) -> Any:
    param = f"memory.{name}"
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequest(f"memory.{name} must be a number", param=param)
        if not 0 <= value <= MAX_CONTRAST:
            raise InvalidRequest(f"memory.{name} must be from 0 to {MAX_CONTRAST}", param=param)
        return float(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequest(f"memory.{name} must be an integer", param=param)
        if name in _MAY_BE_NEGATIVE:
            return value
        if value < 0 or (value == 0 and name not in _MAY_BE_ZERO):
            raise InvalidRequest(f"memory.{name} must be positive", param=param)
        if name == "copy_numbers" and value > MAX_LEAST:
            raise InvalidRequest(f"memory.{name} must be from 0 to {MAX_LEAST}", param=param)
        return value
    if not isinstance(value, str):
        raise InvalidRequest(f"memory.{name} must be a string", param=param)
    if name == "projection":
        return check_projection_id(value)
    if name in _CHOICES and value not in _CHOICES[name]:
        raise InvalidRequest(f"memory.{name} must be one of {_CHOICES[name]}", param=param)
    return value


PROJECTION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_projection_id(value: str) -> str:
    """`value` if it is a projection id (letters, digits, `_.-`, not starting with `.`): a
    file name in the operator's directory, never a path."""
    if not PROJECTION_ID.fullmatch(value):
        raise InvalidRequest(
            "memory.projection must be a projection id: 1 to 64 letters, digits, '_', '.' or "
            "'-', starting with a letter or digit",
            param="memory.projection",
        )
    return value


def _check_config(config: FrameConfig, max_positions: int) -> None:
    frame = config.sinks + config.retrieval_budget + config.local_window + config.chunk_size
    if frame > max_positions:
        raise InvalidRequest(
            f"the frame (sinks + retrieval budget + local_window + chunk_size = {frame}) exceeds "
            f"the model's window of {max_positions} positions",
            param="memory.local_window",
        )
    if config.local_window < config.block:
        raise InvalidRequest("memory.local_window must be at least one block", param="memory.block")
    if config.m and config.m < config.block:
        raise InvalidRequest("memory.m must be 0 or at least one block", param="memory.m")


def parse_layers(layers: str, num_layers: int, param: str = "memory.layers") -> tuple[int, ...]:
    """'all', 'upper' (upper half) or a comma list of layer indices (negatives count back)."""
    if layers == "all":
        return tuple(range(num_layers))
    if layers == "upper":
        return tuple(range(num_layers // 2, num_layers))
    try:
        picked = sorted({int(x) % num_layers for x in layers.split(",") if x.strip()})
        if any(not -num_layers <= int(x) < num_layers for x in layers.split(",") if x.strip()):
            raise ValueError
    except ValueError as e:
        raise InvalidRequest(
            "memory.layers must be 'all', 'upper' or a comma list of layer indices", param=param
        ) from e
    if not picked:
        raise InvalidRequest("memory.layers names no layer", param=param)
    return tuple(picked)
