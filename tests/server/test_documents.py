"""Uploads into text (server/documents.py): names, types, encodings, HTML, PDF and its caps."""

from __future__ import annotations

import io
import time

import pytest
from pypdf import PdfWriter

from bench.crafted_pdf import pdf_document
from server import documents
from server.documents import (
    DocumentLimits,
    Upload,
    detect_kind,
    extract_text,
    html_to_text,
    sanitize_name,
)
from server.errors import APIError

LIMITS = DocumentLimits(max_bytes=1 << 20, max_chars=1 << 20, max_pdf_pages=10, timeout_seconds=5)


def make_pdf(pages: list[str]) -> bytes:
    """A minimal hand-written PDF: one Helvetica text line per page."""
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(len(pages)))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {len(pages)} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i, text in enumerate(pages):
        content = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 3 0 R >> >> /Contents {5 + 2 * i} 0 R >>".encode()
        )
        objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    return pdf_document(objects)


def blank_pdf() -> bytes:
    writer = PdfWriter()
    writer.add_blank_page(width=612, height=792)
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def file_upload(data: bytes, content_type: str | None, filename: str = "doc") -> Upload:
    return Upload(data=data, content_type=content_type, filename=filename)


def extract(upload: Upload, limits: DocumentLimits = LIMITS) -> str:
    return extract_text(upload, limits, time.monotonic() + limits.timeout_seconds).text


def code_of(exc: pytest.ExceptionInfo[APIError]) -> tuple[int, str | None]:
    return exc.value.status_code, exc.value.code


# --- names and types --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("report.pdf", "report.pdf"),
        ("../../etc/passwd", "passwd"),
        ("/abs/path/notes.md", "notes.md"),
        ("C:\\Users\\eve\\secret.txt", "secret.txt"),
        ("bad\x00na\x1bme\x7f.txt", "badname.txt"),
        ("invoice\u202efdp.exe", "invoicefdp.exe"),  # a bidi override would disguise the type
        ("..", "untitled"),
        ("dir/", "untitled"),
        ("", "untitled"),
        (None, "untitled"),
        ("  spaced.txt  ", "spaced.txt"),
    ],
)
def test_sanitize_name(raw: str | None, clean: str) -> None:
    assert sanitize_name(raw) == clean


def test_long_names_are_capped_keeping_the_extension() -> None:
    name = sanitize_name("x" * 1000 + ".md")
    assert len(name) == documents.MAX_NAME_CHARS
    assert name.endswith(".md")


@pytest.mark.parametrize(
    ("content_type", "filename", "kind"),
    [
        ("text/plain", "a.bin", "text"),
        ("Text/Markdown; charset=utf-8", None, "markdown"),
        ("text/html; charset=UTF-8", "a.txt", "html"),  # the declared type wins
        ("application/pdf", None, "pdf"),
        ("application/octet-stream", "notes.MD", "markdown"),
        (None, "page.htm", "html"),
        ("", "paper.pdf", "pdf"),
    ],
)
def test_detect_kind(content_type: str | None, filename: str | None, kind: str) -> None:
    assert detect_kind(content_type, filename) == kind


@pytest.mark.parametrize(
    ("content_type", "filename"),
    [("image/png", "a.png"), ("text/csv", "a.csv"), ("image/png", "a.txt"), (None, "a.docx")],
)
def test_unsupported_types_are_415(content_type: str | None, filename: str) -> None:
    with pytest.raises(APIError) as exc:
        detect_kind(content_type, filename)
    assert code_of(exc) == (415, "unsupported_media_type")


# --- text and encodings -----------------------------------------------------------------------


def test_text_and_markdown_are_kept_verbatim() -> None:
    markdown = "# Title\n\n* one\n* **two**\n"
    assert extract(file_upload(markdown.encode(), "text/markdown")) == markdown
    assert extract(file_upload("café\n".encode(), "text/plain")) == "café\n"


def test_utf8_bom_is_dropped_and_declared_charsets_are_honoured() -> None:
    assert extract(file_upload(b"\xef\xbb\xbfhello", "text/plain")) == "hello"
    assert extract(file_upload("café".encode("latin-1"), "text/plain; charset=latin-1")) == "café"


@pytest.mark.parametrize(
    ("data", "content_type"),
    [
        (b"\xff\xfe\xfa not utf-8", "text/plain"),
        (b"caf\xe9", "text/markdown"),
        (b"<p>\xc3\x28</p>", "text/html"),
        (b"text", "text/plain; charset=klingon"),
        (b"binary\x00data", "text/plain"),
    ],
)
def test_undecodable_bytes_are_invalid_encoding(data: bytes, content_type: str) -> None:
    with pytest.raises(APIError) as exc:
        extract(file_upload(data, content_type))
    assert code_of(exc) == (400, "invalid_encoding")


@pytest.mark.parametrize("text", ["", "   \n\t ", "<script>x()</script>"])
def test_empty_documents_are_400(text: str) -> None:
    with pytest.raises(APIError) as exc:
        extract(file_upload(text.encode(), "text/html"))
    assert code_of(exc) == (400, "empty_document")


def test_size_and_char_limits_are_413() -> None:
    small = DocumentLimits(max_bytes=10, max_chars=5, max_pdf_pages=10, timeout_seconds=5)
    with pytest.raises(APIError) as exc:
        extract(file_upload(b"x" * 11, "text/plain"), small)
    assert code_of(exc) == (413, "document_too_large")
    with pytest.raises(APIError) as exc:
        extract(Upload(text="y" * 11), small)
    assert code_of(exc) == (413, "document_too_large")
    with pytest.raises(APIError) as exc:
        extract(file_upload(b"abcdefg", "text/plain"), small)  # 7 chars > 5
    assert code_of(exc) == (413, "document_too_large")


# --- HTML -------------------------------------------------------------------------------------


def test_html_markup_is_stripped() -> None:
    html = """<!doctype html><html><head><title>T&amp;C</title>
    <style>body { color: red }</style><script>alert("no")</script></head>
    <body><h1>Heading</h1><p>First   paragraph &lt;b&gt; with <b>bold</b>.</p>
    <ul><li>one</li><li>two</li></ul><script type="module">var hidden = 1;</script>
    <template><p>not rendered</p></template></body></html>"""
    text = html_to_text(html)
    assert text.splitlines() == [
        "T&C",
        "Heading",
        "First paragraph <b> with bold.",
        "one",
        "two",
    ]
    assert "alert" not in text and "color" not in text and "hidden" not in text


# --- PDF --------------------------------------------------------------------------------------


def test_pdf_text_is_extracted() -> None:
    text = extract(file_upload(make_pdf(["Hello PDF world", "Second page"]), "application/pdf"))
    assert "Hello PDF world" in text
    assert "Second page" in text


def test_pdf_page_limit() -> None:
    limits = DocumentLimits(
        max_bytes=1 << 20, max_chars=1 << 20, max_pdf_pages=2, timeout_seconds=5
    )
    with pytest.raises(APIError) as exc:
        extract(file_upload(make_pdf(["a", "b", "c"]), "application/pdf"), limits)
    assert code_of(exc) == (413, "document_too_large")
    assert "3 pages" in exc.value.message


def test_pdf_extracted_chars_limit_stops_early() -> None:
    limits = DocumentLimits(max_bytes=1 << 20, max_chars=20, max_pdf_pages=10, timeout_seconds=5)
    with pytest.raises(APIError) as exc:
        extract(
            file_upload(make_pdf(["fifteen chars..", "fifteen more..."]), "application/pdf"), limits
        )
    assert code_of(exc) == (413, "document_too_large")


def test_pdf_past_its_deadline_is_422() -> None:
    upload = file_upload(make_pdf(["late"]), "application/pdf")
    with pytest.raises(APIError) as exc:
        extract_text(upload, LIMITS, deadline=time.monotonic() - 1)
    assert code_of(exc) == (422, "document_extraction_timeout")


def test_unreadable_and_blank_pdfs() -> None:
    with pytest.raises(APIError) as exc:
        extract(file_upload(b"%PDF-1.4 this is not really a pdf", "application/pdf"))
    assert code_of(exc) == (400, "invalid_document")
    with pytest.raises(APIError) as exc:
        extract(file_upload(blank_pdf(), "application/pdf"))
    assert code_of(exc) == (400, "empty_document")
