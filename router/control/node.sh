#!/bin/sh
# kvgrid's node commands for Ray's cluster launcher. cluster.yaml (AWS) and router/control/onprem.yaml (your own
# machines) both run exactly these, so what one launches is what the other does; only the provider differs.
#
#   node.sh setup                       install kvgrid from this checkout (skipped when KVGRID_INSTALLED is set)
#   node.sh start-head [RAY_OPTIONS]    Ray's head, then the head keeper: Redis (password, loopback and this
#                                       node's address only) and `kvgrid serve --address auto --redis ...`
#   node.sh start-worker [RAY_OPTIONS]  join the head ($RAY_HEAD_IP, set by the launcher)
#
# RAY_OPTIONS go to `ray start` (resources, CPU counts). The node's environment may set:
#   KVGRID_RAY_PORT (6379)        the head's GCS port, the same on every node
#   KVGRID_REDIS_PORT (6380)      kvgrid's Redis on the head
#   KVGRID_SERVE_CONFIG           the serve config (default: router/cluster-serve.yaml of this checkout)
#   KVGRID_NODE_IP                the address Ray announces for this node (default: the address the launcher
#                                 reached it on, from SSH_CONNECTION; else Ray's own choice)
#   KVGRID_RAY_START_ARGS         more `ray start` options for this node (ports, object store size, ...)
#   KVGRID_HEAD_LOST_S (60)       a worker's Ray stops this long after it lost the head (e.g. after `ray down`)
#   KVGRID_INSTALLED              kvgrid is already installed on this node's PATH: `setup` installs nothing
set -eu

cmd=${1:?usage: node.sh setup | start-head [ray start options] | start-worker [ray start options]}
shift
SRC=$(cd "$(dirname "$0")/../.." && pwd)
STATE="$HOME/.kvgrid"
RAY_PORT=${KVGRID_RAY_PORT:-6379}
# A node of a multi-node cluster: with this at 0 (the one-machine setting of kvgrid's tests and Makefile) Ray
# refuses to let a worker join its head.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
# Ray's workers (every kvgrid actor) at the default priority, not Ray's nice 15 (see worker/group.py init_local_ray).
export RAY_worker_niceness="${RAY_worker_niceness:-0}"
# CPU ranks' OpenMP threads sleep after each parallel region instead of spinning (see init_local_ray).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

node_ip() {
    if [ -n "${KVGRID_NODE_IP:-}" ]; then
        echo "$KVGRID_NODE_IP"
    elif [ -n "${SSH_CONNECTION:-}" ]; then
        # shellcheck disable=SC2086  # "client_ip client_port server_ip server_port"
        set -- $SSH_CONNECTION
        echo "$3"
    fi
}

# The Python kvgrid is installed in (its entry point's interpreter).
kvgrid_python() {
    head -n 1 "$(command -v kvgrid)" | sed 's/^#! *//'
}

case "$cmd" in
setup)
    if [ -n "${KVGRID_INSTALLED:-}" ]; then
        echo "kvgrid: KVGRID_INSTALLED is set, using $(command -v kvgrid)"
    else
        pip install -e "$SRC"
    fi
    ;;
start-head)
    ip=$(node_ip)
    mkdir -p "$STATE"
    # A previous head keeper stops its kvgrid serve and Redis first (a second `ray up`).
    if [ -s "$STATE/keeper.pid" ] && kill -0 "$(cat "$STATE/keeper.pid")" 2>/dev/null; then
        kill "$(cat "$STATE/keeper.pid")"
        while kill -0 "$(cat "$STATE/keeper.pid")" 2>/dev/null; do sleep 0.5; done
    fi
    ray stop
    # shellcheck disable=SC2086  # KVGRID_RAY_START_ARGS is a list of options
    ray start --head --port="$RAY_PORT" --dashboard-host=127.0.0.1 ${ip:+--node-ip-address="$ip"} \
        --autoscaling-config="$HOME/ray_bootstrap_config.yaml" ${KVGRID_RAY_START_ARGS:-} "$@"
    # The keeper lives as long as this node's Ray: `ray stop` (and so `ray down`) ends it, and it ends Redis and
    # kvgrid serve. Its own log: ~/.kvgrid/keeper.log; the service's: ~/kvgrid-serve.log.
    setsid nohup "$(kvgrid_python)" -m router.control.node head --node-ip "${ip:-127.0.0.1}" --ray-port "$RAY_PORT" \
        --redis-port "${KVGRID_REDIS_PORT:-6380}" --config "${KVGRID_SERVE_CONFIG:-$SRC/router/cluster-serve.yaml}" \
        >"$STATE/keeper.log" 2>&1 </dev/null &
    ;;
start-worker)
    ip=$(node_ip)
    ray stop
    # shellcheck disable=SC2086
    RAY_gcs_rpc_server_reconnect_timeout_s="${KVGRID_HEAD_LOST_S:-60}" \
        ray start --address="$RAY_HEAD_IP:$RAY_PORT" ${ip:+--node-ip-address="$ip"} ${KVGRID_RAY_START_ARGS:-} "$@"
    # Its keeper: `ray stop` once the raylet exited (Ray's log monitor would outlive it). Log: ~/.kvgrid/keeper.log
    if [ -n "$ip" ]; then
        mkdir -p "$STATE"
        setsid nohup "$(kvgrid_python)" -m router.control.node worker --node-ip "$ip" \
            >"$STATE/keeper.log" 2>&1 </dev/null &
    fi
    ;;
*)
    echo "node.sh: unknown command $cmd" >&2
    exit 2
    ;;
esac
