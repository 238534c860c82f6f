"""longserve against llama.cpp on one GGUF per quantization type: speed, agreement, and which
kind each linear got.

For each --types entry the embedded GGUF (SmolLM2-135M-Instruct, Q4_1) is written again as that
type by llama.cpp's own quantizer (`llama_model_quantize` with allow_requantize: the weights are
Q4_1's values quantized once more, not the original bf16 ones) into --work-dir (default: a
temporary directory, removed at the end; never the repository). Then, per file, in one run:

- `linears`: the tensor types the file holds (llama.cpp gives a tensor whose rows do not split
  into 256-wide super-blocks a fallback type, so SmolLM2's 576-wide inputs are never K-quants),
  and the module kind each linear got when longserve loads the file
  (engine.runner.loader.load_model, counted by class): whether its fast path was taken;
- `speed`: prefill and decode tokens/s of longserve (a server started on the file, streaming
  /v1/completions of the prompt's token ids) and llama.cpp (in this process, same file,
  --threads threads), the same ids of real text at each --contexts length, greedy, exactly
  --max-tokens new tokens, alternating within each round, as `longserve bench peers` times them;
- `agreement`: free-running greedy continuations of --prompts passages of real text
  (--prompt-tokens long, bench/recall_corpus.py's filler): the share of the first
  --agreement-tokens positions where longserve's token (from the completion's logprobs) equals
  llama.cpp's, and the first position where they differ.

One JSON line per measurement, one summary line per type, then a table of longserve's ratios to
llama.cpp. Needs llama-cpp-python in the benchmark's environment (bench/peers.py says how).

    longserve bench gguf_types --contexts 512 3800 --rounds 1
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.peers import (
    llama_model,
    llama_tokens,
    longserve_tokens,
    prompt_ids,
    summarize,
    time_peers,
)
from bench.server_process import served

TYPES = ("Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
REPOSITORY = Path(__file__).resolve().parent.parent


def agreement(ours: Sequence[Any], theirs: Sequence[Any]) -> dict:
    """Two greedy continuations position by position: how many positions hold the same token
    (`same` of `of`, the shorter one's length) and the first that does not (None: none)."""
    of = min(len(ours), len(theirs))
    differ = [i for i in range(of) if ours[i] != theirs[i]]
    return {
        "same": of - len(differ),
        "of": of,
        "first_divergence": differ[0] if differ else None,
    }


def quantize(source: Path, target: Path, type_name: str, threads: int) -> None:
    """Write `source` again as `type_name` (a llama.cpp ftype: Q4_0, Q4_K_M, ...) at `target`."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    params.allow_requantize = True
    params.nthread = threads
    code = llama_cpp.llama_model_quantize(
        str(source).encode(), str(target).encode(), ctypes.byref(params)
    )
    if code != 0:
        raise RuntimeError(f"llama_model_quantize to {type_name} failed ({code})")


def file_tensor_types(path: Path) -> dict:
    """The storage type of the file's token embedding, and how many of its other matrices
    (the decoder linears, an untied output head) are stored in each type."""
    from gguf import GGUFReader

    matrices = [t for t in GGUFReader(path).tensors if len(t.shape) == 2]
    embedding = [t.tensor_type.name for t in matrices if t.name == "token_embd.weight"]
    others = Counter(t.tensor_type.name for t in matrices if t.name != "token_embd.weight")
    return {"token_embd": embedding[0] if embedding else None, "matrices": dict(others)}


def linear_kinds(path: Path) -> tuple[dict, Any]:
    """How many of the model's linears longserve keeps as each module class when it loads
    `path` with its defaults (decode steps left unfused so no module is counted twice), the
    resolved precisions, and the tokenizer."""
    import torch

    from engine.config import EngineConfig
    from engine.runner.loader import load_model

    loaded = load_model(EngineConfig(model=str(path), device="cpu", lean_decode=False))
    kinds = Counter(
        type(m).__name__
        for m in loaded.model.modules()
        if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("Linear")
    )
    resolved = {"linear_dtype": loaded.linear_dtype, "kv_dtype": loaded.kv_dtype}
    tokenizer = loaded.tokenizer
    del loaded
    gc.collect()
    return {"kinds": dict(kinds), **resolved}, tokenizer


def longserve_greedy(http: httpx.Client, model: str, text: str, n: int) -> list[str]:
    """longserve's n greedy tokens after `text`, as the completion's logprobs name them."""
    body = {
        "model": model,
        "prompt": text,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    response = http.post("/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["logprobs"]["tokens"]


def server_ids(root: httpx.Client, model: str, text: str) -> list[int]:
    """The token ids the server reads `text` as (its /tokenize, at the root, as a completion
    reads it)."""
    response = root.post("/tokenize", json={"model": model, "prompt": text})
    response.raise_for_status()
    return response.json()["tokens"]


@contextlib.contextmanager
def work_dir(path: str | None) -> Iterator[Path]:
    if path is None:
        with tempfile.TemporaryDirectory(prefix="longserve-gguf-types-") as scratch:
            yield Path(scratch)
        return
    chosen = Path(path).resolve()
    if chosen.is_relative_to(REPOSITORY):
        raise SystemExit(f"--work-dir {chosen} is inside the repository; pick a scratch folder")
    chosen.mkdir(parents=True, exist_ok=True)
    yield chosen


def measure(path: Path, type_name: str, args: argparse.Namespace) -> dict:
    """Every measurement of one file, printed as it is made; returns the type's summary."""
    from bench.decode_agreement import passage
    from engine.runner.detokenize import token_text

    tag = {"bench": "gguf_types", "type": type_name}
    linears = {"file": file_tensor_types(path)}
    kinds, tokenizer = linear_kinds(path)
    linears["longserve"] = kinds
    print(json.dumps({**tag, "measure": "linears", **linears}), flush=True)
    llm = llama_model(str(path), args.threads)
    serve_args = ["--model", str(path), "--device", "cpu", "--threads", str(args.threads)]
    # prefill timed from the prompt's first token, as llama.cpp's after llm.reset(): no reuse
    no_reuse = {"LONGSERVE_KV_PREFIX_CACHE_BYTES": "0"}
    with served(None, serve_args=serve_args, env=no_reuse, ready_timeout=300) as base:
        # the server takes text only: each prompt goes as the text of its ids, and the line says
        # whether the server read that text back as the same ids llama.cpp is given
        http = httpx.Client(base_url=f"{base}/v1", timeout=3600)
        root = httpx.Client(base_url=base, timeout=600)
        model = http.get("/models").json()["data"][0]["id"]
        agreements, same_ids = [], []
        for seed in range(args.prompts):
            ids = passage(tokenizer, seed, args.prompt_tokens).tolist()
            text = tokenizer.decode(ids)
            ours = longserve_greedy(http, model, text, args.agreement_tokens)
            theirs = llama_tokens(llm, ids, args.agreement_tokens)
            got = agreement(ours, [token_text(tokenizer, t) for t in theirs])
            agreements.append(got)
            line = {**tag, "measure": "agreement", "prompt": seed, "prompt_tokens": len(ids)}
            same_ids.append(server_ids(root, model, text) == ids)
            line["same_ids"] = same_ids[-1]
            print(json.dumps({**line, **got}), flush=True)
        for context in args.contexts:
            ids = prompt_ids(tokenizer, context)
            same_ids.append(server_ids(root, model, tokenizer.decode(ids)) == ids)
            line = {**tag, "measure": "prompt", "context": len(ids), "same_ids": same_ids[-1]}
            print(json.dumps(line), flush=True)
        peers = {
            "longserve": lambda ids: longserve_tokens(
                http, model, tokenizer.decode(ids), args.max_tokens
            ),
            "llama.cpp": lambda ids: llama_tokens(llm, ids, args.max_tokens),
        }
        lines = []
        for line in time_peers(peers, tokenizer, args.contexts, args.rounds):
            print(json.dumps({**tag, "measure": "speed", **line}), flush=True)
            lines.append(line)
    llm.close()
    same = sum(a["same"] for a in agreements)
    of = sum(a["of"] for a in agreements)
    return {
        **tag,
        "measure": "summary",
        "linears": linears,
        "speed": summarize(lines, list(peers)),
        "agreement": {"same": same, "of": of, "share": round(same / of, 3) if of else None},
        "first_divergence": [a["first_divergence"] for a in agreements],
        "same_ids": all(same_ids),
    }


def table(summaries: list[dict]) -> str:
    """The summaries as a markdown table: longserve/llama.cpp ratios at each context."""
    contexts = [s["context"] for s in summaries[0]["speed"]] if summaries else []
    head = ["type", "file's matrices", "longserve's linears"]
    head += [f"decode @{c}" for c in contexts] + [f"prefill @{c}" for c in contexts]
    head += ["agreement", "first divergence"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for s in summaries:
        by_context = {x["context"]: x for x in s["speed"]}
        decode = [by_context.get(c, {}).get("longserve/llama.cpp_decode_tok_s") for c in contexts]
        prefill = [by_context.get(c, {}).get("longserve/llama.cpp_prefill_tok_s") for c in contexts]
        cells = [
            s["type"],
            _counts(s["linears"]["file"]["matrices"]),
            _counts(s["linears"]["longserve"]["kinds"]),
            *(f"{r}×" for r in decode + prefill),
            "{share} ({same}/{of})".format(**s["agreement"]),
            ", ".join("none" if d is None else str(d) for d in s["first_divergence"]),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _counts(counts: dict) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items(), key=lambda x: -x[1]))


def run(args: argparse.Namespace) -> None:
    import torch

    from engine.runner.loader import embedded_model_path

    torch.set_num_threads(args.threads)
    source = embedded_model_path()
    summaries = []
    with work_dir(args.work_dir) as scratch:
        paths = {}
        for type_name in args.types:
            paths[type_name] = scratch / f"{source.stem.rsplit('.', 1)[0]}.{type_name}.gguf"
            quantize(source, paths[type_name], type_name, args.threads)
        for type_name, path in paths.items():
            summary = measure(path, type_name, args)
            print(json.dumps(summary), flush=True)
            summaries.append(summary)
    print(table(summaries), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES), help="llama.cpp ftypes")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 3800])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per timing")
    parser.add_argument("--prompts", type=int, default=3, help="passages for agreement")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", help="where the files are written (default: a temp dir)")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
