"""Engine hyperparameters: one frozen dataclass, built by the CLI / settings, read by the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LINEAR_DTYPES = (*DTYPES, "int4")
KV_DTYPES = ("auto", "model", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """How to load and run the model.

    model: None means the embedded SmolLM2-135M-Instruct GGUF; otherwise a local directory (with
    config.json), a local .gguf file, or a hub id already in the local cache.
    device: "auto" picks CUDA when available, else CPU; "cuda:1" style indices are accepted.
    dtype: "auto" is float32 on CPU and bfloat16 on CUDA.
    max_model_len: the window of one forward; None means the model's max_position_embeddings.
    max_memory_tokens: hard cap on the tokens a session's (or an ephemeral long prompt's) memory
    may hold.
    prefill_chunk_tokens: tokens per prefill / ingest step; the worker interleaves requests
    between steps, so this bounds how long one request can hold the device.
    memory_store_url: the memory service (`longserve memory-store`) that keeps document
    encodings; data_dir: keep them in an embedded store under DATA_DIR/memory-store instead.
    With neither, documents are only read into the sessions' memories (nothing is stored).
    memory_store_timeout_s: how long one store call may take before it counts as an outage.
    memory_store_token: the memory service's shared secret (LONGSERVE_MEMORY_STORE_TOKEN).
    session_offload_after_s: a session idle this long (no request or ingestion) moves from the
    device to host memory (SessionMemory.offload); its next request moves it back. 0 never.
    memory_disk_dir: where the disk tier keeps memory blocks (files unlinked as soon as they
    are mapped: engine/memory/mapped.py); None: DATA_DIR/blocks with a data_dir, else the
    system's temporary directory. memory_disk_bytes: the most the disk tier's files may span,
    over all sessions; 0 turns the tier off. session_ram_bytes: a session whose memory blocks
    pass this many bytes moves them to the disk tier instead of growing in RAM (0: never).
    memory_ram_bytes: while the sessions' memory blocks in RAM pass this, the least recently
    used idle session moves its blocks to the disk tier (checked every few seconds; 0: never).
    collection_max_chunks: a collection of at most this many chunks is read whole into a
    session's memory when attached (64 chunks of 512 tokens is about 32K tokens); a larger one
    is searched per request: EmbQ(last user message) picks its collection_top_k chunks.
    text_prior: give every memory session the text prior (engine/memory/prior.py: the
    sentence encoder's EmbQ(question) . EmbD(block) picks blocks next to attention); False,
    or no encoder installed, leaves the memory knobs prior_k/prior_u without effect.
    prefix_cache_bytes: memories kept for long prompts' reuse (engine/caches/prefix_cache.py), an LRU
    by bytes in host memory; 0 keeps none.
    kv_prefix_cache_bytes: keys and values kept for prompts that fit the window, per whole
    prefill chunk (engine/caches/kv_prefix.py), an LRU by bytes; 0 keeps none.
    trim_heap: each time the engine goes idle, hand the C heap's free pages back to the system
    (engine/scheduler/heap.py); without it glibc keeps what requests freed.
    prefix_cache_store: with a memory store, long prompts' documents are also read with
    write-through to it, chunk by chunk (fp16, about 23 KB per token for SmolLM2), so a later
    prompt on any replica imports what it shares with them (engine/caches/prefix_store.py). The store
    keeps those chunks as it keeps uploaded documents'.
    prefix_store_max_entries_per_tenant: the chunks one tenant's long prompts may write there,
    counted across replicas in the store's usage ledger; past it they are read, not written.
    linear_dtype: the precision the linear layers keep their weights in and multiply in
    (engine/runner/weights.py). "auto": a GGUF run on the CPU keeps each linear whose type is
    Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K or Q8_0 as the file holds it (resolved "gguf":
    engine/runner/gguf_linears.py), the others in the model's dtype; anything else keeps the
    model's dtype (engine/runner/loader.py's resolve_precision). "float32" forces the
    dequantized fp32 reference;
    "bfloat16" on a float32 CPU model halves the bytes a decode step reads; "int4" keeps 4-bit
    groups of 32 (Q4_1's grid; CPU only) and the output head in int8 rows (the GGUF's Q8_0);
    everything else stays in the model's dtype.
    kv_dtype: what KV caches hold keys and values in (plain requests' caches, and the sinks
    and local window of memory frames): "auto" is "float16" where the linears resolve to int4
    or gguf (quantized linears kept, as llama.cpp caches the same file) and "model" elsewhere; "model" the model's dtype;
    "float16" half of fp32, widened by the CPU decode kernels as they read them. Prefill
    attends them in the model's dtype. Memory blocks have their own knob (memory_dtype,
    engine/memory/config.py).
    adapters: answer adapter files ("name=path" or a path) served beside the ones shipped in
    engine/adapters/, each as the model id "<served model>:<name>" (engine/runner/adapter.py).
    lean_decode: decode steps of plain (non-memory) requests on a model of one of
    engine/runner/families.py's families (Llama, Mistral, Qwen2, Qwen3, Phi-3) run
    engine/runner/decode_step.py's lean step instead of transformers' forward (the same function in
    far fewer eager ops); False keeps transformers' forward for every step.
    decode_share: while a request is being read, the share of device time the decode steps of
    the other running requests get (the worker runs several decode steps per reading chunk);
    0 runs one decode step per reading chunk.
    batch_invariant: a request's greedy tokens do not depend on how many others decode beside
    it, with float linears too: a batched decode step runs as forwards of single rows where
    the linears multiply with torch's GEMM, whose rounding depends on the number of rows.
    Under the int4 kernels (rows never mix) a step always runs as forwards of at most 8 rows,
    invariant and faster past 8 than one GEMM forward (docs/decisions/055).
    max_waiting_requests_per_tenant / max_running_requests_per_tenant: one tenant's share of
    the waiting queue and of the running slots (engine/scheduler/fair.py): past it, that
    tenant's next request is refused (429) while the others' are still queued; running slots
    go to the tenant with the fewest running first. None: a quarter of max_waiting_requests,
    and all running slots but a quarter of them (docs/decisions/060).
    max_turn_encoding_bytes: a session turn's encodings go to the memory store up to this size
    (about 46 KB per token for SmolLM2 in fp32); a larger turn is stored as its tokens, which
    a restore reads again.
    projection_dir: the directory of neurocache projections clients name by id
    (`memory.projection`, engine/memory/projections.py); None: none can be named.
    max_projection_bytes: a projection file larger than this is refused.
    preprocess_threads, preprocess_threads_per_tenant, max_preprocess_waiting_per_tenant:
    prompts are tokenized and grammars compiled on this many threads, off the asyncio loop;
    one tenant's on at most preprocess_threads_per_tenant of them, at most
    max_preprocess_waiting_per_tenant more waiting (then 429; docs/decisions/057);
    preprocess_nice is added to those threads' niceness (decode steps come first).
    threads: torch's intra-op threads for the model's arithmetic (0: torch's default, one per
    core); set before anything runs in parallel (docs/decisions/061).
    """

    model: str | None = None
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_waiting_requests: int = 64
    max_running_requests: int = 8
    max_waiting_requests_per_tenant: int | None = None
    max_running_requests_per_tenant: int | None = None
    max_model_len: int | None = None
    max_memory_tokens: int = 2_000_000
    memory_strategy: str = "segments"
    prefill_chunk_tokens: int = 512
    memory_store_url: str | None = None
    data_dir: str | None = None
    memory_store_timeout_s: float = 30.0
    memory_store_token: str | None = field(default=None, repr=False)
    session_offload_after_s: float = 300.0
    memory_disk_dir: str | None = None
    memory_disk_bytes: int = 32 * 1024**3
    session_ram_bytes: int = 4 * 1024**3
    memory_ram_bytes: int = 12 * 1024**3
    collection_max_chunks: int = 64
    collection_top_k: int = 16
    text_prior: bool = True
    prefix_cache_bytes: int = 8 * 1024**3
    kv_prefix_cache_bytes: int = 2 * 1024**3
    trim_heap: bool = True
    prefix_cache_store: bool = False
    prefix_store_max_entries_per_tenant: int = 8192
    max_turn_encoding_bytes: int = 64 * 1024**2
    decode_share: float = 0.25
    linear_dtype: str = "auto"
    kv_dtype: str = "auto"
    lean_decode: bool = True
    adapters: tuple[str, ...] = ()
    batch_invariant: bool = False
    projection_dir: str | None = None
    max_projection_bytes: int = 256 * 1024**2
    preprocess_threads: int = 2
    threads: int = 0
    preprocess_threads_per_tenant: int = 1
    max_preprocess_waiting_per_tenant: int = 16
    preprocess_nice: int = 0

    def __post_init__(self) -> None:
        if self.model is not None and not self.model.strip():
            raise ValueError(
                "model must be a non-empty path or hub id (or None for the embedded one)"
            )
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must be non-empty when given")
        if self.device.split(":", 1)[0] not in DEVICES:
            raise ValueError(
                f"device must be one of {DEVICES} (optionally cuda:N), got {self.device!r}"
            )
        if self.device.startswith("cuda:") and not self.device[5:].isdigit():
            raise ValueError(f"bad CUDA device index in {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in (
            "max_waiting_requests",
            "max_running_requests",
            "max_memory_tokens",
            "prefill_chunk_tokens",
            "preprocess_threads",
            "preprocess_threads_per_tenant",
            "max_preprocess_waiting_per_tenant",
            "collection_max_chunks",
            "collection_top_k",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_waiting_requests_per_tenant", "max_running_requests_per_tenant"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not self.memory_strategy:
            raise ValueError("memory_strategy must be non-empty")
        if self.memory_store_url is not None and not self.memory_store_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                f"memory_store_url must be an http(s) URL, got {self.memory_store_url!r}"
            )
        if self.memory_store_url is not None and self.data_dir is not None:
            raise ValueError("give memory_store_url or data_dir (an embedded store), not both")
        if self.data_dir is not None and not self.data_dir.strip():
            raise ValueError("data_dir must be a non-empty path when given")
        if not self.memory_store_timeout_s > 0:
            raise ValueError("memory_store_timeout_s must be positive")
        if not isinstance(self.prefix_cache_bytes, int) or self.prefix_cache_bytes < 0:
            raise ValueError(
                f"prefix_cache_bytes must be an integer >= 0, got {self.prefix_cache_bytes!r}"
            )
        if not isinstance(self.kv_prefix_cache_bytes, int) or self.kv_prefix_cache_bytes < 0:
            raise ValueError(
                f"kv_prefix_cache_bytes must be an integer >= 0, got {self.kv_prefix_cache_bytes!r}"
            )
        if self.linear_dtype not in LINEAR_DTYPES:
            raise ValueError(
                f"linear_dtype must be one of {LINEAR_DTYPES}, got {self.linear_dtype!r}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if not 0.0 <= self.decode_share < 1.0:
            raise ValueError(f"decode_share must be in [0, 1), got {self.decode_share!r}")
        if not isinstance(self.max_turn_encoding_bytes, int) or self.max_turn_encoding_bytes < 0:
            raise ValueError("max_turn_encoding_bytes must be an integer >= 0")
        if self.projection_dir is not None and not self.projection_dir.strip():
            raise ValueError("projection_dir must be a non-empty path when given")
        if not isinstance(self.max_projection_bytes, int) or self.max_projection_bytes < 1:
            raise ValueError("max_projection_bytes must be a positive integer")
        if not self.session_offload_after_s >= 0:
            raise ValueError("session_offload_after_s must be >= 0 (0 never offloads)")
        for name in ("memory_disk_bytes", "session_ram_bytes", "memory_ram_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.memory_disk_dir is not None and not self.memory_disk_dir.strip():
            raise ValueError("memory_disk_dir must be a non-empty path when given")

    @property
    def waiting_per_tenant(self) -> int:
        """One tenant's share of the waiting queue."""
        if self.max_waiting_requests_per_tenant is not None:
            return min(self.max_waiting_requests_per_tenant, self.max_waiting_requests)
        return max(1, self.max_waiting_requests // 4)

    @property
    def running_per_tenant(self) -> int:
        """One tenant's share of the running slots."""
        if self.max_running_requests_per_tenant is not None:
            return min(self.max_running_requests_per_tenant, self.max_running_requests)
        return max(1, self.max_running_requests - self.max_running_requests // 4)
