"""bench/question_rss.py's parts: the rise per question is a least-squares slope, and the
document is at least the characters asked for."""

from __future__ import annotations

import pytest

from bench.question_rss import document, slope


def test_the_rise_is_the_least_squares_slope():
    assert slope([]) == 0.0 and slope([1.5]) == 0.0
    assert slope([1.0, 1.5, 2.0, 2.5]) == pytest.approx(0.5)
    assert slope([1.0, 1.2, 1.0, 1.2]) == pytest.approx(0.04)  # noise, not a rise


def test_the_document_holds_the_characters_asked_for():
    text = document("news", 5000, 7)
    assert len(text) > 5000 and "\n\n" in text
    assert document("news", 5000, 7) == text
