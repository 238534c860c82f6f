"""longserve's memory service: the decoupled encoder-output store and the Larimar memory.

Modules:

- `client` (the typed async client API and its factories; the only module, with `errors`, that
  server/ and engine/ import), `client_inprocess` and `client_http` (its two implementations),
  `errors` (the `StoreError` tree), `observed` (timing and labelling one operation).
- `keys` (`KeySpace`: every key the service uses), `retry` (bounded retries with backoff),
  `backends/` (storage: `base` interface and serializer, `embedded` files, `redis`).
- `encodings` (the chunk codec, manifests, collection hits), `encoding_store` (chunks,
  manifests and collections over a backend), `records` (generic records and blobs), `larimar`
  (per-session associative memory), `embedder` (all-MiniLM-L6-v2, loaded lazily).
- The `longserve memory-store` service: `app` (the FastAPI app), `routes/` (one router per
  resource), `service` (the state the routers share), `settings`, `metrics`, `cli`.

Importing this package loads numpy at most; torch comes in only when the embedder first runs.
Nothing here imports engine/ or server/.
"""
