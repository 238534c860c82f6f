"""Where the deployment files live, and the tools a deployment would run on them: found on PATH,
beside this interpreter or at a known location, else the test is skipped saying what to install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def tool(name: str, *extra_candidates: Path) -> str | None:
    """The tool on PATH, else beside this interpreter (the venv's bin), else a known location."""
    found = shutil.which(name)
    if found:
        return found
    for candidate in (
        Path(sys.executable).parent / name,
        REPO / ".venv" / "bin" / name,
        *extra_candidates,
    ):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def require(name: str, *extra_candidates: Path, install: str) -> str:
    path = tool(name, *extra_candidates)
    if path is None:
        pytest.skip(f"`{name}` is not installed ({install})")
    return path


def yaml_module() -> Any:
    return pytest.importorskip("yaml", reason="PyYAML is needed to read the YAML files")


def nginx_check(nginx: str, text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`nginx -t` on `text` as a config, with `tmp_path` as its prefix."""
    config = tmp_path / "nginx.conf"
    config.write_text(text)
    (tmp_path / "logs").mkdir(exist_ok=True)
    return subprocess.run(
        [nginx, "-t", "-p", f"{tmp_path}/", "-e", "stderr", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
