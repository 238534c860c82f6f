"""What a Redis behind the memory service holds, by kind of key: one JSON line with Redis's
`used_memory`, then the bytes (`MEMORY USAGE`) and count of each key group, largest first.

A group is the key's namespace and the head of its path, `longserve:{enc}:piece:chunk` for
every chunk's pieces, `longserve:{sess}:piece:blob/...` for sessions' turn encodings. Run it
beside a soak to see what grows (docs/decisions/061-hostile-soak.md):

    longserve bench store_profile --port 6379
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import redis


def group(key: str) -> str:
    """`longserve:{sess:T.S}:piece:blob/turn/3` -> `longserve:{sess}:piece:blob/`."""
    if "{" not in key or "}" not in key:
        return key[:24]
    head, rest = key.split("{", 1)
    tag, path = rest.split("}", 1)
    return f"{head}{{{tag.split(':')[0]}}}{path[:12]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="longserve bench store_profile")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=6379)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    client = redis.Redis(host=args.host, port=args.port)
    sizes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for raw in client.scan_iter(count=1000):
        name = raw.decode()
        sizes[group(name)] += int(client.memory_usage(raw) or 0)
        counts[group(name)] += 1
    memory = client.info("memory")
    groups = [
        {"group": name, "keys": counts[name], "bytes": size}
        for name, size in sizes.most_common(args.top)
    ]
    print(json.dumps({"used_memory": memory["used_memory"], "groups": groups}))


if __name__ == "__main__":
    main()
