"""The package sources an image build on this machine reaches, on loopback and plain HTTP.

Here the package registry is reached through an egress proxy whose CA only the host trusts, and
torch's CPU wheel lies on the host's disk (pip's `find-links`), where download.pytorch.org is
out of reach. A build with `--network host` and `--build-arg PIP_INDEX_URL=<this>/simple` gets
both from this process, which fetches from the registry with the host's pip configuration and
CA bundle: nothing of the host's is copied into the image, and `--require-hashes` still checks
every locked file. With Docker Hub and the public registry, the build needs none of this."""

from __future__ import annotations

import os
import re
import shutil
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote

REGISTRY = "https://pypi.org/simple/"
FILES = "https://files.pythonhosted.org/"
PREFERRED_PORT = 53141


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_settings() -> dict[str, str]:
    """What pip on this machine uses (`pip config list` and PIP_* variables): cert, find-links."""
    settings: dict[str, str] = {}
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        settings[key.split(".", 1)[-1].replace("_", "-")] = value.strip().strip("'\"")
    for key in ("cert", "find-links", "index-url"):
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            settings[key] = env
    return settings


def _local_wheels(find_links: str) -> dict[str, list[Path]]:
    """Wheels in the find-links folders, by normalized project name."""
    wheels: dict[str, list[Path]] = {}
    for folder in find_links.split():
        path = Path(folder.removeprefix("file://"))
        for wheel in sorted(path.glob("*.whl")) if path.is_dir() else []:
            wheels.setdefault(_normalize(wheel.name.split("-")[0]), []).append(wheel)
    return wheels


class PackageProxy:
    """`/simple/<project>/` as the registry lists it (file links pointing back here), with the
    host's local wheels for the projects in `local`; `/files/...` and `/local/...` the files."""

    def __init__(self, local: tuple[str, ...] = ("torch",)) -> None:
        settings = pip_settings()
        cert = settings.get("cert")
        self._tls = ssl.create_default_context(cafile=cert if cert else None)
        self._index = settings.get("index-url", REGISTRY).rstrip("/") + "/"
        wheels = _local_wheels(settings.get("find-links", ""))
        self._local = {name: wheels[name] for name in map(_normalize, local) if name in wheels}
        self._server = self._bind(self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @staticmethod
    def _bind(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
        """The same port each run where it is free: the URL is a build arg, and docker's build
        cache keeps a layer only while its build args are the same."""
        try:
            return ThreadingHTTPServer(("127.0.0.1", PREFERRED_PORT), handler)
        except OSError:
            return ThreadingHTTPServer(("127.0.0.1", 0), handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> PackageProxy:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _page(self, project: str) -> bytes:
        if project in self._local:
            links = "".join(
                f'<a href="{self.url}/local/{quote(w.name)}">{w.name}</a>\n'
                for w in self._local[project]
            )
            return f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode()
        request = urllib.request.Request(
            f"{self._index}{project}/", headers={"Accept": "text/html"}
        )
        with urllib.request.urlopen(request, context=self._tls, timeout=120) as response:
            page = response.read().decode()
        return page.replace(FILES, f"{self.url}/files/").encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                try:
                    self._answer()
                except urllib.error.HTTPError as error:
                    self.send_error(error.code)
                except OSError as error:
                    self.send_error(502, str(error))

            def _answer(self) -> None:
                path = self.path.split("?", 1)[0]
                if path.startswith("/simple/"):
                    body = proxy._page(_normalize(path.removeprefix("/simple/").strip("/")))
                    self._send(body, "text/html")
                elif path.startswith("/local/"):
                    name = unquote(Path(path).name)
                    files = [w for ws in proxy._local.values() for w in ws if w.name == name]
                    if not files:
                        self.send_error(404)
                        return
                    with files[0].open("rb") as source:
                        self._stream(source, files[0].stat().st_size)
                elif path.startswith("/files/"):
                    remote = FILES + path.removeprefix("/files/")
                    with urllib.request.urlopen(remote, context=proxy._tls, timeout=300) as src:
                        self._stream(src, int(src.headers.get("Content-Length", 0)) or None)
                else:
                    self.send_error(404)

            def _send(self, body: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _stream(self, source: object, length: int | None) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                if length:
                    self.send_header("Content-Length", str(length))
                self.end_headers()
                shutil.copyfileobj(source, self.wfile, 1 << 20)  # type: ignore[arg-type]

            def log_message(self, *_: object) -> None:
                pass

        return Handler
