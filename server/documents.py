"""Turning an upload into plain text: type detection, decoding, HTML and PDF extraction, and
name hygiene.

The type comes from the declared content type, else (missing or generic) from the file name's
extension. Text and Markdown are kept as they are; HTML loses its markup (script and style
dropped); PDF text comes from pypdf. Every failure is an APIError in OpenAI's shape, raised
before anything is stored: 415 unsupported type, 400 bad encoding / unreadable / empty, 413 too
large (bytes, pages, extracted characters), 422 over the time limit.

Extraction is CPU-bound and runs in a worker process per upload (server/extraction.py), killed
past its CPU or wall-clock limit; the PDF loop also checks the deadline between pages, to stop
with the page count's error rather than a kill. pypdf itself caps each decompressed stream
(pypdf.filters.ZLIB_MAX_OUTPUT_LENGTH and friends), which is what defuses zip-bomb streams.
"""

from __future__ import annotations

import codecs
import io
import posixpath
import re
import time
import unicodedata
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Literal

from server.errors import (
    APIError,
    document_extraction_timeout,
    document_too_large,
    empty_document,
    invalid_document,
    invalid_encoding,
    unsupported_media_type,
)

DocumentKind = Literal["text", "markdown", "html", "pdf"]

CONTENT_TYPES: dict[str, DocumentKind] = {
    "text/plain": "text",
    "text/markdown": "markdown",
    "text/x-markdown": "markdown",
    "text/html": "html",
    "application/xhtml+xml": "html",
    "application/pdf": "pdf",
    "application/x-pdf": "pdf",
}
EXTENSIONS: dict[str, DocumentKind] = {
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".html": "html",
    ".htm": "html",
    ".xhtml": "html",
    ".pdf": "pdf",
}
# Declared types that say nothing (curl and browsers send these for unknown extensions).
GENERIC_CONTENT_TYPES = {"", "application/octet-stream", "binary/octet-stream"}

MAX_NAME_CHARS = 255
DEFAULT_NAME = "untitled"


@dataclass(frozen=True)
class DocumentLimits:
    max_bytes: int
    max_chars: int
    max_pdf_pages: int
    timeout_seconds: float


@dataclass(frozen=True)
class Upload:
    """A document as it arrived: raw bytes with their declared type and file name (multipart),
    or text sent in JSON."""

    name: str | None = None
    data: bytes = b""
    content_type: str | None = None
    filename: str | None = None
    text: str | None = None


@dataclass(frozen=True)
class DocumentText:
    name: str
    kind: DocumentKind
    text: str


# ---------------------------------------------------------------------------------------------
# Names and types.
# ---------------------------------------------------------------------------------------------


def sanitize_name(name: str | None, fallback: str = DEFAULT_NAME) -> str:
    """The base name only (no directories, either slash), no control or format characters
    (which also drops bidi overrides that disguise extensions), at most MAX_NAME_CHARS."""
    if not name:
        return fallback
    cleaned = "".join(ch for ch in name if not unicodedata.category(ch).startswith("C"))
    base = posixpath.basename(cleaned.replace("\\", "/")).strip()
    if base in ("", ".", ".."):
        return fallback
    if len(base) > MAX_NAME_CHARS:
        stem, dot, ext = base.rpartition(".")
        if dot and 0 < len(ext) <= 16:  # keep the extension visible
            base = stem[: MAX_NAME_CHARS - len(ext) - 1] + "." + ext
        else:
            base = base[:MAX_NAME_CHARS]
    return base


def split_content_type(content_type: str | None) -> tuple[str, dict[str, str]]:
    """'Text/HTML; charset="UTF-8"' -> ("text/html", {"charset": "UTF-8"})."""
    if not content_type:
        return "", {}
    media, *params = content_type.split(";")
    parsed = {}
    for param in params:
        key, _, value = param.partition("=")
        if key.strip():
            parsed[key.strip().lower()] = value.strip().strip('"')
    return media.strip().lower(), parsed


def detect_kind(content_type: str | None, filename: str | None) -> DocumentKind:
    media, _ = split_content_type(content_type)
    if media in CONTENT_TYPES:
        return CONTENT_TYPES[media]
    if media in GENERIC_CONTENT_TYPES and filename:
        _, ext = posixpath.splitext(filename.lower())
        if ext in EXTENSIONS:
            return EXTENSIONS[ext]
    supported = ", ".join(sorted(CONTENT_TYPES))
    if media:
        shown = media
    elif filename:
        shown = f"file '{filename}'"
    else:
        shown = "an upload with no type"
    raise unsupported_media_type(
        f"Unsupported document type ({shown}). Supported: {supported} "
        "(or .txt, .md, .html, .pdf files sent as application/octet-stream)."
    )


# ---------------------------------------------------------------------------------------------
# Extraction.
# ---------------------------------------------------------------------------------------------


def decode_text(data: bytes, content_type: str | None) -> str:
    """Strict decoding with the declared charset (UTF-8 by default; a UTF-8 BOM is dropped)."""
    _, params = split_content_type(content_type)
    charset = params.get("charset", "utf-8")
    try:
        codec = codecs.lookup(charset).name
    except LookupError:
        raise invalid_encoding(f"Unknown charset '{charset}'.") from None
    if codec == "utf-8":
        codec = "utf-8-sig"
    try:
        text = data.decode(codec)
    except UnicodeDecodeError as exc:
        raise invalid_encoding(
            f"The document is not valid {charset} text (bad byte at offset {exc.start})."
        ) from None
    if "\x00" in text:
        raise invalid_encoding("The document contains NUL characters; is it a binary file?")
    return text


class _HTMLText(HTMLParser):
    """Collects the text of an HTML page: script/style/template content dropped, block
    elements on their own lines."""

    SKIPPED = {"script", "style", "template"}
    BLOCKS = {
        "address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt", "figcaption",
        "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li", "main",
        "nav", "ol", "p", "pre", "section", "table", "td", "th", "title", "tr", "ul",
    }  # fmt: skip

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.SKIPPED:
            self._skipping += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIPPED:
            self._skipping = max(0, self._skipping - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    lines = (re.sub(r"\s+", " ", line).strip() for line in "".join(parser.parts).split("\n"))
    return "\n".join(line for line in lines if line)


def pdf_to_text(data: bytes, limits: DocumentLimits, deadline: float) -> str:
    from pypdf import PdfReader  # imported on first use: most servers never see a PDF
    from pypdf.errors import LimitReachedError

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted and not reader.decrypt(""):
            raise invalid_document("The PDF is encrypted.")
        pages = len(reader.pages)
    except APIError:
        raise
    except LimitReachedError:
        raise _expands_too_far() from None
    except Exception as exc:
        raise invalid_document(f"The file is not a readable PDF ({type(exc).__name__}).") from None
    if pages > limits.max_pdf_pages:
        raise document_too_large(
            f"The PDF has {pages} pages; at most {limits.max_pdf_pages} are accepted."
        )
    texts: list[str] = []
    chars = 0
    for number in range(pages):
        if time.monotonic() > deadline:
            raise _too_slow(limits)
        try:
            text = reader.pages[number].extract_text() or ""
        except LimitReachedError:
            raise _expands_too_far() from None
        except Exception as exc:
            raise invalid_document(
                f"Page {number + 1} of the PDF cannot be read ({type(exc).__name__})."
            ) from None
        chars += len(text)
        if chars > limits.max_chars:
            raise _too_many_chars(limits)
        texts.append(text)
    return "\n\n".join(texts)


def extract_text(upload: Upload, limits: DocumentLimits, deadline: float) -> DocumentText:
    """The text of an upload, or an APIError. Synchronous: server/extraction.py runs it in a
    worker process."""
    if upload.text is not None:
        name = sanitize_name(upload.name)
        kind: DocumentKind = "text"
        if len(upload.text.encode("utf-8", "surrogatepass")) > limits.max_bytes:
            raise _too_many_bytes(limits)
        text = upload.text
        if "\x00" in text:
            raise invalid_encoding("The text contains NUL characters.")
    else:
        filename = sanitize_name(upload.filename, fallback="")
        name = sanitize_name(upload.name or filename)
        kind = detect_kind(upload.content_type, filename)
        if len(upload.data) > limits.max_bytes:
            raise _too_many_bytes(limits)
        if kind == "pdf":
            text = pdf_to_text(upload.data, limits, deadline)
        else:
            text = decode_text(upload.data, upload.content_type)
            if kind == "html":
                text = html_to_text(text)
    if len(text) > limits.max_chars:
        raise _too_many_chars(limits)
    if not text.strip():
        raise empty_document(
            "The document contains no text"
            + (" (a scanned PDF needs OCR first)." if kind == "pdf" else ".")
        )
    return DocumentText(name=name, kind=kind, text=text)


def _too_many_bytes(limits: DocumentLimits) -> APIError:
    return document_too_large(f"The document exceeds {limits.max_bytes} bytes.")


def _too_many_chars(limits: DocumentLimits) -> APIError:
    return document_too_large(f"The document's text exceeds {limits.max_chars} characters.")


def _expands_too_far() -> APIError:
    return document_too_large(
        "A compressed stream in the PDF expands past the decompression limit (a PDF bomb?)."
    )


def _too_slow(limits: DocumentLimits) -> APIError:
    return document_extraction_timeout(limits.timeout_seconds)
