"""The model runner: everything that turns token ids into the next token on the device. `loader`
builds the model (with `weights` lowering its linears, `attention` registering the memory and
KV-cache attention with transformers), `cpu_extensions` compiles the C++ kernels of `csrc/` that
`cpu_attention` and `weights` call, `kv_cache` holds a plain request's keys and values,
`decode_state` is what the model has read for one request, and `generate` runs one request as a
generator of device steps: prefill, then one `decode_step` per token over the rows (`rows`) of
every request decoding together, `sampling` picking the token, `grammar` constraining it,
`detokenize` turning it into text. `chat_template` renders chat messages into ids, `tokenize`
encodes long texts in pieces so that no thread holds the GIL long. Nothing here
knows about sessions, the store or the scheduler's queue.
"""
