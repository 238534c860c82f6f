"""The scheduler: one thread owns the device (`worker.Worker`); it takes jobs (generators of
device steps, with their mailboxes: `jobs`) from a queue, runs a session's jobs one at a time,
batches the decode steps of every running request together, and aborts or fails them. `stream`
bridges it to asyncio: `submit` queues a job and returns an async iterator of its outputs,
`on_device` runs one function on the device thread and awaits it. `preprocess` runs what must
not run on the event loop (tokenizing, chat templates, grammar compilation) on a few threads, a
share of them per tenant.
"""
