"""Settings refuse unsafe binds; the CLI builds them and exits 2 on bad configuration."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from server.cli import build_parser, main, settings_from_args, tenant_shares
from server.settings import ServerSettings, tenant_of


def test_non_loopback_without_key_is_refused() -> None:
    with pytest.raises(ValidationError, match="non-loopback"):
        ServerSettings(host="0.0.0.0")
    assert ServerSettings(host="0.0.0.0", api_keys=["k"]).host == "0.0.0.0"
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert ServerSettings(host=host).api_keys == []


def test_api_keys_from_env_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONGSERVE_API_KEYS", "k1, k2,,k3")
    monkeypatch.setenv("LONGSERVE_HOST", "0.0.0.0")
    settings = ServerSettings()
    assert settings.api_keys == ["k1", "k2", "k3"]
    assert settings.tenants() == {k: tenant_of(k) for k in ("k1", "k2", "k3")}
    assert len(set(settings.tenants().values())) == 3


def test_single_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONGSERVE_API_KEYS", "only")
    assert ServerSettings().api_keys == ["only"]


def test_cli_overrides_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONGSERVE_PORT", "9000")
    monkeypatch.setenv("LONGSERVE_MODEL", "from-env")
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9100",
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--host",
            "0.0.0.0",
            "--memory-store",
            "redis://x:6379",
        ]
    )
    settings = settings_from_args(args)
    assert settings.port == 9100
    assert settings.model == "from-env"
    assert settings.api_keys == ["a", "b"]
    assert settings.memory_store_url == "redis://x:6379"


def test_cli_refuses_public_host_without_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LONGSERVE_API_KEYS", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "non-loopback" in capsys.readouterr().err


def test_server_package_does_not_import_torch() -> None:
    code = (
        "import sys, server.app, server.cli, server.serving.chat, server.serving.completions\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'transformers', 'faiss'} or (m.startswith('engine.') and "
        "m != 'engine.protocol' and not m.startswith('engine.protocol.')))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def test_bench_subcommand_passes_the_rest_to_the_benchmark() -> None:
    import importlib

    from server.cli import BENCHMARKS

    args = build_parser().parse_args(["bench", "passkey", "--lengths", "4096", "-n", "2"])
    assert args.name == "passkey" and args.args == ["--lengths", "4096", "-n", "2"]
    for name in BENCHMARKS:  # every listed benchmark exists and takes argv
        assert callable(importlib.import_module(f"bench.{name}").main)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "nonexistent"])


def test_per_tenant_shares_from_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONGSERVE_MAX_WAITING_REQUESTS_PER_TENANT", "5")
    args = build_parser().parse_args(["serve", "--max-running-requests-per-tenant", "3"])
    settings = settings_from_args(args)
    assert settings.max_running_requests_per_tenant == 3
    assert settings.max_waiting_requests_per_tenant == 5


def test_threads_from_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_from_args(build_parser().parse_args(["serve"])).threads == 0
    monkeypatch.setenv("LONGSERVE_THREADS", "2")
    assert settings_from_args(build_parser().parse_args(["serve"])).threads == 2
    args = build_parser().parse_args(["serve", "--threads", "1"])
    assert settings_from_args(args).threads == 1


def test_per_tenant_shares_default_to_the_engine_s_fractions() -> None:
    settings = settings_from_args(build_parser().parse_args(["serve"]))
    assert settings.max_running_requests_per_tenant is None
    assert settings.max_waiting_requests_per_tenant is None


def test_without_api_keys_the_one_tenant_gets_the_whole_queue() -> None:
    keyless = settings_from_args(build_parser().parse_args(["serve"]))
    assert tenant_shares(keyless) == {
        "max_waiting_requests_per_tenant": 64,
        "max_running_requests_per_tenant": 8,
    }
    keyed = settings_from_args(build_parser().parse_args(["serve", "--api-key", "k"]))
    assert tenant_shares(keyed) == {
        "max_waiting_requests_per_tenant": None,  # the engine's defaults: 16 and 6
        "max_running_requests_per_tenant": None,
    }


def test_adapters_from_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """--adapter NAME=PATH (repeatable) or LONGSERVE_ADAPTERS="a=/x,/y"; `longserve adapt`
    takes its own arguments."""
    assert settings_from_args(build_parser().parse_args(["serve"])).adapters == []
    monkeypatch.setenv("LONGSERVE_ADAPTERS", "a=/x, /y")
    assert settings_from_args(build_parser().parse_args(["serve"])).adapters == ["a=/x", "/y"]
    args = build_parser().parse_args(["serve", "--adapter", "b=/z", "--adapter", "/w"])
    assert settings_from_args(args).adapters == ["b=/z", "/w"]
    adapt = build_parser().parse_args(["adapt", "--steps", "3", "--rank", "4"])
    assert adapt.steps == 3 and adapt.rank == 4 and callable(adapt.run)
