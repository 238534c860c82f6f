"""Chat and completions: request -> engine requests (one per choice) -> one response or SSE.

Rooms: context.py (what every serving function receives), checks.py (request checks and
sampling knobs), choices.py (the fan-out of n choices into engine requests and merging their
deltas), answer.py (gather or stream), sse.py (SSE framing), chat.py, completions.py.
"""
