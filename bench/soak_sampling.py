"""The soak's resource curves (bench/soak.py): every few seconds, the store's bytes (Redis's
`used_memory` and key count, the size on disk of each directory the run's processes write)
and the resident memory of every process the soak started, named by role so that a process
restarted by the chaos keeps its curve; then, per curve, whether it is flat after warm-up.

A process is found among the soak's descendants by the port it listens on (Redis, the memory
service, each replica); a process started by one of those (an extraction worker, a compiler)
is added to its `ROLE+children` curve.
"""

from __future__ import annotations

import contextlib
import csv
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import redis

# After the first third of the run (warm-up), a curve is flat when the mean of its last third
# is at most this multiple of the mean of its middle third.
FLAT_RATIO = 1.10


def directory_bytes(path: Path) -> int:
    """Apparent size of the files under path (0 when it is gone)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # deleted while walking
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def redis_bytes(ports: Sequence[int]) -> dict[str, int | None]:
    """used_memory summed over the nodes, keys over the primaries (replicas hold copies);
    None while a node does not answer (killed by the chaos)."""
    used = keys = 0
    for port in ports:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
        try:
            used += int(client.info("memory")["used_memory"])
            if client.info("replication")["role"] == "master":
                keys += int(client.dbsize())
        except redis.RedisError:
            return {"redis_used_memory": None, "redis_keys": None}
        finally:
            client.close()
    return {"redis_used_memory": used, "redis_keys": keys}


def _listening(proc: psutil.Process) -> set[int]:
    """The TCP ports a process listens on (Redis rewrites its command line, so not that)."""
    return {c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def process_rss(roles: dict[int, str]) -> dict[str, int]:
    """RSS in bytes per role (roles: port -> name) of this process's descendants."""
    found: dict[int, str] = {}  # pid -> role
    rss: dict[str, int] = {}
    children = psutil.Process().children(recursive=True)
    for proc in children:
        try:
            role = next((roles[port] for port in _listening(proc) if port in roles), None)
        except psutil.Error:
            continue
        if role is not None:
            found[proc.pid] = role
    for proc in children:
        try:
            # A forked child keeps its parent's command line: the nearest role above wins.
            above = next((p for p in proc.parents() if p.pid in found), None)
            if above is not None:
                role = found[above.pid] + "+children"
            elif proc.pid in found:
                role = found[proc.pid]
            else:
                continue
            rss[role] = rss.get(role, 0) + proc.memory_info().rss
        except psutil.Error:
            continue  # ended meanwhile
    return rss


class Sampler:
    """Collects one sample per call: {"t": seconds since start, name: value, ...}."""

    def __init__(
        self,
        roles: dict[int, str],
        directories: dict[str, Path],
        redis_ports: Callable[[], Sequence[int]] | None,
    ) -> None:
        self.roles, self.directories, self.redis_ports = roles, directories, redis_ports
        self.started = time.monotonic()
        self.samples: list[dict[str, Any]] = []

    def sample(self) -> None:
        row: dict[str, Any] = {"t": round(time.monotonic() - self.started, 1)}
        if self.redis_ports is not None:
            row.update(redis_bytes(self.redis_ports()))
        for name, path in self.directories.items():
            row[f"disk:{name}"] = directory_bytes(path)
        for role, value in sorted(process_rss(self.roles).items()):
            row[f"rss:{role}"] = value
        self.samples.append(row)

    def columns(self) -> list[str]:
        names: dict[str, None] = {}
        for row in self.samples:
            names.update(dict.fromkeys(row))
        return list(names)

    def write_csv(self, path: Path) -> None:
        with path.open("w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=self.columns(), restval="")
            writer.writeheader()
            writer.writerows(self.samples)

    def flatness(self) -> dict[str, dict[str, Any]]:
        return {
            name: summary
            for name in self.columns()
            if name != "t"
            and (summary := flatness([(r["t"], r.get(name)) for r in self.samples])) is not None
        }


def flatness(points: Sequence[tuple[float, float | None]]) -> dict[str, Any] | None:
    """A curve after warm-up (its first third dropped): the mean of its last third against its
    middle third, and its least-squares slope over both in % of the middle mean per hour.
    None with fewer than 6 samples (or none nonzero)."""
    kept = [(t, float(v)) for t, v in points if v is not None]
    if len(kept) < 6:
        return None
    third = len(kept) // 3
    middle, last = kept[third : 2 * third], kept[2 * third :]
    middle_mean = statistics.fmean(v for _, v in middle)
    last_mean = statistics.fmean(v for _, v in last)
    if middle_mean <= 0:
        return None
    after = middle + last
    slope = statistics.linear_regression([t for t, _ in after], [v for _, v in after]).slope
    ratio = last_mean / middle_mean
    return {
        "first": kept[0][1],
        "max": max(v for _, v in kept),
        "last": kept[-1][1],
        "middle_third_mean": round(middle_mean),
        "last_third_mean": round(last_mean),
        "ratio": round(ratio, 3),
        "slope_pct_per_hour": round(slope * 3600 / middle_mean * 100, 1),
        "flat": ratio <= FLAT_RATIO,
    }
