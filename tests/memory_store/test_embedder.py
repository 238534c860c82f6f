"""The bundled all-MiniLM-L6-v2, loaded offline."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np

from memory_store.embedder import EMBEDDING_DIM, bundled_model_path


def test_model_ships_in_the_package() -> None:
    path = bundled_model_path()
    assert (path / "config.json").is_file() and (path / "modules.json").is_file()


def test_embed_shape_norm_and_meaning(minilm) -> None:
    emb = minilm.embed(
        [
            "The cat sat on the mat.",
            "A cat is sitting on a rug.",
            "Quarterly revenue rose by eight percent.",
        ]
    )
    assert emb.shape == (3, EMBEDDING_DIM) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert emb[0] @ emb[1] > emb[0] @ emb[2] + 0.3
    assert minilm.embed([]).shape == (0, EMBEDDING_DIM)


def test_embed_is_thread_safe_and_deterministic(minilm) -> None:
    texts = ["one two three", "four five six"]
    expected = minilm.embed(texts)
    results: list[np.ndarray] = []
    threads = [
        threading.Thread(target=lambda: results.append(minilm.embed(texts))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        np.testing.assert_allclose(r, expected, atol=1e-5)


def test_importing_the_store_does_not_import_torch() -> None:
    code = (
        "import sys, memory_store.client, memory_store.app, memory_store.larimar; "
        "bad = [m for m in ('torch', 'sentence_transformers', 'engine', 'server') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
