"""The HTTP server's settings (env prefix LONGSERVE_). The CLI only builds this class."""

from __future__ import annotations

import hashlib
import ipaddress
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_TENANT = "default"
LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tenant_of(api_key: str) -> str:
    """A short, stable, non-reversible tenant id for an API key."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:12]


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LONGSERVE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # Engine (passed on to engine.config.EngineConfig by the CLI).
    model: str | None = None
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    # Linear layers' weights in this precision ("auto": a GGUF on the CPU keeps each linear of
    # a quantized type it reads as the file holds it, "gguf"; anything else the model's dtype;
    # "float32" the dequantized reference).
    linear_dtype: str = "auto"
    # Plain requests' KV caches: "auto" (float16 under quantized linears, else "model"), "model"
    # or "float16".
    kv_dtype: str = "auto"
    # Plain requests' decode steps on a Llama-shaped model (Llama, Mistral, Qwen2, Qwen3, Phi-3)
    # skip transformers' forward (engine/runner/decode_step.py); false keeps it for every step.
    lean_decode: bool = True
    # Answer adapters served beside engine/adapters/'s, as "<model id>:<name>" ("name=path" or
    # a path, comma-separated in LONGSERVE_ADAPTERS); an operator's files, never a client's.
    adapters: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # The window of one forward (vLLM's --max-model-len); a longer prompt is read into memory.
    # None: the model's max_position_embeddings.
    max_model_len: int | None = Field(default=None, ge=2)
    max_waiting_requests: int = Field(default=64, ge=1)
    max_running_requests: int = Field(default=8, ge=1)
    # One API key's share of those (engine/scheduler/fair.py): past it that key gets the 429s,
    # the others are still queued. None: a quarter of the queue, and all running slots but a
    # quarter (16 and 6 of 64 and 8).
    max_waiting_requests_per_tenant: int | None = Field(default=None, ge=1)
    max_running_requests_per_tenant: int | None = Field(default=None, ge=1)
    # Float linears' decode steps as single-row forwards, so that a greedy answer does not
    # depend on other requests there too (int4 steps are so already; docs/decisions/055).
    batch_invariant: bool = False

    # Request limits, checked before anything reaches the engine.
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    max_tokens_limit: int = Field(default=4096, ge=1)
    max_n: int = Field(default=8, ge=1)
    max_prompt_tokens: int = Field(default=2_000_000, ge=1)
    max_stop_sequences: int = Field(default=8, ge=0)
    max_top_logprobs: int = Field(default=20, ge=0, le=20)
    max_schema_bytes: int = Field(default=64 * 1024, ge=2)  # response_format's JSON schema
    max_stored_responses: int = Field(default=1000, ge=0)  # per tenant, /v1/responses
    # Bytes of stored responses per tenant, every replica's (conversation, output, tools,
    # metadata as encoded in the store); past it store=true is a 429 (decision 058).
    max_stored_response_bytes_per_tenant: int = Field(default=64 * 1024**2, ge=0)

    # Sessions and their documents (server/sessions/, server/documents.py).
    max_sessions_per_tenant: int = Field(default=32, ge=1)
    max_documents_per_session: int = Field(default=64, ge=1)
    max_document_bytes: int = Field(default=20 * 1024 * 1024, ge=1)
    max_document_chars: int = Field(default=20_000_000, ge=1)  # text extracted from one upload
    max_pdf_pages: int = Field(default=2000, ge=1)
    document_extract_timeout_seconds: float = Field(default=30.0, gt=0)
    # Each extraction runs in a worker process (server/extraction.py), killed past the timeout
    # above (wall clock) or this much CPU time (None: the timeout, rounded up); this many at
    # once, this many of one API key, and an upload waits at most this long for a slot
    # (then 429 or 503 with Retry-After).
    document_extract_cpu_seconds: int | None = Field(default=None, ge=1)
    # ... and this much address space past what it starts with (RLIMIT_AS; 0: unlimited): a
    # crafted PDF whose streams expand to gigabytes fails there, not in the machine's memory.
    document_extract_memory_bytes: int = Field(default=1024**3, ge=0)
    document_extract_slots: int = Field(default=4, ge=1)
    document_extract_slots_per_tenant: int = Field(default=1, ge=1)
    document_extract_queue_seconds: float = Field(default=10.0, ge=0)
    # Uploaded text waiting for ingestion sits in RAM; this bounds it per tenant.
    max_pending_document_bytes_per_tenant: int = Field(default=256 * 1024 * 1024, ge=1)
    max_memory_tokens_per_tenant: int = Field(default=4_000_000, ge=1)
    default_session_ttl_seconds: int = Field(default=3600, ge=1)
    max_session_ttl_seconds: int = Field(default=7 * 24 * 3600, ge=1)
    session_sweep_interval_seconds: float = Field(default=30.0, gt=0)
    # A chat naming a session whose documents are still being read: wait for them, or 409.
    session_busy_policy: Literal["wait", "reject"] = "wait"
    session_wait_timeout_seconds: float = Field(default=300.0, ge=0)
    # A session idle this long moves from device to host memory (its next request brings it
    # back); 0 never moves it. Eviction is default_session_ttl_seconds' business.
    session_offload_after_seconds: float = Field(default=300.0, ge=0)
    # Memory blocks' disk tier (engine/memory/mapped.py): files mapped under memory_disk_dir
    # (default DATA_DIR/blocks, else the system's temporary directory), unlinked at once, at
    # most memory_disk_bytes over all sessions (0: no disk tier). A session whose blocks pass
    # session_ram_bytes moves them there instead of growing in RAM (0: never); memory knob
    # tier "disk" starts there.
    memory_disk_dir: str | None = None
    memory_disk_bytes: int = Field(default=32 * 1024**3, ge=0)
    session_ram_bytes: int = Field(default=4 * 1024**3, ge=0)
    # While the sessions' blocks in RAM pass this, the least recently used idle one moves
    # its blocks to the disk tier (0: never).
    memory_ram_bytes: int = Field(default=12 * 1024**3, ge=0)

    # Collections written by `longserve ingest`, attached to sessions (engine/client.py): one
    # of at most collection_max_chunks chunks loads whole; a larger one is searched per request
    # for its collection_top_k chunks nearest the question (EmbQ . EmbD).
    max_collections_per_session: int = Field(default=8, ge=0)
    collection_max_chunks: int = Field(default=64, ge=1)
    collection_top_k: int = Field(default=16, ge=1)
    # Memory sessions retrieve, next to attention, the blocks whose sentence embedding is
    # nearest the question's (the text prior; memory knobs prior_k, prior_u).
    text_prior: bool = True
    # Long prompts (inline documents) keep a copy of their memory near the document's end; a
    # later prompt of the same tenant starting with the same tokens reads only the rest. An LRU
    # by bytes, in host memory; 0 keeps none.
    prefix_cache_bytes: int = Field(default=8 * 1024**3, ge=0)
    # Prompts that fit the window keep their keys and values per whole prefill chunk; a
    # later prompt of the same tenant starting with the same chunks reads only the rest (a chat
    # that resends its conversation, many questions of one document). LRU by bytes; 0 keeps none.
    kv_prefix_cache_bytes: int = Field(default=2 * 1024**3, ge=0)
    # ... and, with this on, through the memory store too, for every replica: long prompts'
    # documents are written there chunk by chunk (fp16, about 23 KB per token for the embedded
    # model, kept as uploaded documents are), and a prompt on any replica imports its prefix.
    prefix_cache_store: bool = False
    # ... at most this many chunks per tenant, every replica's (about 4M tokens at 512-token
    # chunks, the memory-token budget); past it long prompts are read, not written (058).
    max_prefix_store_entries_per_tenant: int = Field(default=8192, ge=0)
    # Each time the engine goes idle, the C heap's free pages go back to the system; glibc
    # otherwise keeps what requests and readings freed (decisions/084).
    trim_heap: bool = True
    # A session turn's encodings are stored up to this size (about 46 KB per token for the
    # embedded model), so a restore needs no forward; a larger turn is stored as its tokens.
    max_turn_encoding_bytes: int = Field(default=64 * 1024**2, ge=0)
    # While a long prompt or document is read, the decode steps of the other running requests
    # get this share of the device (several tokens per reading chunk); 0: one per chunk.
    decode_share: float = Field(default=0.25, ge=0.0, lt=1.0)

    # Neurocache projections clients may name by id (`memory.projection`): files
    # <projection_dir>/<id>.pt the operator placed there. None: no projection can be named, and
    # no request ever names a file (engine/memory/projections.py).
    projection_dir: str | None = None
    max_projection_bytes: int = Field(default=256 * 1024**2, ge=1)
    # The event loop only does I/O (docs/decisions/057): prompts are tokenized, chat templates
    # applied and grammars compiled on preprocess_threads, one API key's on at most
    # preprocess_threads_per_tenant of them, max_preprocess_waiting_per_tenant more waiting
    # (then 429). Tools are bounded like OpenAI's (128 functions) and by their JSON's size.
    preprocess_threads: int = Field(default=2, ge=1)
    # torch's threads for the model's arithmetic (0: torch's default, one per core). Replicas
    # sharing a machine must split its cores: two replicas of all the cores each spin
    # OpenMP threads against each other (4x fewer answers on 2 cores, docs/decisions/061).
    threads: int = Field(default=0, ge=0)
    preprocess_threads_per_tenant: int = Field(default=1, ge=1)
    # Niceness added to the preprocessing threads and the extraction processes (0-19): a
    # tenant's 24 MB prompt or crafted PDF gets only the CPU the decode steps leave.
    background_nice: int = Field(default=10, ge=0, le=19)
    max_preprocess_waiting_per_tenant: int = Field(default=16, ge=1)
    max_tools: int = Field(default=128, ge=0)
    max_tools_bytes: int = Field(default=256 * 1024, ge=2)

    memory_store_url: str | None = None
    # The memory service's shared secret (LONGSERVE_MEMORY_STORE_TOKEN, the same on both sides).
    memory_store_token: SecretStr | None = None
    # The store's sweep, run by every replica (and the memory service): sessions expired
    # whichever replica held them, chunks nothing names idle this long (docs/decisions/059).
    store_reclaim_interval_seconds: float = Field(default=300.0, ge=0)  # 0: never
    store_chunk_grace_seconds: float = Field(default=3600.0, ge=0)
    data_dir: str = "./data"
    drain_timeout_seconds: float = Field(default=30.0, ge=0)

    @field_validator("api_keys", "adapters", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        """LONGSERVE_API_KEYS="k1,k2" (commas; LONGSERVE_ADAPTERS too), or a list."""
        if value is None:
            return []
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list | tuple):
            return [str(key).strip() for key in value if str(key).strip()]
        return value

    @model_validator(mode="after")
    def _refuse_open_public_bind(self) -> ServerSettings:
        if not self.api_keys and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on non-loopback host {self.host!r} without an API key: "
                "set LONGSERVE_API_KEYS (comma-separated) or pass --api-key, "
                "or bind to 127.0.0.1"
            )
        return self

    @model_validator(mode="after")
    def _refuse_unusable_session_limits(self) -> ServerSettings:
        if self.default_session_ttl_seconds > self.max_session_ttl_seconds:
            raise ValueError(
                f"default_session_ttl_seconds ({self.default_session_ttl_seconds}) exceeds "
                f"max_session_ttl_seconds ({self.max_session_ttl_seconds})"
            )
        if self.max_document_bytes > self.max_pending_document_bytes_per_tenant:
            raise ValueError(
                f"max_document_bytes ({self.max_document_bytes}) exceeds "
                f"max_pending_document_bytes_per_tenant "
                f"({self.max_pending_document_bytes_per_tenant}): no document could be uploaded"
            )
        return self

    def tenants(self) -> dict[str, str]:
        """API key -> tenant id. Empty when no key is configured (single tenant "default")."""
        return {key: tenant_of(key) for key in self.api_keys}

    def tenant_count(self) -> int:
        """How many tenants the configured API keys make (one, "default", without a key)."""
        return max(1, len(set(self.tenants().values())))
