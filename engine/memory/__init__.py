"""The session memory: documents longer than the model's window, read into a per-session
memory that every forward attends to through a frame (ARCHITECTURE.md section 3).

    session.py     SessionMemory, STRATEGIES - the only interface the rest of engine/ uses
    frame.py       FrameState: the frame [sinks | retrieved | local window | chunk], positions,
                   one layer's attention (reached through engine/runner/attention.py)
    band.py        a reading chunk's band attention, and the dtype it computes in
    step_cache.py  the decode-step path and what decode steps keep between steps
    buffers.py     GrowingBuffer, LayerStore: where each layer's keys and values live
    selector.py    Selector, the base class a strategy plugs into the frame
    rotary.py      un-rotating and re-rotating keys at frame positions
    config.py      one frozen dataclass of hyperparameters per strategy, MemorySpec parsing
    segments.py    CacheFormer (default)      tokens.py  Unlimiformer (decoder-only)
    neurocache.py  Neurocache                 index.py   kNN backends (torch exact, faiss)
"""
