"""Documents of real text for `bench.recall`, read from what is installed on this machine.

Six kinds, none needing the network. Three were looked at while tuning (`tuned`):

- `manpages`: section-1 manual pages, rendered to text by `man` (the system's man pages);
- `docs`: installed documentation: the Python language reference that ships with CPython
  (`pydoc_data.topics`) and the plain-text READMEs, FAQs and manuals under /usr/share/doc;
- `docstrings`: the module, class and function docstrings in the source of the Python
  standard library and of the installed packages.

Three are kept aside (`held_out`, docs/decisions/069-recall-bench-that-can-tell.md): judged on,
never tuned on, and never a default while tuning:

- `news`: release notes and change logs: the NEWS, CHANGES, HISTORY and upstream changelog
  files under /usr/share/doc and in the installed packages (not Debian's packaging logs);
- `info`: the GNU manuals in Info format under /usr/share/info;
- `licenses`: licence and copyright texts: /usr/share/common-licenses, the Debian copyright
  files under /usr/share/doc, and the LICENSE, COPYING and NOTICE files installed packages ship.
  Licences repeat each other, so this kind holds about 95K tokens of distinct prose: documents
  up to 64K; `news` and `info` (about 180-210K tokens each) are the held-out default.

The `docs` kind skips the licence file names and most news ones and reads nothing under
/usr/share/info; `news` leaves it the rest, so no file is in a tuned and a held-out kind. A
held-out kind also drops a paragraph whose sentences mostly appeared earlier in the document
(every MIT copy, GPL versions, Info nodes that repeat their manual's introduction), and the
sentences that did from a paragraph it keeps.

No public-domain book ships with any installed package here, so there is no fiction kind.
Each text is cut into prose paragraphs (`prose_paragraphs`): code, tables, option lists and
short lines are dropped, and so is any paragraph holding a number of five or more digits, so a
planted value is the only one of its shape. A document is the prose of whole sources (files,
pages, topics) in a seeded order, every paragraph at most once, up to a number of tokens;
`build_document` plants a trial's facts in it and cuts what each baseline sends instead.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import itertools
import os
import random
import re
import subprocess
import sysconfig
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.recall_tasks import Trial, plant_facts

KIND_SETS = {
    "manpages": "tuned",
    "docs": "tuned",
    "docstrings": "tuned",
    "news": "held_out",
    "info": "held_out",
    "licenses": "held_out",
}
KINDS = tuple(KIND_SETS)
TUNED_KINDS = tuple(kind for kind, which in KIND_SETS.items() if which == "tuned")
HELD_OUT_KINDS = tuple(kind for kind, which in KIND_SETS.items() if which == "held_out")
DEFAULT_HELD_OUT = ("news", "info")  # the held-out kinds with prose enough for 128K
MAN_DIR = Path("/usr/share/man/man1")
DOC_DIR = Path("/usr/share/doc")
DOC_NAMES = re.compile(r"^(readme|faq|manual|.*\.txt)", re.IGNORECASE)
SKIP_NAMES = re.compile(r"changelog|copyright|licen[cs]e|copying|news|authors|todo", re.I)
LICENSE_DIR = Path("/usr/share/common-licenses")
INFO_DIR = Path("/usr/share/info")
LICENSE_NAMES = re.compile(r"^(licen[cs]e|copying|copyright|notice)", re.IGNORECASE)
TEXT_SUFFIXES = ("", ".txt", ".md", ".rst", ".gz")
NEWS_NAMES = re.compile(r"^(news|changes|changelog|history|release[-_ ]?notes)", re.IGNORECASE)

MIN_CHARS, MAX_CHARS, MIN_WORDS = 200, 2000, 30
PROSE_CHARS = re.compile(r"[A-Za-z ,.;:'\"()\-]")
MARKUP_CHARS = re.compile(r"[{}\[\]<>=|\\_$#*`~^@/]")
LONG_NUMBER = re.compile(r"\d{5,}")


def prose_paragraphs(text: str) -> list[str]:
    """The paragraphs of `text` (blocks between blank lines, lines joined) that read as prose:
    200-2000 characters, at least 30 words, a capital first letter and a full stop last, at
    least 90 % letters and punctuation, almost no markup, no number of five or more digits."""
    kept = []
    for block in re.split(r"\n\s*\n", text):
        paragraph = " ".join(re.sub(r"-\n\s*(?=[a-z])", "-", block).split())
        if not MIN_CHARS <= len(paragraph) <= MAX_CHARS:
            continue
        if not paragraph[0].isupper() or not paragraph.endswith("."):
            continue
        if len(paragraph.split()) < MIN_WORDS or LONG_NUMBER.search(paragraph):
            continue
        if len(PROSE_CHARS.findall(paragraph)) < 0.9 * len(paragraph):
            continue
        if len(MARKUP_CHARS.findall(paragraph)) > 0.01 * len(paragraph):
            continue
        kept.append(paragraph)
    return kept


# --- the sources of each kind: a sorted list of names and a reader of one ---------------------


@functools.cache
def man_pages() -> tuple[str, ...]:
    if not MAN_DIR.is_dir():
        return ()
    # the cloud SDK's thousands of generated pages repeat the same boilerplate paragraphs
    pages = (path for path in MAN_DIR.iterdir() if path.is_file())
    return tuple(sorted(str(path) for path in pages if not path.name.startswith("gcloud")))


def read_man_page(path: str) -> str:
    env = {**os.environ, "MANWIDTH": "2000", "MAN_KEEP_FORMATTING": "", "LC_ALL": "C.UTF-8"}
    result = subprocess.run(
        ["man", "-P", "cat", "-l", path], capture_output=True, text=True, env=env, timeout=60
    )
    return result.stdout if result.returncode == 0 else ""


@functools.cache
def doc_files() -> tuple[str, ...]:
    topics = tuple(f"pydoc:{name}" for name in sorted(python_reference()))
    if not DOC_DIR.is_dir():
        return topics
    files = [
        str(path)
        for path in DOC_DIR.rglob("*")
        if path.is_file()
        and DOC_NAMES.match(path.name.removesuffix(".gz"))
        and not SKIP_NAMES.search(path.name)
    ]
    return topics + tuple(sorted(files))


@functools.cache
def python_reference() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(topics)


def read_doc_file(name: str) -> str:
    if name.startswith("pydoc:"):
        return python_reference()[name.removeprefix("pydoc:")]
    try:
        if name.endswith(".gz"):
            with gzip.open(name, "rt", errors="replace") as f:
                return f.read(400_000)
        with open(name, errors="replace") as f:
            return f.read(400_000)
    except OSError:
        return ""


@functools.cache
def python_modules() -> tuple[str, ...]:
    """The standard library's modules, then the installed packages' (sorted within each)."""
    skip = ("test", "tests", "testing", "idlelib", "site-packages", "lib2to3", "turtledemo")
    modules: list[str] = []
    for key in ("stdlib", "purelib"):
        root = Path(sysconfig.get_paths()[key])
        modules += sorted(
            str(path)
            for path in root.rglob("*.py")
            if not any(part in skip for part in path.relative_to(root).parts)
        )
    return tuple(modules)


def read_docstrings(path: str) -> str:
    try:
        tree = ast.parse(Path(path).read_text(errors="replace"))
    except (SyntaxError, ValueError, OSError):
        return ""
    nodes = [tree] + [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    docstrings = (ast.get_docstring(node) for node in nodes)
    return "\n\n".join(doc for doc in docstrings if doc)


def package_files(names: re.Pattern[str]) -> list[str]:
    """Text files of the installed Python packages (site-packages) whose names match `names`."""
    root = Path(sysconfig.get_paths()["purelib"])
    return [
        str(path)
        for path in root.rglob("*")
        if names.match(path.name) and path.suffix.lower() in TEXT_SUFFIXES and path.is_file()
    ]


@functools.cache
def license_files() -> tuple[str, ...]:
    files = [str(path) for path in LICENSE_DIR.glob("*") if path.is_file()]
    if DOC_DIR.is_dir():
        files += [str(path) for path in DOC_DIR.glob("*/copyright") if path.is_file()]
    return tuple(sorted(files + package_files(LICENSE_NAMES)))


@functools.cache
def news_files() -> tuple[str, ...]:
    files = []
    if DOC_DIR.is_dir():
        files = [
            str(path)
            for path in DOC_DIR.rglob("*")
            if NEWS_NAMES.match(path.name) and "debian" not in path.name.lower() and path.is_file()
        ]
    tuned = set(doc_files())  # RELEASE-NOTES.txt, history.txt: the docs kind reads *.txt
    return tuple(sorted(name for name in files + package_files(NEWS_NAMES) if name not in tuned))


def read_license_file(name: str) -> str:
    """A licence text; a Debian copyright file writes its blank lines as " ." lines."""
    return re.sub(r"(?m)^[ \t]+\.[ \t]*$", "", read_doc_file(name))


@functools.cache
def info_files() -> tuple[str, ...]:
    if not INFO_DIR.is_dir():
        return ()
    return tuple(sorted(str(path) for path in INFO_DIR.glob("*.info*") if path.is_file()))


SOURCES: dict[str, tuple[Callable[[], tuple[str, ...]], Callable[[str], str]]] = {
    "manpages": (man_pages, read_man_page),
    "docs": (doc_files, read_doc_file),
    "docstrings": (python_modules, read_docstrings),
    "news": (news_files, read_doc_file),
    "info": (info_files, read_doc_file),
    "licenses": (license_files, read_license_file),
}


def source_order(kind: str, seed: int | str) -> list[str]:
    """The sources of `kind` in the order a document of this seed reads them."""
    names = list(SOURCES[kind][0]())
    if not names:
        raise SystemExit(f"no {kind} text on this machine (looked for {kind} sources)")
    random.Random(f"{kind}:{seed}").shuffle(names)
    return names


def kind_paragraphs(kind: str, seed: int | str) -> Generator[str, None, None]:
    """Prose paragraphs of `kind`, whole sources in seeded order, none twice (for a held-out
    kind, none whose sentences mostly appeared before)."""
    read = SOURCES[kind][1]
    seen: set[str] = set()
    sentences: set[str] = set()
    fresh_sentences = KIND_SETS.get(kind) == "held_out"
    names = source_order(kind, seed)
    # Rendering a man page is a subprocess: worth threads. ast.parse is not thread-safe on
    # CPython 3.11 ("AST constructor recursion depth mismatch"), so docstrings read in order.
    with ThreadPoolExecutor(max_workers=4) as pool:
        each = pool.map if kind == "manpages" else map
        for start in range(0, len(names), 16):
            for text in each(read, names[start : start + 16]):
                for paragraph in prose_paragraphs(text):
                    if paragraph in seen:
                        continue
                    seen.add(paragraph)
                    if fresh_sentences:  # licences share sentences: keep a paragraph's new ones
                        own = re.split(r"(?<=[.;:])\s+", paragraph)
                        new = [s for s in dict.fromkeys(own) if s not in sentences]
                        if 2 * len(new) < len(set(own)):
                            continue
                        sentences.update(own)
                        if len(new) < len(own):  # else as it was, whitespace and all
                            paragraph = " ".join(new)
                    yield paragraph


def filler(
    kind: str, seed: int | str, n_tokens: int, count_tokens: Callable[[list[str]], list[int]]
) -> list[tuple[str, int]]:
    """(paragraph, its token count) of `kind` up to n_tokens in all (a blank line between two
    counted as two tokens); the paragraphs of a shorter document of the same seed are the
    opening of a longer one's."""
    out: list[tuple[str, int]] = []
    total = 0
    paragraphs = kind_paragraphs(kind, seed)
    while True:
        batch = list(itertools.islice(paragraphs, 32))
        if not batch:
            raise SystemExit(f"not enough {kind} text on this machine for {n_tokens} tokens")
        for paragraph, tokens in zip(batch, count_tokens(batch), strict=True):
            if total + tokens + 2 > n_tokens:
                paragraphs.close()
                return out
            out.append((paragraph, tokens))
            total += tokens + 2


@dataclass
class Document:
    """One trial's long document, with what each baseline sends instead."""

    paragraphs: list[str]
    tokens: int
    reference: str
    reference_tokens: int
    tail: str
    tail_tokens: int
    chunks: list[str] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    chunk_vectors: np.ndarray | None = None

    @property
    def text(self) -> str:
        return "\n\n".join(self.paragraphs)


def load_token_counter(model: str | None) -> Callable[[list[str]], list[int]]:
    """Token counts of texts by the served model's tokenizer (the embedded GGUF by default)."""
    from transformers import AutoTokenizer

    from engine.runner.loader import embedded_model_path

    if model is None:
        path = embedded_model_path()
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    elif model.endswith(".gguf"):
        tokenizer = AutoTokenizer.from_pretrained(
            os.path.dirname(model) or ".", gguf_file=os.path.basename(model)
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)

    def count(texts: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]

    return count


def digest(text: str) -> str:
    """A document's sha256 (12 hex). Documents are made of this machine's installed text, so
    another machine's packages make another document from the same seed (decision 089)."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build_document(trial: Trial, kind: str, seed: str, length: int, fit: int, count) -> Document:
    fact_tokens = sum(count([fact.sentence for fact in trial.facts])) + 2 * len(trial.facts)
    paragraphs = [p for p, _ in filler(kind, seed, length - fact_tokens, count)]
    planted = plant_facts(paragraphs, trial.facts)
    short = [p for p, _ in filler(kind, seed, fit - fact_tokens, count)]
    reference = "\n\n".join(plant_facts(short, trial.facts))
    sizes = count(planted)
    tail: list[str] = []
    total = 0
    for paragraph, size in zip(reversed(planted), reversed(sizes), strict=True):
        if total + size + 2 > fit:
            break
        tail.insert(0, paragraph)
        total += size + 2
    doc = Document(planted, 0, reference, count([reference])[0], "\n\n".join(tail), 0)
    doc.tokens = count([doc.text])[0]
    doc.tail_tokens = count([doc.tail])[0]
    return doc


def chunk_document(doc: Document, count, chunk_tokens: int, embed) -> None:
    chunks: list[list[str]] = [[]]
    sizes = [0]
    for paragraph, size in zip(doc.paragraphs, count(doc.paragraphs), strict=True):
        if chunks[-1] and sizes[-1] + size > chunk_tokens:
            chunks.append([])
            sizes.append(0)
        chunks[-1].append(paragraph)
        sizes[-1] += size + 2
    doc.chunks = ["\n\n".join(chunk) for chunk in chunks]
    doc.chunk_tokens = sizes
    doc.chunk_vectors = embed(doc.chunks)


def retrieve(doc: Document, query: str, budget: int, embed) -> tuple[str, int]:
    """The chunks nearest `query` (cosine) that fit `budget` tokens, in document order."""
    assert doc.chunk_vectors is not None
    scores = doc.chunk_vectors @ embed([query])[0]
    picked, used = [], 0
    for i in np.argsort(-scores):
        if used + doc.chunk_tokens[i] <= budget:
            picked.append(int(i))
            used += doc.chunk_tokens[i]
    return "\n\n".join(doc.chunks[i] for i in sorted(picked)), used
