"""How the Redis backend reaches Redis, chosen by the URL's scheme.

- `redis://`, `rediss://`, `unix://`: one server (redis-py's `Redis.from_url`).
- `redis+cluster://[[user]:password@]host:port[,host:port...]` (`rediss+cluster://` for TLS):
  a Redis Cluster, discovered from whichever listed node answers (redis-py's `RedisCluster`).

Reads go through `client`, which follows the cluster's MOVED and ASK redirections. Writes go to
`primary(key)`, a plain client of the primary that owns the key's slot, so that a write and the
WAIT after it share one connection (WAIT counts only the writes made on its own connection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from memory_store.errors import InvalidStoreRequest

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
SERVER_SCHEMES = ("redis://", "rediss://", "unix://")
DEFAULT_PORT = 6379


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


@dataclass(frozen=True)
class ClusterAddress:
    """A `redis+cluster://` URL, parsed: the startup nodes and the credentials of every node."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False


def parse_cluster_url(url: str) -> ClusterAddress:
    """Raises InvalidStoreRequest for anything but `redis[s]+cluster://[auth@]host:port,...[/0]`."""
    scheme, _, rest = url.partition("://")
    if scheme + "://" not in CLUSTER_SCHEMES:
        raise InvalidStoreRequest(f"not a Redis Cluster URL: {scheme}://")
    netloc, _, path = rest.partition("/")
    if path not in ("", "0") or "?" in rest or "#" in rest:
        raise InvalidStoreRequest("a Redis Cluster URL takes no options and only database 0")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = []
    for item in hosts.split(","):
        host, colon, port = item.rpartition(":")
        if not colon:
            host, port = item, str(DEFAULT_PORT)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidStoreRequest(f"bad cluster node {item!r}: use host:port")
        nodes.append((host, int(port)))
    return ClusterAddress(tuple(nodes), username, password, tls=scheme == "rediss+cluster")


class RedisConnections:
    """`client` for reads, `primary(key)` for writes; one server or a cluster, by the URL."""

    def __init__(self, url: str, *, socket_timeout_s: float) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self._cluster: RedisCluster | None = None
        self._primaries: dict[str, aioredis.Redis] = {}
        self._refresh = False
        # No retries inside redis-py's connections (its default backs off for seconds): the
        # backend's RetryPolicy is the one place that retries and backs off.
        options: dict[str, Any] = {
            "socket_connect_timeout": socket_timeout_s,
            "socket_timeout": socket_timeout_s,
            "retry": Retry(NoBackoff(), retries=0),
        }
        if not is_cluster_url(url):
            self.client: aioredis.Redis | RedisCluster = aioredis.Redis.from_url(url, **options)
            return
        address = parse_cluster_url(url)
        self._node_options = {
            "username": address.username,
            "password": address.password,
            "ssl": address.tls,
            **options,
        }
        # The cluster client retries once itself, after re-reading the slot map.
        self._cluster = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in address.nodes],
            **{**self._node_options, "retry": Retry(NoBackoff(), retries=1)},
        )
        self.client = self._cluster

    async def primary(self, key: str) -> Any:
        """A `redis.asyncio.Redis` of the primary that owns `key`'s slot (the one server)."""
        if self._cluster is None:
            return self.client
        import redis.asyncio as aioredis

        await self._cluster.initialize()  # once; a no-op after the first call
        if self._refresh:
            await self._cluster.nodes_manager.initialize()
            self._refresh = False
        node = self._cluster.get_node_from_key(key)
        assert node is not None  # None only when asking for a replica
        client = self._primaries.get(node.name)
        if client is None:
            client = aioredis.Redis(host=node.host, port=int(node.port), **self._node_options)
            self._primaries[node.name] = client
        return client

    def write_failed(self) -> None:
        """Re-read the slot map before the next write: its slot may have moved or failed over."""
        self._refresh = True

    async def ping(self) -> None:
        if self._cluster is not None:
            await self._cluster.ping(target_nodes=self._cluster.PRIMARIES)
        else:
            await self.client.ping()

    def transient_errors(self) -> tuple[type[BaseException], ...]:
        """What a retry may cure: lost connections, and in a cluster a failover or resharding in
        progress (CLUSTERDOWN, MASTERDOWN, TRYAGAIN, MOVED/ASK seen by a write, a stale replica,
        or no node answering the slot-map query, which redis-py raises as RedisClusterException)."""
        from redis import exceptions as rexc

        errors: tuple[type[BaseException], ...] = (
            rexc.ConnectionError,
            rexc.TimeoutError,
            rexc.BusyLoadingError,
            ConnectionError,
            TimeoutError,
        )
        if self._cluster is not None:
            errors += (
                rexc.ClusterError,  # ClusterDownError, MasterDownError, "TTL exhausted"
                rexc.TryAgainError,
                rexc.AskError,  # MovedError too
                rexc.ReadOnlyError,
                rexc.RedisClusterException,
            )
        return errors

    async def close(self) -> None:
        await self.client.aclose()
        for client in self._primaries.values():
            await client.aclose()
        self._primaries.clear()
