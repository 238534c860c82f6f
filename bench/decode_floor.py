"""How far one plain decode step is from reading the model's weights once.

In process, on the engine's own plain path (a KV cache, the model's forward): a --context-token
prompt is read, then --steps single-token decode steps are timed. Then the same weight matrices
are multiplied by one token's activations, nothing else, which is the floor a decode step
cannot go under without fewer weight bytes. One JSON line per --dtypes entry: the step, the
bare matmuls, the weights' MB and the bandwidth they imply, and the share of the step that is
not weight matmuls (Python, dispatch, norms, rotary, attention, sampling-side work).

The step is the engine's: the lean decode step where the model has one (engine/runner/decode_step.py),
and `transformers_step_ms` the same step through transformers' forward, on a second cache.
`attention_ms` times one token's attention over the --context-tokens cache for every layer,
with the CPU kernel (engine/runner/cpu_attention.py) and with SDPA; --kv-dtype float16 keeps the
engine step's cache (and the one attention_ms reads) in half precision.

    longserve bench decode_floor --dtypes float32 bfloat16 float32+bfloat16-linears \
        float32+int4-linears
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.runner.cpu_attention import decode_attention, load_kernel
from engine.runner.decode_state import KVCacheState, forward_kv
from engine.runner.decode_step import decoder_of
from engine.runner.kv_cache import KVCache
from engine.runner.loader import load_model
from engine.runner.quant_linears import Int4Linear, quant_kernels, small_matmul
from engine.runner.weights import LowPrecisionLinear


def bare_matmul(m: Any) -> Callable[[], torch.Tensor]:
    """The layer's weight times one token, nothing else: for Int4Linear the product a decode
    step makes (quant_matmul.cpp where it is built, else torch's int4 kernel)."""
    if isinstance(m, Int4Linear):
        x = torch.randn(1, m.in_features)
        product = small_matmul(m)
        return lambda: product(x)
    weight = m.weight
    x = torch.randn(1, m.in_features, dtype=weight.dtype)
    return lambda: torch.nn.functional.linear(x, weight)


def weight_nbytes(m: Any) -> int:
    """Bytes a decode step reads of the layer's weights."""
    if isinstance(m, Int4Linear):  # the codes the product reads (bare_matmul)
        own = quant_kernels() is not None
        tensors = (m.codes, m.block_scales, m.block_mins) if own else (m.packed, m.scales_and_zeros)
    else:
        tensors = (m.weight,)
    return sum(t.numel() * t.element_size() for t in tensors)


def timed_steps(step: Callable[[int], Any], steps: int) -> float:
    """Seconds per call of step(token), after 3 warm-up calls."""
    for i in range(3):
        step(200 + i)
    started = time.perf_counter()
    for i in range(steps):
        step(300 + i)
    return (time.perf_counter() - started) / steps


def attention_ms(cache: KVCache, model: Any, steps: int) -> dict[str, float]:
    """One token's attention over every layer's cached keys: the CPU kernel and SDPA (over
    the keys cast to the model's dtype, as prefill reads a float16 cache)."""
    cfg = model.config
    kv_heads, d = cache.kv_heads, cache.head_dim
    dtype = next(model.parameters()).dtype
    query = torch.randn(kv_heads, cfg.num_attention_heads // kv_heads, d, dtype=dtype)
    layers = [cache.layer_view(layer) for layer in range(cache.num_layers)]
    ways = {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(
            q[None], k[None].to(q.dtype), v[None].to(q.dtype)
        )
    }
    if dtype == torch.float32 and load_kernel() is not None:
        ways["kernel"] = lambda q, k, v: decode_attention(q, k, v, d**-0.5)
    out = {}
    for name, attend in ways.items():
        every_layer = functools.partial(lambda f, _: [f(query, k, v) for k, v in layers], attend)
        out[name] = round(timed_steps(every_layer, steps) * 1000, 2)
    return out


def measure(dtype: str, args: argparse.Namespace) -> dict:
    """dtype: the model's ("float32", "bfloat16"), or "float32+bfloat16-linears" and the like."""
    model_dtype, _, linears = dtype.partition("+")
    linear_dtype = linears.removesuffix("-linears") or model_dtype
    config = EngineConfig(
        model=args.model, device="cpu", dtype=model_dtype, linear_dtype=linear_dtype
    )
    loaded = load_model(config)
    model = loaded.model
    state = KVCacheState(model, args.context_tokens + args.steps + 16, kv_dtype=args.kv_dtype)
    plain = KVCacheState(model, args.context_tokens + args.steps + 16)
    prompt = torch.arange(args.context_tokens) % 1000 + 100  # ids of ordinary tokens
    with torch.inference_mode():
        state.prefill(prompt)
        plain.prefill(prompt)
        step = timed_steps(state.step, args.steps)
        step_hf = timed_steps(lambda t: forward_kv(model, [plain], torch.tensor([[t]])), args.steps)
        kinds = torch.nn.Linear | LowPrecisionLinear | Int4Linear
        layers = [m for m in model.modules() if isinstance(m, kinds)]
        matmuls = [bare_matmul(m) for m in layers]
        for matmul in matmuls:  # warm-up
            matmul()
        started = time.perf_counter()
        for _ in range(args.steps // 4 or 1):
            for matmul in matmuls:
                matmul()
        bare = (time.perf_counter() - started) / (args.steps // 4 or 1)
    weight_bytes = sum(weight_nbytes(m) for m in layers)
    return {
        "bench": "decode_floor",
        "dtype": dtype,
        "context_tokens": args.context_tokens,
        "kv_dtype": args.kv_dtype,
        "step_ms": round(step * 1000, 2),
        "lean_step": decoder_of(model) is not None,
        "transformers_step_ms": round(step_hf * 1000, 2),
        "attention_ms": attention_ms(state.cache, model, args.steps),
        "tok_s": round(1 / step, 1),
        "bare_matmuls_ms": round(bare * 1000, 2),
        "weights_mb": round(weight_bytes / 1e6),
        "weights_gb_s": round(weight_bytes / bare / 1e9, 1),
        "not_matmul_share": round(1 - bare / step, 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16", "float32+bfloat16-linears"]
    )
    parser.add_argument("--context-tokens", type=int, default=512)
    parser.add_argument(
        "--kv-dtype", default="model", help="the engine step's cache: model, float16"
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", help="default: the embedded model")
    args = parser.parse_args(argv)
    for dtype in args.dtypes:
        print(json.dumps(measure(dtype, args)), flush=True)


if __name__ == "__main__":
    main()
