"""How often the lean decode step picks the token transformers' forward picks, on real text.

In process, per --linear-dtypes entry: --prompts prompts of real text (bench/recall_corpus.py's
filler, a different passage each) at each --context-tokens length are read into two KV caches;
then --new-tokens greedy steps run with teacher forcing: both caches take the fp32 reference's
token, so every step compares the same context. Agreement is the share of steps where the
path's argmax equals the reference's:

- `lean_vs_transformers`: the lean step (engine/runner/decode_step.py) against transformers' forward
  on the same weights;
- `vs_fp32`: the lean step against transformers' forward on the fp32 model (the precision's
  own divergence).

--kv-dtype float16 keeps the lean step's cache in half precision (EngineConfig.kv_dtype); the
transformers caches stay in the model's dtype, so both figures then include its rounding.

    longserve bench decode_agreement --linear-dtypes float32 int4 --context-tokens 512 2048
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from bench.recall_corpus import filler, load_token_counter
from engine.config import EngineConfig
from engine.runner.decode_state import KVCacheState, forward_kv
from engine.runner.loader import load_model


def passage(tokenizer: Any, seed: int, tokens: int) -> torch.Tensor:
    paragraphs = filler("docs", f"agreement-{seed}", tokens + 64, load_token_counter(None))
    ids = tokenizer("\n\n".join(p for p, _ in paragraphs)).input_ids[:tokens]
    return torch.tensor(ids)


def greedy_reference(model: Any, prompt: torch.Tensor, steps: int) -> list[int]:
    """transformers' forward on the fp32 model: the tokens every path is fed."""
    state = KVCacheState(model, len(prompt) + steps + 1)
    logits = state.prefill(prompt)
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = forward_kv(model, [state], torch.tensor([[tokens[-1]]]))[0]
    return tokens


def agreement(
    model: Any, reference: Any, prompt: torch.Tensor, tokens: list[int], kv_dtype: str = "auto"
) -> dict:
    size = len(prompt) + len(tokens) + 1
    lean = KVCacheState(model, size, kv_dtype=kv_dtype)
    plain, ref = KVCacheState(model, size), KVCacheState(reference, size)
    logits = [s.prefill(prompt) for s in (lean, plain, ref)]
    same_path = same_fp32 = 0
    for token in tokens:
        picks = [int(x.argmax()) for x in logits]
        same_path += picks[0] == picks[1]
        same_fp32 += picks[0] == picks[2]
        logits = [
            lean.step(token),
            forward_kv(model, [plain], torch.tensor([[token]]))[0],
            forward_kv(reference, [ref], torch.tensor([[token]]))[0],
        ]
    return {"lean_vs_transformers": same_path, "vs_fp32": same_fp32, "steps": len(tokens)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--linear-dtypes", nargs="+", default=["float32", "int4"])
    parser.add_argument("--context-tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kv-dtype", default="model", help="the lean step's cache: model, float16")
    parser.add_argument("--model", help="default: the embedded model")
    args = parser.parse_args(argv)
    reference = load_model(
        EngineConfig(model=args.model, device="cpu", linear_dtype="float32", lean_decode=False)
    )
    with torch.inference_mode():
        for linear_dtype in args.linear_dtypes:
            loaded = load_model(
                EngineConfig(model=args.model, device="cpu", linear_dtype=linear_dtype)
            )
            for context in args.context_tokens:
                totals = {"lean_vs_transformers": 0, "vs_fp32": 0, "steps": 0}
                for seed in range(args.prompts):
                    prompt = passage(reference.tokenizer, seed, context)
                    tokens = greedy_reference(reference.model, prompt, args.new_tokens)
                    got = agreement(loaded.model, reference.model, prompt, tokens, args.kv_dtype)
                    totals = {k: totals[k] + got[k] for k in totals}
                steps = totals["steps"]
                print(
                    json.dumps(
                        {
                            "bench": "decode_agreement",
                            "linear_dtype": linear_dtype,
                            "kv_dtype": args.kv_dtype,
                            "context_tokens": context,
                            "prompts": args.prompts,
                            "steps": steps,
                            "lean_vs_transformers": round(
                                totals["lean_vs_transformers"] / steps, 4
                            ),
                            "vs_fp32": round(totals["vs_fp32"] / steps, 4),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
