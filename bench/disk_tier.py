"""A long document in a session, its memory blocks held in RAM or spilled to the disk tier:
what the server's memory, the disk and the answers do, through the HTTP API.

Each cell starts its own server (`longserve serve`, nothing else running in it), uploads the
passkey document of bench/passkey.py (filler with a 5-digit key at a random depth, --lengths
tokens) to a new segments session, waits until it is read, then asks for the key by
completion on the session, exactly --max-tokens new tokens (ignore_eos). Cells:

- `ram`: LONGSERVE_SESSION_RAM_BYTES=0, the blocks stay in RAM (the default below 4 GiB);
- `disk`: LONGSERVE_SESSION_RAM_BYTES=--spill-at, so the session moves its blocks to the disk
  tier once they pass it (engine/memory/mapped.py), as every session past the setting does.

While a cell runs, the server's RssAnon (its own memory: what a 24 GB machine must hold) and
RssFile (mapped file pages the kernel may drop) are sampled every --every seconds. One JSON
line per cell: ingest seconds and tokens/s, TTFT and decode tokens/s of the answer, whether it
was right, the peaks, what the disk tier's files span (`longserve:memory_disk_bytes`), and
the samples when --series is given. The same key and depth for both settings of a length:

    longserve bench disk_tier --lengths 131072 --settings ram disk
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time

import httpx
import psutil

from bench.long_docs import ask, document, tokens_per_filler
from bench.passkey import first_number
from bench.recall_chat import upload
from bench.server_process import served

GiB = 1024**3


def status_kb(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of pid, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                out[name] = int(rest.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    """The server's RssAnon and RssFile every `every` seconds, until stopped."""

    def __init__(self, pid: int, every: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int, int]] = []
        self.started = time.perf_counter()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                rss = status_kb(self.pid)
            except OSError:
                return
            t = round(time.perf_counter() - self.started, 1)
            self.samples.append((t, rss.get("RssAnon", 0), rss.get("RssFile", 0)))
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def peak(self, column: int) -> int:
        return max((s[column] for s in self.samples), default=0)


def server_pid(base: str) -> int:
    """The pid of the server listening on base's port."""
    port = int(base.rsplit(":", 1)[1])
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "server.cli" in cmdline and "--port" in cmdline and str(port) in cmdline:
            return proc.pid
    raise RuntimeError(f"no server process on port {port}")


def gauge(http: httpx.Client, base: str, name: str) -> float | None:
    for line in http.get(f"{base}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


def cell(args: argparse.Namespace, length: int, setting: str, rng_seed: int) -> dict:
    rng = random.Random(rng_seed)
    spill = args.spill_at if setting == "disk" else 0
    env = {"LONGSERVE_SESSION_RAM_BYTES": str(spill), "HF_HUB_OFFLINE": "1"}
    serve_args = ["--device", args.device] + (["--model", args.model] if args.model else [])
    line: dict = {"bench": "disk_tier", "length": length, "setting": setting}
    line["session_ram_bytes"] = spill
    with served(None, serve_args=serve_args, ready_timeout=600, env=env) as base:
        http = httpx.Client(base_url=f"{base}/v1", timeout=args.timeout)
        model = http.get("/models").json()["data"][0]["id"]
        key, depth = str(rng.randint(10000, 99999)), rng.random()
        text = document(tokens_per_filler(http, model), length, key, depth, rng.randint(0, 10**6))
        sampler = Sampler(server_pid(base), args.every)
        sampler.start()
        try:
            idle = status_kb(sampler.pid)
            session, tokens, seconds = upload(http, {"strategy": "segments"}, text, args.timeout)
            read_at = len(sampler.samples)
            line |= {"depth": round(depth, 3), "tokens": tokens, "ingest_s": round(seconds, 1)}
            line["ingest_tok_s"] = round(tokens / seconds, 1)
            answer = ask(http, model, "", "segments", args.max_tokens, "completions", session)
            line |= answer
            line["correct"] = first_number(answer["answer"]) == key
            line["tier"] = http.get(f"/sessions/{session}").json()["memory"].get("tier")
            line["memory_disk_bytes"] = gauge(http, base, "longserve:memory_disk_bytes")
        finally:
            sampler.stop()
        line["rss_anon_idle"] = idle.get("RssAnon")
        line["rss_anon_peak"] = sampler.peak(1)
        line["rss_anon_peak_reading"] = max((s[1] for s in sampler.samples[:read_at]), default=0)
        line["rss_file_peak"] = sampler.peak(2)
        if args.series:
            line["samples"] = sampler.samples
    return line


def run(args: argparse.Namespace) -> None:
    for i, length in enumerate(args.lengths):
        for setting in args.settings:
            try:
                line = cell(args, length, setting, args.seed + i)
            except Exception as exc:  # a failed cell is reported; the rest still run
                line = {"bench": "disk_tier", "length": length, "setting": setting}
                line["error"] = f"{type(exc).__name__}: {exc}"[:400]
            print(json.dumps(line), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072])
    parser.add_argument("--settings", nargs="+", choices=("ram", "disk"), default=["ram", "disk"])
    parser.add_argument(
        "--spill-at", type=int, default=GiB // 4, help="the disk cell's session_ram_bytes"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--every", type=float, default=0.5, help="seconds between RSS samples")
    parser.add_argument("--series", action="store_true", help="print the RSS samples too")
    parser.add_argument("--device", default="auto", help="the server's --device")
    parser.add_argument("--model", default=None, help="the server's --model (default: embedded)")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
