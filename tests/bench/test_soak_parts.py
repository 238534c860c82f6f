"""The soak's parts that decide what it reports (bench/soak_*.py, bench/crafted_pdf.py): the
crafted PDFs are what they claim to a real pypdf, a curve's flatness, which answers count as
defects, and the sampler's numbers from a real Redis and real processes. The soak itself is a
benchmark, run by hand (docs/reliability.md)."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from collections import Counter

import psutil
import pytest
import redis
from pypdf import PdfReader
from pypdf.errors import LimitReachedError

from bench.crafted_pdf import bomb, many_pages, slow_page
from bench.soak_hostile import defects
from bench.soak_sampling import flatness, process_rss, redis_bytes
from tests.helpers import free_port
from tests.redis_process import RedisProcess


def test_many_pages_is_thousands_of_pages_in_a_small_file():
    data = many_pages(2500)
    reader = PdfReader(io.BytesIO(data))
    assert len(data) < 512 * 1024
    assert len(reader.pages) == 2500
    assert "lantern" in reader.pages[2499].extract_text()


def test_slow_page_holds_one_text_operator_per_pair_of_letters():
    data = slow_page(2000)
    text = PdfReader(io.BytesIO(data)).pages[0].extract_text()
    assert text.replace("\n", "") == "ab" * 2000
    assert len(data) < 4096  # compressed: the cost is in parsing, not in bytes


def test_bomb_expands_past_pypdf_s_decompression_limit():
    data = bomb(200_000_000)
    reader = PdfReader(io.BytesIO(data))
    assert len(data) < 512 * 1024
    with pytest.raises(LimitReachedError):
        reader.pages[0].extract_text()


def test_flatness_after_warm_up():
    warm_up = [(t, 100.0 * t) for t in range(10)]  # grows while warming up
    flat = warm_up + [(t, 1000.0 + (t % 3)) for t in range(10, 30)]
    summary = flatness(flat)
    assert summary is not None and summary["flat"] and summary["ratio"] == pytest.approx(1, 0.01)
    growing = [(t, 1000.0 + 100 * t) for t in range(30)]
    summary = flatness(growing)
    assert summary is not None and not summary["flat"] and summary["slope_pct_per_hour"] > 0
    assert flatness([(0, 1.0), (1, None), (2, 1.0)]) is None  # too few samples


def test_defects_are_5xx_and_broken_connections_only():
    seen = Counter(
        {"flood 429": 90, "flood 200": 6, "prompt 400": 1, "pdf 413": 3, "ids 404": 7,
         "metadata 500": 1, "prompt transport:RemoteProtocolError": 2, "stored 503": 1}
    )  # fmt: skip
    assert defects(seen) == {
        "metadata 500": 1,
        "prompt transport:RemoteProtocolError": 2,
        "stored 503": 1,
    }


def test_redis_bytes_counts_keys_and_memory(redis_server: RedisProcess):
    empty = redis_bytes([redis_server.port])
    client = redis.Redis(port=redis_server.port)
    client.mset({f"k{i}": b"x" * 10_000 for i in range(100)})
    client.close()
    full = redis_bytes([redis_server.port])
    assert empty["redis_keys"] == 0 and full["redis_keys"] == 100
    assert full["redis_used_memory"] - empty["redis_used_memory"] >= 100 * 10_000
    redis_server.kill()
    assert redis_bytes([redis_server.port]) == {"redis_used_memory": None, "redis_keys": None}


def test_process_rss_names_processes_by_port_and_adds_their_children():
    # A "service" listening on a port that starts a child (as a replica starts an extraction
    # worker); the port is not on its command line (Redis rewrites its own).
    port = free_port()
    service = (
        "import socket, subprocess, sys, time; s = socket.socket(); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], close_fds=True); "
        "time.sleep(30)"
    )
    proc = subprocess.Popen([sys.executable, "-c", service])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            rss = process_rss({port: "service", free_port(): "absent"})
            if "service+children" in rss:
                break
            time.sleep(0.1)
        assert set(rss) == {"service", "service+children"}
        assert all(value > 1_000_000 for value in rss.values())
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait()
