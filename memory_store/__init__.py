"""longserve's memory service: the decoupled encoder-output store and the Larimar memory.

Modules: `backends` (storage: embedded files or Redis; the `StoreError` tree), `encodings`
(content-addressed chunk encodings, manifests, collections), `larimar` (per-session associative
memory), `embedder` (all-MiniLM-L6-v2, loaded lazily), `client` (the typed async client the
engine and server use), `app`/`settings`/`cli`/`metrics` (the `longserve memory-store` service).

Importing this package loads numpy at most; torch comes in only when the embedder first runs.
Nothing here imports engine/ or server/.
"""
