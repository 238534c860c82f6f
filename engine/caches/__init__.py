"""Caches and the memory store's I/O on the engine side. `store` is the bridge to the memory
store's client (its calls off the device thread, a document's chunks written and read back),
`prefix_cache` keeps the memories of long prompts' bodies in this process so a later prompt that
starts the same way resumes them, `prefix_store` does the same through the memory store for every
replica, and `ingest_cli` is `longserve ingest`, which writes a collection's chunks to the store.
"""
