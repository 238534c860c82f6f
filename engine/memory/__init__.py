"""The session memory: documents longer than the model's window, read into a per-session
memory that every forward attends to through a frame (docs/architecture.md section 3).

    session.py     SessionMemory - the only interface the rest of engine/ uses
    strategies.py  STRATEGIES, and the selector each plugs into the frame
    transfer.py    a memory's encodings out to the memory store and back in, and its turns
    decode_row.py  a memory's one-token append as a row of a batched decode forward
    frame.py       Frame: the frame [sinks | retrieved | local window | chunk], one layer's
                   attention (reached through engine/runner/attention.py), commits
    frame_state.py FrameState, FrameMark: what a frame holds and its positions, read by the
                   helpers below (none of them imports frame.py)
    chunk.py       a chunk's attention over the whole frame concatenated
    band.py        a reading chunk's band attention, and the dtype it computes in
    step_cache.py  the decode-step path and what decode steps keep between steps
    buffers.py     GrowingBuffer, LayerStore: where each layer's keys and values live
    quantized.py   QuantizedBuffer: memory blocks in int8 (memory_dtype "int8", KIVI's split)
    mapped.py      the disk tier: memory blocks in mapped, unlinked sparse files (MappedBuffer)
    selector.py    Selector, the base class a strategy plugs into the frame
    rotary.py      un-rotating and re-rotating keys at frame positions
    config.py      one frozen dataclass of hyperparameters per strategy, MemorySpec parsing
    segments.py    CacheFormer (default)      tokens.py  Unlimiformer (decoder-only)
    neurocache.py  Neurocache                 index.py   kNN backends (torch exact, faiss)
    ranking.py     which rows a search keeps (fair_union), shared by tokens, key_sketch, neurocache
"""
