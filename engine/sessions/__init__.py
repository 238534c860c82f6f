"""Session backends: what keeps a session's memory between requests, and how a request runs on
it. `backend` is the interface the engine calls (`SessionBackend`) and what every generation runs
with (`Decoding`); `frame_backend` keeps each session's memory on the device, a `Conversation`
(`conversation`) holding its `SessionMemory`, its turns and its collections
(`document_collections`); `larimar` keeps it in the memory store's Larimar memory;
`memory_state` is how a generation reads and grows a memory, `prior_query` the text prior's query,
`frame_text` how an answer reads its frame afresh, `tiers` which tier idle sessions sit in.

Names, one per thing:
- Session: the API object a client creates (server/sessions/models.py `Session`).
- SessionRegistry: the server's live Sessions, by tenant (server/sessions/registry.py).
- SessionRecord: what the memory store keeps of a session (server/sessions/records.py).
- SessionStore: the server's reads and writes of SessionRecords (server/sessions/records.py).
- SessionMemory: a session's memory on the device, the frame and its blocks
  (engine/memory/session.py).
- Conversation: the engine's state of one session on the frame backend: its SessionMemory,
  the turns it holds, its attached collections.
- strategy: the kind of memory a session uses (segments, tokens, neurocache, larimar).
- SessionBackend: what keeps the memories of some strategies: FrameBackend (segments, tokens,
  neurocache) or LarimarBackend (larimar).
- DocumentCollections: collections of documents attached to conversations (`Collection`, one).
"""
