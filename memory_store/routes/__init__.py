"""The memory service's HTTP routers, one per resource: `encodings` (chunks, manifests,
collections), `records` (records and blobs), `larimar`. Each is built over one
`MemoryStoreService`; `memory_store.app` mounts them."""
