import math

import pytest
import torch

from engine.protocol import SamplingParams
from engine.runner.sampling import (
    apply_penalties,
    apply_top_k,
    apply_top_p,
    make_generator,
    sample_token,
    token_logprobs,
)

VOCAB = 10


def logits_fixture() -> torch.Tensor:
    return torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0, 0.5, 2.0, -2.0, 1.5, 0.2])


def no_counts() -> torch.Tensor:
    return torch.zeros(VOCAB, dtype=torch.int32)


def test_temperature_zero_is_argmax():
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, seed=1)
    assert sample_token(logits_fixture(), params, no_counts(), None) == 1


def test_same_seed_same_tokens_different_seed_differs():
    params = SamplingParams(temperature=1.5)
    flat = torch.zeros(VOCAB)

    def draw(seed: int) -> list[int]:
        gen = make_generator(seed, torch.device("cpu"))
        return [sample_token(flat, params, no_counts(), gen) for _ in range(30)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_keeps_k_largest():
    masked = apply_top_k(logits_fixture(), 3)
    assert torch.isfinite(masked).nonzero().flatten().tolist() == [1, 3, 6]
    assert torch.equal(apply_top_k(logits_fixture(), 0), logits_fixture())


def test_top_k_sampling_never_leaves_the_top_k():
    params = SamplingParams(temperature=5.0, top_k=2)
    gen = make_generator(0, torch.device("cpu"))
    drawn = {sample_token(logits_fixture(), params, no_counts(), gen) for _ in range(200)}
    assert drawn == {1, 3}


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    keep = lambda p: torch.isfinite(apply_top_p(logits, p)).nonzero().flatten().tolist()  # noqa: E731
    assert keep(0.5) == [0]
    assert keep(0.6) == [0, 1]
    assert keep(0.85) == [0, 1, 2]
    assert keep(0.01) == [0]  # the most likely token always survives
    assert keep(1.0) == [0, 1, 2, 3]


def test_penalties_follow_openai_formula():
    counts = torch.tensor([0, 2, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int32)
    out = apply_penalties(logits_fixture(), counts, presence=0.5, frequency=0.25)
    expected = logits_fixture()
    expected[1] -= 0.5 + 2 * 0.25
    expected[2] -= 0.5 + 1 * 0.25
    assert torch.allclose(out, expected)


def test_penalty_changes_greedy_choice():
    counts = torch.zeros(VOCAB, dtype=torch.int32)
    counts[1] = 1
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sample_token(logits_fixture(), params, counts, None) == 3


def test_logprobs_are_raw_log_softmax():
    logits = logits_fixture()
    chosen, top = token_logprobs(logits, 3, 2)
    ref = torch.log_softmax(logits, -1)
    assert chosen == pytest.approx(float(ref[3]))
    assert [t for t, _ in top] == [1, 3]
    assert math.isclose(sum(math.exp(v) for v in ref.tolist()), 1.0, rel_tol=1e-5)
