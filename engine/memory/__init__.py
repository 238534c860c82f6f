"""The session memory: documents longer than the model's window, read into a per-session
memory that every forward attends to through a frame (ARCHITECTURE.md section 3).

    session.py     SessionMemory, STRATEGIES - the only interface the rest of engine/ uses
    attention.py   the attention function registered with transformers' AttentionInterface
    frame.py       the frame [sinks | retrieved | local window | chunk] and per-layer stores
    rotary.py      un-rotating and re-rotating keys at frame positions
    config.py      one frozen dataclass of hyperparameters per strategy, MemorySpec parsing
    segments.py    CacheFormer (default)      tokens.py  Unlimiformer (decoder-only)
    neurocache.py  Neurocache                 index.py   kNN backends (torch exact, faiss)
"""
