"""deploy/nginx.conf: `nginx -t` accepts it, it streams unbuffered and re-resolves replicas."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.deploy.tools import DEPLOY, require


def test_proxy_config_passes_nginx_check(tmp_path: Path) -> None:
    nginx = require("nginx", Path("/usr/sbin/nginx"), install="apt-get install nginx-light")
    (tmp_path / "logs").mkdir()
    result = subprocess.run(
        [nginx, "-t", "-p", f"{tmp_path}/", "-e", "stderr", "-c", str(DEPLOY / "nginx.conf")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_proxy_streams_and_follows_scaling() -> None:
    text = (DEPLOY / "nginx.conf").read_text()
    assert "resolver 127.0.0.11" in text, "Docker's DNS, re-resolved to see new replicas"
    assert re.search(r"set \$\w+ http://server:8000;", text)
    assert "proxy_buffering off;" in text, "server-sent events must not be buffered"
