"""Settings of the memory service (`longserve memory-store`), from LONGSERVE_MEMORY_STORE_* env."""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from memory_store.backends import DEFAULT_PIECE_BYTES, Backend, build_backend
from memory_store.backends.redis_connections import (
    SERVER_SCHEMES,
    is_cluster_url,
    parse_cluster_url,
)
from memory_store.retry import RetryPolicy

logger = logging.getLogger(__name__)


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return Path(base) / "longserve" / "memory_store"


class MemoryStoreSettings(BaseSettings):
    """One of `redis_url` / `data_dir`; neither means the embedded backend in `default_data_dir()`.

    `redis_url` is one server (`redis://`, `rediss://`, `unix://`) or a Redis Cluster
    (`redis+cluster://[:password@]host:port[,host:port...]`, `rediss+cluster://` for TLS; any
    reachable node will do, the rest of the cluster is discovered).
    `redis_min_replicas_ack`: replicas that must have a write before it is acknowledged (WAIT),
    so that a failover keeps it; unset means 1 on a cluster and 0 on one server. Set 0 for a
    cluster without replicas.
    `token`: the shared secret servers send as `Authorization: Bearer` (LONGSERVE_MEMORY_STORE_TOKEN
    on both sides); required to bind beyond loopback.
    """

    model_config = SettingsConfigDict(env_prefix="LONGSERVE_MEMORY_STORE_", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8001, ge=1, le=65535)
    redis_url: str | None = None
    data_dir: Path | None = None
    max_blob_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    redis_piece_bytes: int = Field(default=DEFAULT_PIECE_BYTES, ge=1024, le=512 * 1024 * 1024)
    redis_min_replicas_ack: int | None = Field(default=None, ge=0, le=16)
    redis_replica_ack_timeout_s: float = Field(default=1.0, gt=0, lt=5)  # below the socket timeout
    retry_attempts: int = Field(default=4, ge=1, le=20)
    retry_base_delay_s: float = Field(default=0.05, gt=0)
    embedder_device: str = "cpu"
    larimar_prefix_length: int = Field(default=4, ge=1)
    log_level: str = "info"
    # Issue #41: authentication and reclamation (docs/decisions/059).
    token: SecretStr | None = None
    reclaim_interval_s: float = Field(default=300.0, ge=0)  # 0: never sweep by itself
    chunk_grace_s: float = Field(default=3600.0, ge=0)

    @model_validator(mode="after")
    def _one_backend(self) -> MemoryStoreSettings:
        if self.redis_url is not None and self.data_dir is not None:
            raise ValueError("set redis_url or data_dir, not both")
        if self.redis_url is not None:
            if is_cluster_url(self.redis_url):
                parse_cluster_url(self.redis_url)  # InvalidStoreRequest is a ValueError
            elif not self.redis_url.startswith(SERVER_SCHEMES):
                raise ValueError(
                    "redis_url must be a redis://, rediss://, unix:// or redis+cluster:// URL"
                )
        return self

    @model_validator(mode="after")
    def _refuse_open_bind(self) -> MemoryStoreSettings:
        if self.token is not None and not self.token.get_secret_value().strip():
            raise ValueError("token is empty: set LONGSERVE_MEMORY_STORE_TOKEN to a secret")
        if self.token is None and not self.binds_loopback:
            raise ValueError(
                f"refusing to serve the memory store on non-loopback host {self.host!r} without "
                "a token: set LONGSERVE_MEMORY_STORE_TOKEN (and the same on every server), "
                "or bind to 127.0.0.1"
            )
        return self

    @property
    def backend_name(self) -> str:
        return "redis" if self.redis_url else "embedded"

    @property
    def binds_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def build_backend(self) -> Backend:
        retry = RetryPolicy(attempts=self.retry_attempts, base_delay_s=self.retry_base_delay_s)
        if self.redis_url is not None:
            return build_backend(
                redis_url=self.redis_url,
                piece_bytes=self.redis_piece_bytes,
                retry=retry,
                min_replicas_ack=self.redis_min_replicas_ack,
                replica_ack_timeout_s=self.redis_replica_ack_timeout_s,
            )
        return build_backend(data_dir=self.data_dir or default_data_dir())
