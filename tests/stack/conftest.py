"""The images, built once per run, and a record of what they cost (printed at the end and kept
in the log folder for the closing note): image sizes, build times, times to healthy."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from tests.stack import images
from tests.stack.engine import ensure_engine
from tests.stack.figures import FIGURES


@pytest.fixture(scope="session")
def log_dir() -> Path:
    path = Path(os.environ.get("LONGSERVE_STACK_LOGS") or tempfile.mkdtemp(prefix="stack-logs-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def built(log_dir: Path) -> dict[str, images.Built]:
    reason = ensure_engine(log_dir)
    if reason:
        pytest.skip(f"THE DEPLOYMENT TEST DID NOT RUN: no container engine here: {reason}")
    made = {
        "python": images.python_base(),
        "services": images.services(),
    }
    made["project"] = images.project(log_dir / "docker-build.log")
    for key, image in made.items():
        FIGURES[f"{key}_build_seconds"] = round(image.seconds, 1)
        FIGURES[f"{key}_image_bytes"] = image.size_bytes
    return made


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.write_line("stack figures: " + json.dumps(FIGURES, sort_keys=True))
        logs = os.environ.get("LONGSERVE_STACK_LOGS")
        if logs:
            (Path(logs) / "figures.json").write_text(json.dumps(FIGURES, indent=1))
