"""Extraction that cannot hang (server/extraction.py), over HTTP with real worker processes: a
crafted PDF whose one page takes pypdf minutes gets a clean 422 at the time limit, its process
is killed, one key cannot hold every extraction slot, and waiting for a slot is bounded.

Before the worker processes, the crafted page held an extraction thread (of two per server) for
minutes after its request had given up: two such uploads blocked every other key's upload."""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

import httpx
import psutil
import pytest

from bench.crafted_pdf import pdf_document
from server.app import build_app
from server.settings import ServerSettings
from tests.server.conftest import API_KEY, asgi_client
from tests.server.fake_engine import FakeEngine
from tests.server.test_documents import make_pdf

OTHER_KEY = "sk-other-tenant"


def repeated_form_pdf(draws: int, operators: int) -> bytes:
    """One page drawing one form XObject `draws` times, the form holding `operators` text
    operators: pypdf's extract_text runs every operator of every draw (it stops only past 5000
    draws). 50 draws of 1,000 took 6.7 s here, so 5,000 draws take minutes, from 1 KB
    (docs/decisions/060)."""

    def stream(content: bytes, extra: bytes = b"") -> bytes:
        data = zlib.compress(content)
        head = b"<< /Length %d /Filter /FlateDecode %s >>\nstream\n" % (len(data), extra)
        return head + data + b"\nendstream"

    font = b"/Font << /F1 4 0 R >>"
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 5 0 R "
        b"/Resources << " + font + b" /XObject << /X 6 0 R >> >> >>",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        stream(b"/X Do " * draws),
        stream(
            b"BT /F1 12 Tf " + b"1 0 Td (a) Tj " * operators + b"ET",
            b"/Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources << " + font + b" >>",
        ),
    ]
    return pdf_document(objects)


CRAFTED = repeated_form_pdf(5000, 1000)


def build(**overrides: Any) -> Any:
    limits: dict[str, Any] = {
        "document_extract_timeout_seconds": 3.0,
        "document_extract_slots": 2,
        "document_extract_slots_per_tenant": 1,
        "document_extract_queue_seconds": 1.0,
    }
    settings = ServerSettings(api_keys=[API_KEY, OTHER_KEY], **{**limits, **overrides})
    return build_app(settings, FakeEngine("fake-model"))


async def upload(http: httpx.AsyncClient, session_id: str, data: bytes) -> httpx.Response:
    files = {"file": ("doc.pdf", data, "application/pdf")}
    return await http.post(f"/v1/sessions/{session_id}/documents", files=files, timeout=60)


async def new_session(http: httpx.AsyncClient) -> str:
    response = await http.post("/v1/sessions", json={})
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def extraction_processes() -> list[psutil.Process]:
    """The extraction processes of this process's forkserver: its children (they carry the
    forkserver's command line). Other suites' servers, and their forkservers, are left out."""
    found = []
    for child in psutil.Process().children(recursive=False):
        try:
            if "multiprocessing.forkserver" in " ".join(child.cmdline()):
                found += [p for p in child.children(recursive=True) if p.is_running()]
        except psutil.NoSuchProcess:
            continue
    return [p for p in found if _alive(p)]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_leaks_nothing(response: httpx.Response) -> None:
    body = response.text
    for leak in ("/", "Traceback", "pypdf", "Error(", "errno"):
        assert leak not in body.replace("https://", ""), body


async def test_a_crafted_page_is_stopped_at_the_limit_while_another_key_is_served():
    app = build()
    async with asgi_client(app) as hostile, asgi_client(app, OTHER_KEY) as honest:
        hostile_session, honest_session = await new_session(hostile), await new_session(honest)
        started = time.monotonic()
        crafted = asyncio.create_task(upload(hostile, hostile_session, CRAFTED))
        await asyncio.sleep(0.5)  # it holds its slot
        ordinary = await asyncio.wait_for(
            upload(honest, honest_session, make_pdf(["An ordinary page"])), 20
        )
        ordinary_s = time.monotonic() - started
        working = extraction_processes()  # the crafted page's process, still at it
        refused = await crafted
        refused_s = time.monotonic() - started
    print(f"ordinary upload answered after {ordinary_s:.2f} s, crafted after {refused_s:.2f} s")
    assert ordinary.status_code == 200, ordinary.text
    assert ordinary_s < refused_s  # served while the crafted page was still being read
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["code"] == "document_extraction_timeout"
    assert_leaks_nothing(refused)
    assert refused_s < 3.0 + 5.0  # the limit, and a loaded machine's slack
    assert len(working) == 1, working
    assert extraction_processes() == [], "the crafted page's process was not killed"
    async with asgi_client(app) as hostile:  # and the session holds no document of it
        listing = await hostile.get(f"/v1/sessions/{hostile_session}/documents")
    assert listing.json()["data"] == []


async def test_one_key_cannot_hold_every_slot_and_waits_are_bounded():
    app = build()
    async with asgi_client(app) as hostile, asgi_client(app, OTHER_KEY) as honest:
        session, other = await new_session(hostile), await new_session(honest)
        first = asyncio.create_task(upload(hostile, session, CRAFTED))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        second = asyncio.create_task(upload(hostile, session, CRAFTED))
        await asyncio.sleep(0.2)
        ordinary = await asyncio.wait_for(upload(honest, other, make_pdf(["Still served"])), 20)
        refused = await second
        waited = time.monotonic() - started
        await first
    assert ordinary.status_code == 200, ordinary.text
    assert refused.status_code == 429, refused.text  # its own share is held
    assert refused.json()["error"]["code"] == "document_extraction_busy"
    assert refused.headers["retry-after"] == "1"
    assert_leaks_nothing(refused)
    assert waited < 8.0, waited  # the queue's 1 s, not the crafted page's minutes


async def test_waiting_while_other_keys_hold_every_slot_is_a_503():
    app = build(document_extract_slots=1)
    async with asgi_client(app) as hostile, asgi_client(app, OTHER_KEY) as honest:
        session, other = await new_session(hostile), await new_session(honest)
        first = asyncio.create_task(upload(hostile, session, CRAFTED))
        await asyncio.sleep(0.5)
        refused = await upload(honest, other, make_pdf(["Waits for the slot"]))
        await first
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "document_extraction_busy"
    assert "retry-after" in refused.headers


@pytest.mark.parametrize("cpu_seconds", [1])
async def test_the_cpu_limit_ends_an_extraction_before_the_wall_clock(cpu_seconds: int):
    app = build(document_extract_timeout_seconds=60.0, document_extract_cpu_seconds=cpu_seconds)
    async with asgi_client(app) as http:
        session = await new_session(http)
        started = time.monotonic()
        refused = await upload(http, session, CRAFTED)
        elapsed = time.monotonic() - started
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["code"] == "document_extraction_timeout"
    assert elapsed < 30.0, elapsed  # far below the 60 s wall clock
    assert extraction_processes() == []


def expanding_pages(pages: int, expanded: int) -> bytes:
    """`pages` pages, each with its own compressed content stream expanding to `expanded`
    bytes, under pypdf's per-stream limit (75 MB): one stream is refused by pypdf itself, many
    such pages are not."""
    packed = zlib.compress(b"BT /F1 12 Tf 72 720 Td (x) Tj ET\n" + b" " * expanded, 9)
    stream = b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(packed)
    stream += packed + b"\nendstream"
    first = 4
    kids = b" ".join(b"%d 0 R" % (first + 2 * i) for i in range(pages))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % pages,
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i in range(pages):
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (first + 2 * i + 1)
        )
        objects.append(stream)
    return pdf_document(objects)


async def test_the_memory_limit_ends_an_extraction_cleanly():
    """pypdf reads one such page in about 7 s here and holds each page it read: a limit of a
    few pages' room ends it well before the wall clock (a 512 MB limit took 47 s here and
    passed the 60 s clock on CI's slower machine)."""
    bomb = expanding_pages(12, 70_000_000)  # 50 KB that inflate to 840 MB in pypdf's hands
    app = build(document_extract_timeout_seconds=300.0, document_extract_memory_bytes=160 * 1024**2)
    async with asgi_client(app) as http:
        session = await new_session(http)
        refused = await upload(http, session, bomb)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "invalid_document"
        assert_leaks_nothing(refused)
        assert extraction_processes() == []
        # the same limit leaves an ordinary PDF room
        read = await upload(http, session, make_pdf(["Page one.", "Page two."]))
        assert read.status_code == 200, read.text


async def test_the_memory_limit_counts_from_what_the_worker_starts_with():
    """A worker forked from a forkserver maps what the server's main module imported (torch's
    libraries in `longserve serve`: gigabytes); the limit is room on top of that, so a limit
    below the worker's own size still reads an ordinary PDF (every upload failed in the
    hostile soak when it was not)."""
    app = build(document_extract_memory_bytes=64 * 1024**2)
    async with asgi_client(app) as http:
        session = await new_session(http)
        read = await upload(http, session, make_pdf(["Page one.", "Page two."]))
        assert read.status_code == 200, read.text
