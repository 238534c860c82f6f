"""Context-aware decoding (memory knob `contrast`, engine/runner/contrast.py): an answer read
afresh scored against the same request without its frame.

On the tiny random model: the scores' arithmetic, that a session's answer is exactly the
contrast of its two plain caches (alone and batched beside another request), that the knob is
checked, and that the turn is kept as without it. Whether answers improve is `bench recall`'s
business (docs/decisions/097-context-aware-decoding.md)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.memory.config import parse_memory_spec
from engine.protocol import InvalidRequest, MemorySpec
from engine.runner.adapter import read_adapter
from engine.runner.contrast import PLAUSIBLE, PUSHED_DOWN, contrast
from engine.runner.decode_state import KVCacheState, decode_batch
from engine.sessions.frame_text import FrameTextState
from engine.sessions.memory_state import MemoryState
from tests.engine.test_adapter import write_adapter
from tests.engine.test_frame_text import SPEC, _memory, held_after_a_question


def test_a_token_the_frame_raises_beats_one_written_either_way():
    # token 0: likely with the frame and without it; token 1: likely only with the frame
    with_frame = torch.tensor([2.0, 1.8, 0.5, -9.0])
    bare = torch.tensor([4.0, -2.0, 0.0, 0.0])
    assert int(with_frame.argmax()) == 0
    scores = contrast(with_frame, bare, 0.5)
    assert int(scores.argmax()) == 1
    framed, plain = with_frame.log_softmax(-1), bare.log_softmax(-1)
    torch.testing.assert_close(scores[:3], 1.5 * framed[:3] - 0.5 * plain[:3])
    # token 3 is under PLAUSIBLE of the frame's best: pushed down, still finite
    assert framed[3] < framed.max() + math.log(PLAUSIBLE)
    assert scores[3] < scores[:3].min() - PUSHED_DOWN / 2 and torch.isfinite(scores[3])


def test_alpha_zero_keeps_the_frame_s_choices():
    with_frame, bare = torch.randn(50), torch.randn(50)
    scores = contrast(with_frame, bare, 0.0)
    plausible = with_frame.log_softmax(-1) >= with_frame.log_softmax(-1).max() + math.log(PLAUSIBLE)
    torch.testing.assert_close(scores[plausible], with_frame.log_softmax(-1)[plausible])
    assert int(scores.argmax()) == int(with_frame.argmax())


QUESTION = [11, 12, 13, 14]


def _asked(model, alpha: float, question: list[int] = QUESTION):
    """A 300-token session of `contrast` alpha asked `question`: its memory, answer state, the
    prefill's logits and the frame's token ids."""
    memory, doc = _memory(model, 300)
    spec = MemorySpec("segments", {**SPEC, "contrast": alpha})
    memory.config = memory._frame.config = parse_memory_spec(spec, max_positions=8192)
    memory.set_query(f"t{int(doc[150])}")
    state = FrameTextState(MemoryState(memory, "segments"), model, "model")
    with torch.inference_mode():
        logits = state.prefill(torch.tensor(question))
    ids = memory.frame_ids()
    assert ids is not None
    return memory, state, logits, ids


def test_the_answer_contrasts_the_frame_with_the_bare_request(tiny_loaded):
    model = tiny_loaded.model
    memory, state, logits, ids = _asked(model, 0.5)
    with torch.inference_mode():
        plain, bare = KVCacheState(model), KVCacheState(model)
        framed = plain.prefill(torch.tensor(ids))
        bare.prefill(torch.tensor(ids[:8]))  # the sinks
        want = contrast(framed, bare.prefill(torch.tensor(QUESTION)), 0.5)
        torch.testing.assert_close(logits, want)
        token = int(logits.argmax())
        for _ in range(3):
            logits = state.step(token)
            want = contrast(plain.step(token), bare.step(token), 0.5)
            torch.testing.assert_close(logits, want)
            token = int(logits.argmax())
        # batched beside a plain request: the same scores, and the plain row its own
        other = KVCacheState(model)
        alone = KVCacheState(model)
        other.prefill(torch.tensor([5, 6, 7]))
        alone.prefill(torch.tensor([5, 6, 7]))
        both = decode_batch(model, [other, state], [9, token])
        torch.testing.assert_close(both[0], alone.step(9))
        torch.testing.assert_close(both[1], contrast(plain.step(token), bare.step(token), 0.5))
    state.flush()
    assert memory.num_tokens == 300 + 4 + 4  # the question and every answer token


def test_the_bare_request_reads_no_more_than_the_window(tiny_loaded):
    """A question longer than local_window (SPEC: 64): the bare row reads the sinks and its
    last 64 tokens, as much of it as the frame's window holds, not the whole call."""
    model = tiny_loaded.model
    question = [100 + i for i in range(150)]
    _, state, logits, ids = _asked(model, 0.5, question)
    with torch.inference_mode():
        plain, bare = KVCacheState(model), KVCacheState(model)
        framed = plain.prefill(torch.tensor(ids))
        bare.prefill(torch.tensor(ids[:8]))  # the sinks
        want = contrast(framed, bare.prefill(torch.tensor(question[-64:])), 0.5)
        torch.testing.assert_close(logits, want)
        assert state._bare is not None and state._bare.num_tokens == 8 + 64


def test_an_adapter_steps_both_rows(tiny_loaded, tmp_path):
    model = tiny_loaded.model
    adapter = read_adapter(write_adapter(tmp_path / "a.safetensors", model), model)
    _, state, _, ids = _asked(model, 1.0)
    with torch.inference_mode():
        plain, bare = KVCacheState(model), KVCacheState(model)
        plain.prefill(torch.tensor(ids))
        bare.prefill(torch.tensor([*ids[:8], *QUESTION]))
        for token in (21, 22):
            got = adapter.step(state, token)
            want = contrast(adapter.step(plain, token), adapter.step(bare, token), 1.0)
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("value", [-0.5, 4.5, "1", True, float("nan")])
def test_contrast_is_checked(value):
    with pytest.raises(InvalidRequest, match="memory.contrast"):
        parse_memory_spec(MemorySpec("segments", {"contrast": value}), max_positions=8192)


def test_contrast_takes_numbers():
    def parsed(params):
        return parse_memory_spec(MemorySpec("segments", params), max_positions=8192).contrast

    assert parsed({}) == 0.5
    assert parsed({"contrast": 0}) == 0.0
    assert parsed({"contrast": 1}) == 1.0
    assert parsed({"contrast": 0.5}) == 0.5


async def test_a_contrasted_session_keeps_the_turn(make_engine):
    engine = make_engine()
    if engine._frame_backend.encoder is None:
        pytest.skip("no sentence encoder installed: the frame's token ids are not kept")
    plain = await held_after_a_question(engine, "plain", {"contrast": 0.0})
    assert await held_after_a_question(engine, "cad", {"contrast": 0.5}) == plain
