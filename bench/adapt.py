"""`longserve adapt`: train the answer adapter (a LoRA on q, k and v) on synthetic retrieval
tasks from installed text, on this CPU, and write it as safetensors.

The adapter answers; the base model reads. Each example is a chat whose prompt (passage and
question, the way a session or an inline request holds them) is read by the base model with
no gradient, then the prompt's last `lead` tokens (the assistant header) and the answer are
read with the adapter, the loss on the answer: the fact's sentence naming the asked key. So
documents, sessions and caches stay the base model's, and serving applies the adapter only to
the tokens a request generates (engine/runner/adapter.py). Tasks: bench/adapt_tasks.py (tuned
kinds only). Hyperparameters as LoRA names them (Hu et al. 2021): rank r, alpha.

    longserve adapt --steps 150 --out engine/adapters/recall.safetensors
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.adapt_tasks import Task, tasks
from bench.recall_corpus import LONG_NUMBER

TARGETS = ("q_proj", "k_proj", "v_proj")
LEAD = 3  # prompt tokens read with the adapter: SmolLM2's "<|im_start|>assistant\n"


class LoRA:
    """Low-rank updates B A (scaled by alpha / r) added to each layer's q, k and v outputs
    while `active`."""

    def __init__(self, model, rank: int, alpha: float, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.active = False
        self.params: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(model.model.layers):
            for target in TARGETS:
                linear = getattr(layer.self_attn, target)
                bound = 1 / math.sqrt(linear.in_features)  # LoRA's A init, B zero
                a = (torch.rand(rank, linear.in_features, generator=gen) * 2 - 1) * bound
                b = torch.zeros(linear.out_features, rank)
                name = f"layers.{i}.{target.removesuffix('_proj')}"
                self.params[f"{name}.A"] = a.requires_grad_()
                self.params[f"{name}.B"] = b.requires_grad_()
                linear.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(_module, args, out):
            if not self.active:
                return out
            a, b = self.params[f"{name}.A"], self.params[f"{name}.B"]
            return out + (args[0] @ a.T @ b.T) * self.scaling

        return hook

    def load(self, path: Path) -> None:
        """Start from a saved adapter's A and B (the same rank, alpha and targets)."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        saved = load_file(str(path))
        if saved.keys() != self.params.keys():
            raise SystemExit(f"{path}: not an adapter of this model's layers and rank")
        with safe_open(str(path), framework="pt") as f:
            alpha = float((f.metadata() or {}).get("alpha", "nan"))
        if alpha != self.alpha:  # its B A was trained under another scale: --alpha must match
            raise SystemExit(f"{path}: alpha {alpha}, not this run's --alpha {self.alpha}")
        with torch.no_grad():
            for name, param in self.params.items():
                if saved[name].shape != param.shape:
                    raise SystemExit(f"{path}: {name} is {tuple(saved[name].shape)}")
                param.copy_(saved[name].float())

    def save(self, path: Path, metadata: dict[str, str]) -> None:
        tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in self.params.items()}
        meta = {"rank": str(self.rank), "alpha": str(self.alpha), "lead": str(LEAD), **metadata}
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)


def load_base(directory: str | None = None):
    """The embedded SmolLM2 in float32 (its GGUF dequantized), or a model directory's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.runner.gguf_once import parsed_once
    from engine.runner.loader import embedded_model_path

    if directory is None:
        gguf = embedded_model_path()
        source, kwargs = str(gguf.parent), {"gguf_file": gguf.name}
    else:
        source, kwargs = directory, {}
    with parsed_once():  # the GGUF's header read once for both
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.float32, attn_implementation="sdpa", **kwargs
        )
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), tokenizer


def prompts(tokenizer, task: Task, session_form: bool) -> list[list[int]]:
    """Each question's prompt ids as the engine renders it: the passage and the question in
    one user message (inline, reference), or the passage a user turn of its own (sessions)."""
    from engine.runner.chat_template import encode_chat

    out = []
    for question, _ in task.questions:
        if session_form:
            messages = [
                {"role": "user", "content": task.passage},
                {"role": "user", "content": question},
            ]
        else:
            messages = [{"role": "user", "content": f"{task.passage}\n\n{question}"}]
        out.append(encode_chat(tokenizer, messages))
    return out


def common_prefix(lists: list[list[int]]) -> int:
    n = min(len(x) for x in lists)
    for i in range(n):
        if any(x[i] != lists[0][i] for x in lists):
            return i
    return n


def read(model, ids: list[int], cache):
    return model(torch.tensor([ids]), past_key_values=cache, use_cache=True)


def task_loss(
    model, lora: LoRA, tokenizer, task: Task, session_form: bool, end: int
) -> tuple[float, int]:
    """Backpropagate the answer loss of every question of `task`; (summed loss, answers)."""
    from transformers import DynamicCache

    all_ids = prompts(tokenizer, task, session_form)
    shared = min(common_prefix(all_ids), min(len(x) for x in all_ids) - LEAD)
    prefix = DynamicCache()
    lora.active = False
    with torch.no_grad():
        read(model, all_ids[0][:shared], prefix)
    layers = [(layer.keys, layer.values) for layer in prefix.layers]
    total = 0.0
    for ids, (_, sentence) in zip(all_ids, task.questions, strict=True):
        cache = DynamicCache()  # the passage's keys and values, shared by every question
        for i, (keys, values) in enumerate(layers):
            cache.update(keys, values, i)
        total += answer_loss(model, lora, tokenizer, ids, shared, cache, sentence, end)
    return total, len(task.questions)


def answer_loss(
    model, lora: LoRA, tokenizer, ids: list[int], start: int, cache, sentence: str, end: int
) -> float:
    """Backpropagate one prompt's answer loss: the base model reads ids[start:-LEAD] into
    cache (which holds ids[:start]), the adapter the last LEAD tokens and the answer."""
    answer = tokenizer.encode(sentence, add_special_tokens=False) + [end]
    lora.active = False
    with torch.no_grad():
        if len(ids) - LEAD > start:
            read(model, ids[start:-LEAD], cache)
    lora.active = True
    logits = read(model, ids[-LEAD:] + answer[:-1], cache).logits[0, LEAD - 1 :]
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(answer))
    loss.backward()
    lora.active = False
    return float(loss.detach())


@torch.no_grad()
def answer(model, tokenizer, ids: list[int], end: int, adapted: bool, lora: LoRA) -> str:
    """Greedy answer to prompt ids: the base model reads, the adapter (if `adapted`) answers."""
    from transformers import DynamicCache

    cache = DynamicCache()
    lora.active = False
    read(model, ids[:-LEAD], cache)
    lora.active = adapted
    logits = read(model, ids[-LEAD:], cache).logits[0, -1]
    out: list[int] = []
    for _ in range(96):  # room for a list of four values
        token = int(logits.argmax())
        if token == end:
            break
        out.append(token)
        logits = read(model, [token], cache).logits[0, -1]
    lora.active = False
    return tokenizer.decode(out)


def right(sentence: str, said: str) -> bool:
    """A single value in the answer; a list's every value and no other number of that size."""
    values = set(LONG_NUMBER.findall(sentence))
    if len(values) == 1:
        return next(iter(values)) in said
    return set(LONG_NUMBER.findall(said)) == values


def evaluate_frames(model, tokenizer, lora: LoRA, examples, end: int) -> dict[str, int]:
    """Base and adapter on prompts as a session's answer reads them (frames)."""
    score = {"frames_base": 0, "frames_adapter": 0, "frames_n": 0}
    for ids, sentence in examples:
        score["frames_n"] += 1
        for name, adapted in (("frames_base", False), ("frames_adapter", True)):
            score[name] += right(sentence, answer(model, tokenizer, ids, end, adapted, lora))
    return score


def evaluate(model, tokenizer, lora: LoRA, held: list[Task], end: int) -> dict[str, int]:
    """Base and adapter on held tasks; list passages' questions also counted apart (lists_*)."""
    score = {"base": 0, "adapter": 0, "n": 0, "lists_base": 0, "lists_adapter": 0, "lists_n": 0}
    for i, task in enumerate(held):
        for ids, (_, sentence) in zip(
            prompts(tokenizer, task, i % 2 == 0), task.questions, strict=True
        ):
            groups = ("", "lists_") if task.lists else ("",)
            for group in groups:
                score[f"{group}n"] += 1
            for name, adapted in (("base", False), ("adapter", True)):
                hit = right(sentence, answer(model, tokenizer, ids, end, adapted, lora))
                for group in groups:
                    score[f"{group}{name}"] += hit
    return score


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (one passage each)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    parser.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha / r)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-tasks", type=int, default=6, help="synthetic passages to check on")
    parser.add_argument(
        "--lists", type=float, default=0.0, help="share of passages whose keys hold lists"
    )
    parser.add_argument(
        "--list-answer",
        choices=("list", "sentences"),
        default="list",
        help="a list's target: one sentence listing the values, or each value's own sentence",
    )
    parser.add_argument(
        "--list-relations",
        choices=("fixed", "generated"),
        default="fixed",
        help="lists' relations: the six fixed ones, or drawn from owners, items, verbs and "
        "wordings (bench/adapt_lists.py)",
    )
    parser.add_argument(
        "--frames",
        type=float,
        default=0.0,
        help="share of steps whose passage is read into a session and asked as its answer "
        "reads it: the frame's tokens (bench/adapt_frames.py)",
    )
    parser.add_argument(
        "--frame-tokens",
        type=int,
        nargs=2,
        default=(6000, 12000),
        metavar=("LO", "HI"),
        help="passage length (tokens) of those steps",
    )
    parser.add_argument(
        "--frame-knob",
        action="append",
        default=[],
        metavar="K=V",
        help="a memory knob of those steps' sessions (default: the server's segments memory)",
    )
    parser.add_argument("--init", type=Path, help="start from this adapter (same rank) instead")
    parser.add_argument("--out", type=Path, default=Path("engine/adapters/recall.safetensors"))
    parser.add_argument("--model", help="a model directory (default: the embedded SmolLM2)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="longserve adapt", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    model, tokenizer = load_base(args.model)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def count(texts: list[str]) -> list[int]:
        return [len(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    lora = LoRA(model, args.rank, args.alpha, args.seed)
    if args.init:
        lora.load(args.init)
    optimizer = torch.optim.AdamW(list(lora.params.values()), lr=args.lr, weight_decay=0.0)
    lists = {  # the list options every task stream shares
        "lists": args.lists,
        "list_answer": args.list_answer,
        "list_relations": args.list_relations,
    }
    evals = tasks(f"eval:{args.seed}", count, facts=(4, 8), **lists)
    held = list(itertools.islice(evals, args.eval_tasks))
    stream = tasks(args.seed, count, **lists)
    reader = frame_stream = None
    framed = random.Random(f"frames:{args.seed}")
    if args.frames > 0:
        from transformers import DynamicCache

        from bench.adapt_frames import FrameReader

        knobs = {k: json.loads(v) for k, _, v in (x.partition("=") for x in args.frame_knob)}
        reader = FrameReader(LEAD, args.model, knobs)
        frame_stream = tasks(
            f"frames:{args.seed}",
            count,
            tokens=tuple(args.frame_tokens),
            **lists,
        )
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        if reader is not None and frame_stream is not None and framed.random() < args.frames:
            loss, n = 0.0, 0
            for _ in range(20):  # a passage whose frames hold none of its answers: another
                framed_task = next(frame_stream)
                kind = "frames, list" if framed_task.lists else "frames, single"
                for ids, sentence in reader.examples(framed_task):
                    cache = DynamicCache()  # a frame of its own: nothing shared
                    loss += answer_loss(model, lora, tokenizer, ids, 0, cache, sentence, end)
                    n += 1
                if n:
                    break
            else:
                raise SystemExit("20 passages in a row whose frames held none of the answers")
        else:
            task = next(stream)
            kind = "list" if task.lists else "single"
            loss, n = task_loss(model, lora, tokenizer, task, step % 2 == 0, end)
        for p in lora.params.values():
            p.grad /= n
        lr = args.lr * min(1.0, step / 10) * (0.5 + 0.5 * math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        line = {"step": step, "loss": round(loss / n, 4), "questions": n, "kind": kind}
        print(json.dumps({**line, "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    result = evaluate(model, tokenizer, lora, held, end) if args.eval_tasks else {}
    if reader is not None and args.eval_tasks:
        evals = tasks(
            f"frames-eval:{args.seed}",
            count,
            tokens=tuple(args.frame_tokens),
            **lists,
        )
        framed_held = itertools.islice(evals, args.eval_tasks)
        examples = [x for task in framed_held for x in reader.examples(task)]
        result |= evaluate_frames(model, tokenizer, lora, examples, end)
    print(json.dumps({"eval": result}), flush=True)
    command = (
        (
            f"longserve adapt --steps {args.steps} --rank {args.rank} --alpha {args.alpha} "
            f"--lr {args.lr} --seed {args.seed} --out {args.out}"
        )
        + (f" --lists {args.lists}" if args.lists else "")
        + (f" --list-answer {args.list_answer}" if args.list_answer != "list" else "")
        + (f" --list-relations {args.list_relations}" if args.list_relations != "fixed" else "")
        + (
            f" --frames {args.frames} --frame-tokens {args.frame_tokens[0]} {args.frame_tokens[1]}"
            if args.frames
            else ""
        )
        + (f" --init {args.init}" if args.init else "")
    )
    lora.save(
        args.out,
        {
            "base": args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
            "command": command,
            "eval": json.dumps(result),
        },
    )
    print(json.dumps({"saved": str(args.out)}), flush=True)
    return 0


if __name__ == "__main__":
    main()
