"""The embedded backend: files in a data directory, written atomically.

Each tag is one directory, each key one file (temporary file, fsync, `os.replace`, fsync of the
directory), so the store survives a crash mid-write and needs no server.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote

from memory_store.backends.base import Backend, JsonSerializer, Serializer
from memory_store.errors import Conflict, NotFound, StoreError, StoreUnavailableError
from memory_store.keys import Key

T = TypeVar("T")

_TMP_MARK = ".tmp-"


class EmbeddedBackend(Backend):
    """Files under `data_dir/<tag>/<path>.{blob,rec}`, written atomically.

    Blocking file I/O runs in worker threads. A crash mid-write leaves at most a stray
    `.tmp-*` file, which listings ignore and `put_*` of the same key cleans up on the next write.
    """

    name = "embedded"

    def __init__(self, data_dir: str | os.PathLike[str], serializer: Serializer | None = None):
        self.root = Path(data_dir)
        self.serializer: Serializer = serializer or JsonSerializer()
        self.root.mkdir(parents=True, exist_ok=True)

    # Layout -----------------------------------------------------------------------------------

    def _dir(self, tag: str) -> Path:
        name = quote(tag, safe="")
        if len(name) > 200:  # keep under NAME_MAX (255) whatever the fingerprint's length
            name = f"{name[:120]}~{hashlib.sha256(tag.encode()).hexdigest()}"
        return self.root / name

    def _file(self, key: Key, kind: str) -> Path:
        return self._dir(key.tag) / f"{quote(key.path, safe='')}.{kind}"

    # Plumbing ---------------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args)
        except StoreError:
            raise
        except FileNotFoundError as e:
            raise NotFound(str(e)) from e
        except OSError as e:
            raise StoreUnavailableError(f"embedded store I/O failed: {e}") from e

    @staticmethod
    def _write_atomic(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_TMP_MARK}{uuid.uuid4().hex}-{path.name}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    @staticmethod
    def _read(path: Path) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    # Interface --------------------------------------------------------------------------------

    async def put_blob(self, key: Key, data: bytes) -> None:
        await self._run(self._write_atomic, self._file(key, "blob"), bytes(data))

    async def get_blob(self, key: Key) -> bytes:
        try:
            return await self._run(self._read, self._file(key, "blob"))
        except NotFound as e:
            raise NotFound(f"no blob under {key.tag}/{key.path}") from e

    async def has_blob(self, key: Key) -> bool:
        return await self._run(self._file(key, "blob").is_file)

    async def put_record(
        self, key: Key, record: Mapping[str, Any], *, if_absent: bool = False
    ) -> None:
        data = self.serializer.dumps(record)
        path = self._file(key, "rec")

        def write() -> None:
            if if_absent:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{_TMP_MARK}{uuid.uuid4().hex}-{path.name}")
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, path)  # atomic create-if-absent
                except FileExistsError as e:
                    raise Conflict(f"record {key.tag}/{key.path} already exists") from e
                finally:
                    tmp.unlink(missing_ok=True)
            else:
                self._write_atomic(path, data)

        await self._run(write)

    async def get_record(self, key: Key) -> dict[str, Any]:
        try:
            data = await self._run(self._read, self._file(key, "rec"))
        except NotFound as e:
            raise NotFound(f"no record under {key.tag}/{key.path}") from e
        return self.serializer.loads(data)

    async def delete(self, key: Key) -> bool:
        def remove() -> bool:
            found = False
            for kind in ("blob", "rec"):
                try:
                    self._file(key, kind).unlink()
                    found = True
                except FileNotFoundError:
                    pass
            return found

        return await self._run(remove)

    async def list_paths(self, tag: str, prefix: str = "") -> list[str]:
        def scan() -> list[str]:
            directory = self._dir(tag)
            if not directory.is_dir():
                return []
            paths = set()
            for entry in os.listdir(directory):
                if entry.startswith(_TMP_MARK):
                    continue
                stem, _, kind = entry.rpartition(".")
                if kind in ("blob", "rec"):
                    path = unquote(stem)
                    if path.startswith(prefix):
                        paths.add(path)
            return sorted(paths)

        return await self._run(scan)

    async def delete_tag(self, tag: str) -> int:
        def remove() -> int:
            directory = self._dir(tag)
            if not directory.is_dir():
                return 0
            count = sum(1 for e in os.listdir(directory) if not e.startswith(_TMP_MARK))
            # Rename first so a concurrent reader sees all or nothing of the tag.
            doomed = directory.with_name(f"{_TMP_MARK}{uuid.uuid4().hex}")
            os.replace(directory, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            return count

        return await self._run(remove)

    async def ping(self) -> None:
        def check() -> None:
            if not os.access(self.root, os.W_OK):
                raise StoreUnavailableError(f"data directory {self.root} is not writable")

        await self._run(check)

    # For other modules' atomic steps (memory_store/usage.py) -----------------------------------

    _update_lock = threading.Lock()  # threads of this process; flock keeps other processes out

    async def update_json(self, tag: str, name: str, change: Callable[[dict[str, Any]], T]) -> T:
        """Read the JSON object in file `name` of `tag`'s directory ({} when absent), let
        `change` edit it in place, write it back atomically; one update at a time per data
        directory, across threads and processes. Returns what `change` returned."""
        directory = self._dir(tag)

        def update() -> T:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / name
            with self._update_lock, open(self.root / ".update.lock", "a+b") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    state = json.loads(self._read(path)) if path.is_file() else {}
                    result = change(state)
                    self._write_atomic(path, json.dumps(state, separators=(",", ":")).encode())
                    return result
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)

        return await self._run(update)
