#!/bin/sh
# Starts one node of ops/sentinel/compose.yml: `start.sh redis` (a data node) or `start.sh sentinel`, then more
# options of redis-server if any.
#
# The node's configuration is copied from the example (redis.conf.example, sentinel.conf.example) into its data
# folder the first time only: Redis and Sentinel rewrite that file when a failover changes who replicates whom and
# which server is the primary, so a restarted node resumes the current roles, not the example's. The passwords are
# the environment's at every start. Environment:
#   ANNOUNCE          the name this node is reached by (its compose service name); required
#   REPLICAOF         a data node's first primary, "host port" (the replica's, at its first start only)
#   REDIS_PASSWORD    the Redis servers' password; empty: none
#   SENTINEL_PASSWORD the sentinels' own password; empty: none
#   EXAMPLES (/etc/embedq-redis), DATA (/data), REDIS_SERVER (redis-server), PORT, BIND: where things are and how
#   the node listens (tests/test_ops_sentinel.py runs this script on loopback ports)
set -eu
kind=${1:?usage: start.sh redis|sentinel [redis-server options]}
shift
examples=${EXAMPLES:-/etc/embedq-redis}
data=${DATA:-/data}
server=${REDIS_SERVER:-redis-server}
name=${ANNOUNCE:?set ANNOUNCE to the name this node is reached by}
password=${REDIS_PASSWORD:-}
# No protected mode: the nodes are reachable only on the compose network (no port is published).
listen="--protected-mode no${PORT:+ --port $PORT}${BIND:+ --bind $BIND}"

case $kind in
redis)
  conf=$data/redis.conf
  if [ ! -f "$conf" ]; then
    {
      cat "$examples/redis.conf.example"
      echo "replica-announce-ip $name"
      [ -z "${REPLICAOF:-}" ] || echo "replicaof $REPLICAOF"
    } >"$conf.new"
    mv "$conf.new" "$conf"
  fi
  exec "$server" "$conf" --dir "$data" $listen --requirepass "$password" --masterauth "$password" "$@"
  ;;
sentinel)
  conf=$data/sentinel.conf
  if [ ! -f "$conf" ]; then
    { cat "$examples/sentinel.conf.example"; echo "sentinel announce-ip $name"; } >"$conf.new"
    mv "$conf.new" "$conf"
  fi
  master=$(sed -n 's/^sentinel monitor \([^ ]*\) .*/\1/p' "$conf" | head -n 1)
  # This start's passwords in place of the last one's (after the monitor line, which auth-pass refers to).
  sed -i -e '/^requirepass /d' -e '/^user default /d' -e '/^sentinel auth-pass /d' "$conf"
  [ -z "${SENTINEL_PASSWORD:-}" ] || echo "requirepass $SENTINEL_PASSWORD" >>"$conf"
  [ -z "$password" ] || echo "sentinel auth-pass $master $password" >>"$conf"
  exec "$server" "$conf" --sentinel --dir "$data" $listen "$@"
  ;;
*)
  echo "start.sh: unknown node kind $kind (redis or sentinel)" >&2
  exit 2
  ;;
esac
