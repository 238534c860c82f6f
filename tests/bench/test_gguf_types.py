"""What `longserve bench gguf_types` reports about two greedy continuations and where it writes
its files. The benchmark itself runs llama.cpp and is run by hand (docs/decisions/068)."""

from __future__ import annotations

import pytest

from bench.gguf_types import REPOSITORY, agreement, work_dir


def test_agreement_counts_equal_positions_and_the_first_that_differs():
    assert agreement(["a", "b", "c", "d"], ["a", "b", "x", "d"]) == {
        "same": 3,
        "of": 4,
        "first_divergence": 2,
    }


def test_agreement_of_equal_continuations_has_no_divergence():
    assert agreement([1, 2, 3], [1, 2, 3]) == {"same": 3, "of": 3, "first_divergence": None}


def test_agreement_compares_only_the_shorter_continuation():
    assert agreement([1, 2], [1, 2, 3]) == {"same": 2, "of": 2, "first_divergence": None}
    assert agreement([], [1]) == {"same": 0, "of": 0, "first_divergence": None}


def test_the_files_never_go_into_the_repository(tmp_path):
    inside = str(REPOSITORY / "bench" / "scratch")
    with pytest.raises(SystemExit, match="inside the repository"), work_dir(inside):
        pass
    with work_dir(str(tmp_path / "types")) as chosen:
        assert chosen.is_dir()
    with work_dir(None) as scratch:
        assert scratch.is_dir() and not scratch.is_relative_to(REPOSITORY)
    assert not scratch.exists()
