"""Nearest-neighbour search over a growing set of vectors, behind one interface.

    index = VectorIndex(dim, backend="auto", metric="ip", device=device)
    index.add(x)                           # x (n, dim); ids are 0, 1, 2, ... in add order
    scores, ids = index.search(q, k)       # q (r, dim) -> (r, k) each, best first, ids -1 if none
    index.drop_front(n)                    # forget the n oldest vectors (FIFO); ids shift down

Backends:
- "torch": exact matmul + topk (or negative squared L2) in torch, on the vectors' device. What
  "auto" picks on a GPU (exact beats ANN recall at per-session sizes) and for small CPU sets.
- "faiss-flat": exact faiss IndexFlatIP / IndexFlatL2 (faiss-gpu when importable and the
  vectors live on a GPU; faiss-GPU caps k at 2048, so k is clipped there).
- "faiss-hnsw": HNSW (M=32, efConstruction 80, efSearch 128 whatever k) - approximate, grows
  without training. With k above efSearch (tokens' k 256) it still returns k hits
  (docs/decisions/019-hnsw-ef-search.md).
- "faiss-ivf": IVF-Flat trained on the vectors held when it is first searched (nlist ~
  4*sqrt(n), nprobe = nlist/4); retrained whenever the set has doubled since.
- "auto": torch on a GPU; on CPU torch exact up to `threshold` vectors, faiss HNSW past it.

A faiss HNSW or flat index takes vectors as they are added (the first add past the auto
threshold builds it from all held so far); IVF is trained at its first search.

Every backend keeps the vectors in a torch buffer as well, so faiss indices can be rebuilt on
drops and backend switches; scores are inner products ("ip") or negative squared L2 ("l2").
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

try:
    import faiss
except ImportError:  # pragma: no cover - faiss-cpu is a dependency
    faiss = None  # type: ignore[assignment]

FAISS_GPU_MAX_K = 2048
AUTO_THRESHOLD = 1 << 16


class VectorIndex:
    def __init__(
        self,
        dim: int,
        backend: str = "auto",
        metric: str = "ip",
        device: torch.device | str = "cpu",
        threshold: int = AUTO_THRESHOLD,
    ) -> None:
        if metric not in ("ip", "l2"):
            raise ValueError(f"unknown metric {metric!r}")
        if backend not in ("auto", "torch", "faiss-flat", "faiss-hnsw", "faiss-ivf"):
            raise ValueError(f"unknown index backend {backend!r}")
        if backend.startswith("faiss") and faiss is None:
            raise RuntimeError("faiss is not installed")
        self.dim, self.metric, self.backend = dim, metric, backend
        self.device = torch.device(device)
        self.threshold = threshold
        self._vectors = torch.empty(0, dim, device=self.device)
        self._norms = torch.empty(0, device=self.device)  # squared L2 norms, for "l2" search
        self._size = 0
        self._faiss = None  # built lazily: the faiss index over _vectors[:_faiss_size]
        self._faiss_size = 0
        self._trained_at = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> VectorIndex:
        """A copy of the vectors; the faiss index is not copied but rebuilt from them on the
        next search (faiss objects do not deep-copy, and a forked session may never search)."""
        twin = copy.copy(self)
        memo[id(self)] = twin
        twin._vectors, twin._norms = self._vectors.clone(), self._norms.clone()
        twin._faiss, twin._faiss_size, twin._trained_at = None, 0, 0
        twin.__dict__.pop("_resources", None)
        twin.__dict__.pop("_on_faiss_gpu", None)
        return twin

    @property
    def ntotal(self) -> int:
        return self._size

    def vectors(self) -> torch.Tensor:
        return self._vectors[: self._size]

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().to(self.device, torch.float32).reshape(-1, self.dim)
        if self._size + x.shape[0] > self._vectors.shape[0]:
            capacity = max(2 * self._vectors.shape[0], self._size + x.shape[0], 1024)
            grown = self._vectors.new_empty(capacity, self.dim)
            grown[: self._size] = self._vectors[: self._size]
            norms = self._norms.new_empty(capacity)
            norms[: self._size] = self._norms[: self._size]
            self._vectors, self._norms = grown, norms
        self._vectors[self._size : self._size + x.shape[0]] = x
        self._norms[self._size : self._size + x.shape[0]] = x.square().sum(-1)
        self._size += x.shape[0]
        if self._faiss is not None or self.current_backend() in ("faiss-hnsw", "faiss-flat"):
            # keep a graph or flat faiss index current as vectors arrive: building it belongs
            # to reading the document, not to the first question after it (IVF trains lazily)
            self._faiss_index()

    def drop_front(self, n: int) -> None:
        kept = self._vectors[n : self._size].clone()
        self._vectors[: kept.shape[0]] = kept
        norms = self._norms[n : self._size].clone()
        self._norms[: norms.shape[0]] = norms
        self._size -= n
        self._faiss, self._faiss_size, self._trained_at = None, 0, 0

    def to(self, device: torch.device | str) -> None:
        """Move the vectors to device; a faiss index is rebuilt on the next search."""
        self.device = torch.device(device)
        self._vectors = self._vectors[: self._size].to(self.device).clone()
        self._norms = self._norms[: self._size].to(self.device).clone()
        self._faiss, self._faiss_size, self._trained_at = None, 0, 0
        self._on_faiss_gpu = False

    def current_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        if self.device.type != "cpu" or self._size <= self.threshold or faiss is None:
            return "torch"
        return "faiss-hnsw"

    def search(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = q.detach().to(self.device, torch.float32).reshape(-1, self.dim)
        k = min(k, self._size)
        if k == 0:
            empty = torch.empty(q.shape[0], 0, device=self.device)
            return empty, empty.long()
        if self.current_backend() == "torch":
            data = self.vectors()
            if self.metric == "ip":
                return (q @ data.T).topk(k, dim=-1)
            # -|q - x|^2 = 2 q.x - |x|^2 - |q|^2, the vectors' norms kept as they were added:
            # one pass over the vectors (cdist reads them twice and takes square roots)
            scores = torch.addmm(self._norms[None, : self._size], q, data.T, beta=-1, alpha=2)
            return scores.sub_(q.square().sum(-1, keepdim=True)).topk(k, dim=-1)
        index = self._faiss_index()
        if self._on_faiss_gpu:
            k = min(k, FAISS_GPU_MAX_K)
        scores, ids = index.search(q.cpu().numpy(), k)
        scores_t = torch.from_numpy(scores).to(self.device)
        if self.metric == "l2":
            scores_t = -scores_t
        return scores_t, torch.from_numpy(ids).to(self.device)

    # -- faiss ------------------------------------------------------------------------------

    _on_faiss_gpu = False

    def _faiss_index(self):
        kind = self.current_backend()
        if kind == "faiss-ivf" and self._size >= 2 * max(self._trained_at, 1):
            self._faiss = None  # retrain on the grown set
        if self._faiss is None:
            self._faiss = self._new_faiss(kind)
            self._faiss_size = 0
        if self._faiss_size < self._size:
            self._faiss.add(self._vectors[self._faiss_size : self._size].cpu().numpy())
            self._faiss_size = self._size
        if kind == "faiss-hnsw":
            self._faiss.hnsw.efSearch = max(self._faiss.hnsw.efSearch, 128)
        return self._faiss

    def _new_faiss(self, kind: str):
        metric = faiss.METRIC_INNER_PRODUCT if self.metric == "ip" else faiss.METRIC_L2
        if kind == "faiss-hnsw":
            index = faiss.IndexHNSWFlat(self.dim, 32, metric)
            index.hnsw.efConstruction = 80
            index.hnsw.efSearch = 128
            return index
        flat = faiss.IndexFlatIP(self.dim) if self.metric == "ip" else faiss.IndexFlatL2(self.dim)
        if kind == "faiss-ivf":
            nlist = max(1, min(int(4 * math.sqrt(self._size)), self._size // 39))
            ivf = faiss.IndexIVFFlat(flat, self.dim, nlist, metric)
            ivf.train(self.vectors().cpu().numpy())
            ivf.nprobe = max(1, nlist // 4)
            self._trained_at = self._size
            return ivf
        if self.device.type == "cuda" and hasattr(faiss, "StandardGpuResources"):
            self._resources = faiss.StandardGpuResources()
            self._on_faiss_gpu = True
            return faiss.index_cpu_to_gpu(self._resources, self.device.index or 0, flat)
        return flat

    def set_search_effort(self, nprobe: int | None = None, ef_search: int | None = None) -> None:
        """Raise IVF nprobe / HNSW efSearch (tests use it to compare with exact search)."""
        index = self._faiss_index()
        if nprobe is not None and hasattr(index, "nprobe"):
            index.nprobe = nprobe
        if ef_search is not None and hasattr(index, "hnsw"):
            index.hnsw.efSearch = ef_search

    def nbytes(self) -> int:
        """Bytes of the vectors held, twice that with a faiss index (its own copy, or for HNSW
        its copy plus 2M neighbour ids per vector at M 32: about the same again)."""
        size = self._size * self.dim * self._vectors.element_size()
        return size * (2 if self._faiss is not None else 1)
