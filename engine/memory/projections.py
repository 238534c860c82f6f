"""Neurocache projections by id: files an operator placed in one directory, never a path.

A client names a projection (`memory.projection: "pca-v1"`); the id must match PROJECTION_ID
and resolves to `<directory>/<id>.pt` only: opened relative to the directory with O_NOFOLLOW
(a symlink is refused, so nothing outside the directory is reached), O_NONBLOCK (a FIFO never
stalls the device thread), a regular file of at most `max_bytes`, loaded with
`torch.load(weights_only=True)` (tensors only, no pickled code). Every refusal is an
InvalidRequest naming the id alone; the path and the cause go to the log for the operator
(docs/decisions/056-no-client-paths.md).
"""

from __future__ import annotations

import io
import logging
import os
import stat
import threading

import torch

from engine.memory.config import check_projection_id
from engine.protocol import InvalidRequest

logger = logging.getLogger(__name__)

SUFFIX = ".pt"
PARAM = "memory.projection"


class Projections:
    """The projections of one directory, each read once and kept (on the CPU) while its file
    is unchanged. `directory` None: no projection can be named."""

    def __init__(self, directory: str | None, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._loaded: dict[str, tuple[tuple[int, int, int, int], torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def load(self, projection_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight (d, hidden), mean (hidden,)) as float32 CPU tensors; InvalidRequest naming
        only the id when it is unknown or its file cannot be used."""
        check_projection_id(projection_id)
        if self.directory is None:
            raise _unknown(projection_id)
        with self._lock:
            return self._load(projection_id)

    def _load(self, projection_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        name = projection_id + SUFFIX
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            dir_fd = os.open(self.directory or "", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            logger.error("projection directory %s cannot be opened: %s", self.directory, e)
            raise _unknown(projection_id) from None
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except OSError as e:  # missing, a symlink (ELOOP), unreadable
            logger.warning(
                "projection %r refused (%s/%s): %s", projection_id, self.directory, name, e
            )
            raise _unknown(projection_id) from None
        finally:
            os.close(dir_fd)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a FIFO, device or directory: never read
            os.close(fd)
            logger.warning("projection %r refused: %s is not a regular file", projection_id, name)
            raise _unknown(projection_id)
        with os.fdopen(fd, "rb") as f:
            version = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
            held = self._loaded.get(projection_id)
            if held is not None and held[0] == version:
                return held[1], held[2]
            if info.st_size > self.max_bytes:
                logger.warning(
                    "projection %r refused: %d bytes, over max_projection_bytes (%d)",
                    projection_id,
                    info.st_size,
                    self.max_bytes,
                )
                raise _unusable(projection_id)
            data = f.read(self.max_bytes + 1)
        if len(data) > self.max_bytes:  # grew while read
            raise _unusable(projection_id)
        weight, mean = _parse(projection_id, data)
        self._loaded[projection_id] = (version, weight, mean)
        return weight, mean


def _parse(projection_id: str, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        weight, mean = state["weight"], state["mean"]
        if not isinstance(weight, torch.Tensor) or not isinstance(mean, torch.Tensor):
            raise TypeError("weight and mean must be tensors")
        return weight.float(), mean.float()
    except Exception as e:  # anything but a {"weight", "mean"} tensor file
        logger.warning("projection %r is not a projection file: %r", projection_id, e)
        raise _unusable(projection_id) from None


def _unknown(projection_id: str) -> InvalidRequest:
    return InvalidRequest(f"unknown projection {projection_id!r}", param=PARAM)


def _unusable(projection_id: str) -> InvalidRequest:
    return InvalidRequest(
        f"projection {projection_id!r} cannot be used; ask the operator", param=PARAM
    )
