"""What the stack exposes beyond the API (docker-compose.yml as rendered): Prometheus without
its lifecycle or admin API, Grafana without anonymous viewers."""

from __future__ import annotations

from typing import Any


def test_prometheus_cannot_be_stopped_or_wiped_over_http(compose: dict[str, Any]) -> None:
    command = compose["services"]["prometheus"]["command"]
    flags = command if isinstance(command, list) else command.split()
    assert not [
        f for f in flags if f.startswith(("--web.enable-lifecycle", "--web.enable-admin-api"))
    ]


def test_grafana_requires_a_sign_in(compose: dict[str, Any]) -> None:
    env = compose["services"]["grafana"]["environment"]
    assert str(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "false"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    assert str(env.get("GF_AUTH_DISABLE_LOGIN_FORM", "false")).lower() == "false"
    assert str(env.get("GF_USERS_ALLOW_SIGN_UP", "false")).lower() == "false"
