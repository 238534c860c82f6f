"""Choosing the next token: penalties, temperature, top-k, top-p, seeded sampling, logprobs.

Plain functions on one position's logits (vocab,). Order as in vLLM: penalties, temperature,
top-k, top-p, then sample. Logprobs are the log-softmax of the model's raw logits (before
penalties, temperature and truncation), as OpenAI and vLLM's default ("raw_logprobs") report
them: they describe the model, not the sampler, so they are comparable across sampling settings.
"""

from __future__ import annotations

import torch

from engine.protocol import InvalidRequest, SamplingParams

MAX_TOP_LOGPROBS = 20


def check_sampling(sampling: SamplingParams) -> None:
    """InvalidRequest, naming the parameter, for sampling settings no request may use."""

    def bad(msg: str, param: str) -> InvalidRequest:
        return InvalidRequest(msg, param=param)

    if sampling.max_tokens < 1:
        raise bad("max_tokens must be at least 1", "max_tokens")
    if not sampling.temperature >= 0.0:
        raise bad("temperature must be >= 0", "temperature")
    if not 0.0 < sampling.top_p <= 1.0:
        raise bad("top_p must be in (0, 1]", "top_p")
    if sampling.top_k < 0:
        raise bad("top_k must be >= 0 (0 disables it)", "top_k")
    if not 0 <= sampling.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    if not all(isinstance(s, str) for s in sampling.stop):
        raise bad("stop must be a list of strings", "stop")


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A per-request generator: the same seed gives the same tokens on the same engine."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def apply_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI semantics: logits - presence * (count > 0) - frequency * count.

    logits: (vocab,) float; counts: (vocab,) how often each token was generated so far.
    """
    if presence == 0.0 and frequency == 0.0:
        return logits
    counts = counts.to(logits.dtype)
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the top_k largest logits (ties at the k-th value are kept); top_k <= 0 is a no-op."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probability reaches top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)  # (vocab,)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
    drop_sorted = mass_before >= top_p
    drop_sorted[0] = False  # always keep the most likely token
    drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    counts: torch.Tensor,
    generator: torch.Generator | None,
) -> int:
    """The next token id from one position's raw logits (vocab,)."""
    logits = apply_penalties(
        logits.float(), counts, params.presence_penalty, params.frequency_penalty
    )
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(
    logits: torch.Tensor, token_id: int, top_n: int
) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of token_id, top_n (id, logprob) pairs) from the raw logits (vocab,)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = float(logprobs[token_id])
    if top_n <= 0:
        return chosen, []
    top = torch.topk(logprobs, min(top_n, logprobs.shape[-1]))
    return chosen, list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
