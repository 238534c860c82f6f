"""Hostile PDFs for the soak's hostile tenants (bench/soak_hostile.py), written by hand (no PDF
library): valid files whose extraction is what hurts.

- `many_pages(n)`: n pages sharing one small content stream (a few KB for thousands of pages);
  past the server's page limit it should be refused unread.
- `slow_page(ops)`: one page whose content stream, compressed, holds `ops` text operators: a
  few hundred KB that pypdf parses for many seconds in pure Python.
- `bomb(expanded)`: one page whose compressed stream expands to `expanded` bytes (a PDF
  bomb: a few hundred KB that inflate past any decompression limit).
"""

from __future__ import annotations

import zlib

FONT = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"


def pdf_document(objects: list[bytes]) -> bytes:
    """A PDF of `objects` (object 1 is the catalog), with its cross-reference table."""
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\n" % (len(objects) + 1)
    out += b"startxref\n%d\n%%%%EOF\n" % xref
    return bytes(out)


def _stream(data: bytes, compress: bool) -> bytes:
    if compress:
        packed = zlib.compress(data, 9)
        return (
            b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(packed)
            + packed
            + (b"\nendstream")
        )
    return b"<< /Length %d >>\nstream\n" % len(data) + data + b"\nendstream"


def _pages(count: int, content: bytes, compress: bool) -> bytes:
    """Catalog (1), pages (2), font (3), content (4), then `count` pages all showing object 4."""
    first = 5
    kids = b" ".join(b"%d 0 R" % (first + i) for i in range(count))
    page = (
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
        b"/Resources << /Font << /F1 3 0 R >> >> /Contents 4 0 R >>"
    )
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % count,
        FONT,
        _stream(content, compress),
        *([page] * count),
    ]
    return pdf_document(objects)


def many_pages(count: int) -> bytes:
    text = b"BT /F1 12 Tf 72 720 Td (" + b"lantern " * 60 + b") Tj ET"
    return _pages(count, text, compress=False)


def slow_page(ops: int) -> bytes:
    content = b"BT /F1 12 Tf 72 720 Td " + b"(ab) Tj 1 0 Td " * ops + b"ET"
    return _pages(1, content, compress=True)


def bomb(expanded: int) -> bytes:
    content = b"BT /F1 12 Tf 72 720 Td (x) Tj ET\n" + b" " * expanded
    return _pages(1, content, compress=True)
