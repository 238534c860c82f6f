"""int8 memory blocks against float16 on real text, in process (docs/decisions/070).

A --tokens document of real text is read into a session holding its memory blocks in float16
and into one holding them in int8 (memory_dtype). One JSON line per grouping: the float16
session's memory keys and values, every layer, quantized to 8 bits with one (scale, zero) per
group, and the error relative to the tensor's root mean square (the first grouping of each is
what int8 holds). Then one line for the sessions: both read a question and decode --steps
tokens (the float16 session's greedy tokens fed to both): the largest difference of their
logits relative to the largest |logit|, how many greedy tokens agree, and the bytes per token
each holds (SessionMemory.nbytes) while it decodes (with the decode steps' caches: the window
rotated, and int8's widened retrieved rows; what `bench passkey` reports) and between
requests (after `end_request`).

    longserve bench int8_memory --tokens 8192
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.memory_batch import document_ids
from engine.config import EngineConfig
from engine.memory.quantized import dequantize, quantize
from engine.memory.session import SessionMemory
from engine.protocol import MemorySpec
from engine.runner.loader import load_model

QUESTION = "\n\nQuestion: What was the first paragraph of this text about? Answer:"


def grouped_error(x: torch.Tensor, group: str, block: int) -> tuple[float, float]:
    """x (heads, n, d) quantized per `group` -> (sum of squared errors, sum of squares)."""
    heads, n, d = x.shape
    x = x.float()
    if group == "token":
        held = dequantize(*quantize(x, dim=-1), torch.float32)
    else:  # per channel over each block
        blocks = x.view(heads, n // block, block, d)
        held = dequantize(*quantize(blocks, dim=2), torch.float32).view(heads, n, d)
    return float((held - x).pow(2).sum()), float(x.pow(2).sum())


def groupings(memory: SessionMemory) -> dict[str, tuple[float, float]]:
    """Every layer's memory keys and values under each grouping: (squared errors, squares)."""
    frame, block = memory._frame, memory.config.block
    sums: dict[str, list[float]] = {}
    for store in frame.layers:
        keys, values = store.mem_k.view().float(), store.mem_v.view().float()
        offsets = torch.arange(keys.shape[1]) % block
        pre_rotary = frame.rotary.unrotate(keys, offsets) if frame.block_local else keys
        cases = {
            "keys per channel over a block, as stored (int8)": (keys, "channel"),
            "keys per channel over a block, pre-rotary": (pre_rotary, "channel"),
            "keys per token": (keys, "token"),
            "values per token (int8)": (values, "token"),
            "values per channel over a block": (values, "channel"),
        }
        for name, (x, group) in cases.items():
            err, norm = grouped_error(x, group, block)
            total = sums.setdefault(name, [0.0, 0.0])
            total[0] += err
            total[1] += norm
    return {name: (err, norm) for name, (err, norm) in sums.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--linear-dtype", default="auto", help="auto, bfloat16 or int4")
    parser.add_argument("--strategy", default="segments")
    parser.add_argument("--knobs", type=json.loads, default={})
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args(argv)

    loaded = load_model(EngineConfig(model=args.model, linear_dtype=args.linear_dtype))
    ids = document_ids(loaded, args.model, "int8-memory", args.tokens)
    question = torch.tensor(loaded.tokenizer(QUESTION, add_special_tokens=False).input_ids)
    sessions = {}
    for dtype in ("float16", "int8"):
        spec = MemorySpec(args.strategy, {**args.knobs, "memory_dtype": dtype})
        memory = SessionMemory(loaded.model, spec, loaded.kv_dtype)
        with torch.inference_mode():
            memory.append(ids, document=True)
        sessions[dtype] = memory
    for name, (err, norm) in groupings(sessions["float16"]).items():
        line = {"bench": "int8_memory", "grouping": name, "relative_rms_error": (err / norm) ** 0.5}
        print(json.dumps(line), flush=True)

    worst, agree = 0.0, 0
    with torch.inference_mode():
        want, got = sessions["float16"].append(question), sessions["int8"].append(question)
        for _ in range(args.steps):
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
            token = int(want.argmax())
            agree += int(got.argmax()) == token
            step = torch.tensor([token])
            want, got = sessions["float16"].append(step), sessions["int8"].append(step)
    decoding = {d: m.nbytes() / m.num_tokens for d, m in sessions.items()}
    for memory in sessions.values():
        memory.end_request()
    held = {d: m.nbytes() / m.num_tokens for d, m in sessions.items()}
    line = {
        "bench": "int8_memory",
        "strategy": args.strategy,
        "kv_dtype": loaded.kv_dtype,
        "tokens": len(ids),
        "memory_tokens": sessions["int8"].memory_tokens,
        "max_logit_diff_relative": round(worst, 5),
        "greedy_agree": f"{agree}/{args.steps}",
        "bytes_per_token_held": {d: round(b, 1) for d, b in held.items()},
        "held_int8_vs_float16": round(held["int8"] / held["float16"], 3),
        "bytes_per_token_decoding": {d: round(b, 1) for d, b in decoding.items()},
        "decoding_int8_vs_float16": round(decoding["int8"] / decoding["float16"], 3),
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
