"""The whole boundary between the HTTP server and the engine.

Pure Python (no torch): server/ imports this package and nothing else from engine/. An engine is
anything that implements `EngineClient` (contract.py); the real one lives in engine/client.py,
the tests have a fake one. Everything crossing the boundary is a plain dataclass (requests.py,
outputs.py) or one of the errors (errors.py); this module names them all in one place.
"""

from __future__ import annotations

from engine.protocol.contract import (
    EngineClient,
)
from engine.protocol.errors import (
    CollectionIncompatible,
    CollectionNotFound,
    EngineDead,
    EngineError,
    EngineOverloaded,
    InvalidRequest,
    MemoryBudgetExceeded,
    PromptTooLong,
    SessionNotFound,
    StoreUnavailableError,
    TooManyTokens,
)
from engine.protocol.outputs import (
    AlternativeLogprob,
    CollectionAttachment,
    EngineHealth,
    EngineStats,
    FinishReason,
    GenerationDelta,
    IngestProgress,
    ModelInfo,
    RequestStats,
    SessionMemoryInfo,
    SessionTurn,
    Tokenized,
    TokenizerInfo,
    TokenLogprob,
    ToolFormat,
)
from engine.protocol.requests import (
    MemorySpec,
    PreparedPrompt,
    Prompt,
    PromptMessage,
    SamplingParams,
    StructuredOutput,
    TokenPrompt,
)

__all__ = [
    "AlternativeLogprob",
    "CollectionAttachment",
    "CollectionIncompatible",
    "CollectionNotFound",
    "EngineClient",
    "EngineDead",
    "EngineError",
    "EngineHealth",
    "EngineOverloaded",
    "EngineStats",
    "FinishReason",
    "GenerationDelta",
    "IngestProgress",
    "InvalidRequest",
    "MemoryBudgetExceeded",
    "MemorySpec",
    "ModelInfo",
    "PreparedPrompt",
    "Prompt",
    "PromptMessage",
    "PromptTooLong",
    "RequestStats",
    "SamplingParams",
    "SessionMemoryInfo",
    "SessionNotFound",
    "SessionTurn",
    "StoreUnavailableError",
    "StructuredOutput",
    "TokenLogprob",
    "TokenPrompt",
    "Tokenized",
    "TokenizerInfo",
    "TooManyTokens",
    "ToolFormat",
]
