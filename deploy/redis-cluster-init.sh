#!/bin/sh
# Forms the Redis Cluster of docker-compose.yml's `cluster` profile, once; on later starts
# re-introduces the nodes at their current addresses (a container may come back on a new IP),
# then waits until the cluster serves every slot. redis-cli reads the password from
# REDISCLI_AUTH.
#
#   REDIS_CLUSTER_NODES     host:port of every node, space-separated (primaries first)
#   REDIS_CLUSTER_REPLICAS  replicas per primary (default 1)
#   REDIS_CLUSTER_WAIT_S    how long to wait for cluster_state:ok (default 60)
set -eu

: "${REDIS_CLUSTER_NODES:?set REDIS_CLUSTER_NODES (host:port ...)}"
replicas="${REDIS_CLUSTER_REPLICAS:-1}"
wait_s="${REDIS_CLUSTER_WAIT_S:-60}"

# CLUSTER MEET takes addresses, not names.
addresses=""
for node in $REDIS_CLUSTER_NODES; do
    host="${node%:*}"
    port="${node##*:}"
    ip="$(getent hosts "$host" | awk '{ print $1; exit }')"
    [ -n "$ip" ] || { echo "cannot resolve $host" >&2; exit 1; }
    addresses="$addresses $ip:$port"
done
first="${addresses# }"
first="${first%% *}"

info() { redis-cli -h "${first%:*}" -p "${first##*:}" cluster info | tr -d '\r'; }

if info | grep -q '^cluster_slots_assigned:0$'; then
    echo "creating the cluster:$addresses"
    # shellcheck disable=SC2086  # one argument per node
    redis-cli --cluster create $addresses --cluster-replicas "$replicas" --cluster-yes
else
    echo "cluster exists; meeting every node at its current address"
    for address in $addresses; do
        [ "$address" = "$first" ] && continue
        redis-cli -h "${first%:*}" -p "${first##*:}" cluster meet "${address%:*}" "${address##*:}" >/dev/null
    done
fi

waited=0
until info | grep -q '^cluster_state:ok$'; do
    if [ "$waited" -ge "$wait_s" ]; then
        echo "the cluster is not ok after ${wait_s}s:" >&2
        info >&2
        exit 1
    fi
    sleep 1
    waited=$((waited + 1))
done
echo "cluster ok"
