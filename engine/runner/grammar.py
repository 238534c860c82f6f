"""Structured outputs: JSON grammars enforced token by token, with llguidance.

`Grammars` (one per engine) turns a `StructuredOutput` into an llguidance grammar, once per
distinct schema (an LRU of compiled grammars), and refuses what llguidance cannot enforce
with InvalidRequest naming the feature. A request's `Constraint` (one per Generation, device
thread) masks the logits of every step to the tokens the grammar allows there and advances by
the token sampled; the end-of-turn token is allowed only where the JSON is complete.

llguidance was chosen over xgrammar and outlines-core by per-token cost and JSON-Schema
coverage measured on this CPU (docs/decisions/029-structured-outputs.md). Whitespace between
JSON tokens is not flexible: a small model otherwise spends its tokens on blank lines.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.protocol import InvalidRequest, StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

OVERRIDES: JsonCompileOptions = {"whitespace_flexible": False}


class Grammars:
    """The engine's grammar compiler: the tokenizer as llguidance sees it (built on first use)
    and an LRU of compiled grammars by response format."""

    def __init__(self, tokenizer: Any, eos_token_id: int | None, cache_size: int = 256) -> None:
        self._tokenizer = tokenizer
        self._eos = eos_token_id
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._cache: collections.OrderedDict[StructuredOutput, str] = collections.OrderedDict()
        self._cache_size = cache_size
        self.compile_seconds_total = 0.0
        self.compiled = 0  # cache misses: grammars compiled
        self.cache_hits = 0

    def ll_tokenizer(self) -> Any:
        import llguidance.hf

        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer, eos_token=self._eos
                )
            return self._ll_tokenizer

    def compile(self, fmt: StructuredOutput) -> str:
        """The llguidance grammar of fmt; InvalidRequest when it cannot be enforced."""
        with self._lock:
            cached = self._cache.get(fmt)
            if cached is not None:
                self._cache.move_to_end(fmt)
                self.cache_hits += 1
                return cached
        from llguidance import LLMatcher

        started = time.perf_counter()
        try:
            if fmt.type == "lark":
                grammar = LLMatcher.grammar_from_lark(fmt.schema or "")
            else:
                schema = (
                    {"type": "object"}
                    if fmt.type == "json_object"
                    else json.loads(fmt.schema or "")
                )
                grammar = LLMatcher.grammar_from_json_schema(schema, overrides=OVERRIDES)
            error = LLMatcher.validate_grammar(grammar, self.ll_tokenizer())
        except (ValueError, TypeError, RuntimeError) as e:
            error = str(e)
        if error:
            raise InvalidRequest(f"{fmt.param}: cannot be enforced: {error}", param=fmt.param)
        with self._lock:
            self.compile_seconds_total += time.perf_counter() - started
            self.compiled += 1
            self._cache[fmt] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def constraint(self, fmt: StructuredOutput) -> Constraint:
        return Constraint(self.ll_tokenizer(), self.compile(fmt))


class Constraint:
    """One request's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, ll_tokenizer: Any, grammar: str) -> None:
        from llguidance import LLMatcher

        self._matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidRequest(
                f"response_format: {self._matcher.get_error()}", param="response_format"
            )

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (its end token was taken, or the
        JSON value closed)."""
        return bool(self._matcher.is_stopped())

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (vocab,) with every token the grammar forbids next at -inf (a copy)."""
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(words, bitorder="little")[: logits.shape[-1]].astype(bool)
        if allowed.shape[0] < logits.shape[-1]:  # ids past the grammar's vocabulary: never
            allowed = np.pad(allowed, (0, logits.shape[-1] - allowed.shape[0]))
        forbidden = torch.from_numpy(~allowed).to(logits.device)
        return logits.masked_fill(forbidden, float("-inf"))

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"grammar refused token {token_id}: {self._matcher.get_error()}")
