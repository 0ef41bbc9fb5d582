#!/usr/bin/env bash
# bench/netns.sh: several "hosts" on one machine, for measuring ccl across a
# rate-limited network. Needs root (ip netns, tc).
#
# Creates N network namespaces (ccl-h0 .. ccl-h{N-1}), each with one interface
# eth0 (10.77.0.{i+1}/24) joined by a veth pair to a bridge that lives in its
# own namespace (ccl-sw, the "switch"), so the host's own network is never
# touched. Every link is shaped by `tc tbf` in both directions: on the host's
# eth0 (what it sends) and on the switch port (what it receives), like a
# full-duplex NIC of the given rate. Then it runs COMMAND once in each
# namespace, as one rank of a torchrun-style job: RANK, WORLD_SIZE,
# LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR=10.77.0.1 (namespace 0),
# MASTER_PORT, CCL_SOCKET_IFNAME=eth0 and CCL_HOST_ID=ccl-h{i} are set, the
# hostname is ccl-h{i} (a UTS namespace of its own), and each output line is
# prefixed with "[i] ". Everything is removed on exit,
# whether COMMAND succeeds, fails or is interrupted.
#
#   sudo bench/netns.sh [options] -- COMMAND [ARGS...]
#
# Options:
#   -n N           namespaces (ranks)                       [4]
#   -r RATE        tc rate of every link, both directions   [1gbit]
#   -b BURST       tbf burst (bucket size)                  [256kb]
#   -l LATENCY     tbf latency (queue length in time)       [50ms]
#   -m MTU         MTU of the links                         [1500]
#   -L PERCENT     drop this share of the packets each host receives, at
#                  random (nftables on its eth0 ingress; e.g. 0.5). As with
#                  tc netem, a packet is a kernel buffer: with segmentation
#                  offload, up to 64 KB of TCP or a batch of QUIC datagrams,
#                  lost or kept whole                                 [0]
#   -1             hosts send one wire packet per buffer (no segmentation
#                  offload), so -L drops that share of wire packets; costs
#                  far more CPU per byte (TCP: 25% of a 1 Gbit/s line on
#                  2 cores, with 4 hosts)
#   -D DELAY       delay every packet between hosts once, in ms (e.g. 20):
#                  tc netem on what each host sends where the kernel has
#                  netem, else ccl-netdelay on what each host receives
#                  (a delay line on NFQUEUE; needs iptables)          [none]
#   -B PATH        the ccl-netdelay binary, for -D without netem
#                  (cargo build --release -p ccl-tests --bin ccl-netdelay)
#                                               [target/release/ccl-netdelay]
#   -p PORT        MASTER_PORT                              [29500]
#   -t SECONDS     kill the ranks after this long           [600]
#   -k             keep the namespaces after COMMAND (and skip it if none
#                  given); remove them later with: bench/netns.sh -d
#   -d             only remove namespaces left by an earlier -k run
#
# Example: ring allreduce of 64 MiB over TCP across 4 hosts at 1 Gbit/s
#   cargo build --release -p ccl-bench
#   sudo CCL_ALGO=ring bench/netns.sh -n 4 -r 1gbit -- \
#       target/release/ccl-bench allreduce --size 64MB --transport tcp
# (each namespace is a separate host, so the pairs talk TCP through eth0.)

set -euo pipefail

N=4
RATE=1gbit
BURST=256kb
LATENCY=50ms
MTU=1500
LOSS=0
DELAY=
DELAY_TEXT=
NETDELAY=target/release/ccl-netdelay
ONE=0
PORT=29500
TIMEOUT=600
KEEP=0
PREFIX=ccl-h
SWITCH=ccl-sw
SUBNET=10.77.0

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
    exit "${1:-2}"
}

cleanup() {
    local i
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
        case "$ns" in
        "$SWITCH" | "$PREFIX"[0-9]*) ip netns del "$ns" 2>/dev/null || true ;;
        esac
    done
}

DELETE=0
while getopts "n:r:b:l:m:L:D:B:p:t:1kdh" opt; do
    case "$opt" in
    n) N=$OPTARG ;;
    r) RATE=$OPTARG ;;
    b) BURST=$OPTARG ;;
    l) LATENCY=$OPTARG ;;
    m) MTU=$OPTARG ;;
    L) LOSS=$OPTARG ;;
    D) DELAY=${OPTARG%ms} ;;
    B) NETDELAY=$OPTARG ;;
    1) ONE=1 ;;
    p) PORT=$OPTARG ;;
    t) TIMEOUT=$OPTARG ;;
    k) KEEP=1 ;;
    d) DELETE=1 ;;
    h) usage 0 ;;
    *) usage 2 ;;
    esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift

if [ "$(id -u)" -ne 0 ]; then
    echo "netns.sh: needs root (ip netns, tc)" >&2
    exit 2
fi
if [ "$DELETE" = 1 ]; then
    cleanup
    exit 0
fi
if ! [[ "$N" =~ ^[0-9]+$ ]] || [ "$N" -lt 1 ] || [ "$N" -gt 200 ]; then
    echo "netns.sh: -n must be 1..200" >&2
    exit 2
fi
if [ $# -eq 0 ] && [ "$KEEP" = 0 ]; then
    echo "netns.sh: no command given (or -k to only set up)" >&2
    usage 2
fi
if ! awk -v p="$LOSS" 'BEGIN { exit !(p >= 0 && p <= 100) }'; then
    echo "netns.sh: -L must be a percentage (0..100)" >&2
    exit 2
fi
if [ -n "$DELAY" ] && ! awk -v d="$DELAY" 'BEGIN { exit !(d ~ /^[0-9.]+$/ && d <= 10000) }'; then
    echo "netns.sh: -D must be a delay in ms (0..10000)" >&2
    exit 2
fi
if [ "$LOSS" != 0 ] && ! command -v nft >/dev/null; then
    echo "netns.sh: -L needs nft (nftables)" >&2
    exit 2
fi
if ip netns list | awk '{print $1}' | grep -qx "$SWITCH"; then
    echo "netns.sh: namespace $SWITCH exists (an earlier run with -k?); remove with: $0 -d" >&2
    exit 1
fi

PIDS=()
DELAY_LINES=()
# The delay lines print what they held when told to stop.
stop_delay_lines() {
    for pid in "${DELAY_LINES[@]:-}"; do
        [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
    done
    DELAY_LINES=()
}
on_exit() {
    local code=$?
    for pid in "${PIDS[@]:-}"; do
        [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null || true
    done
    stop_delay_lines
    if [ "$KEEP" = 0 ]; then
        cleanup
    fi
    exit "$code"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

shape() { # namespace device
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$RATE" burst "$BURST" latency "$LATENCY"
}

# Sending with a delay: netem holds the packets, then the tbf below it
# limits the rate. Fails where the kernel has no netem.
netem_delay() { # namespace device
    ip netns exec "$1" tc qdisc replace dev "$2" root handle 1: netem delay "${DELAY}ms" limit 100000 &&
        ip netns exec "$1" tc qdisc add dev "$2" parent 1:1 handle 10: tbf rate "$RATE" burst "$BURST" latency "$LATENCY"
}

# Receiving with a delay, without netem: ccl-netdelay holds what arrives on
# the device for DELAY ms (after the switch's tbf), then lets it through.
line_delay() { # namespace device
    local log
    log=$(mktemp)
    ip netns exec "$1" "$NETDELAY" --queue 0 --delay-ms "$DELAY" \
        > >(tee "$log" | sed -u "/^ready/d; s/^/netns.sh: $1: ccl-netdelay: /" >&2) 2>&1 &
    DELAY_LINES+=($!)
    for _ in $(seq 100); do
        grep -q '^ready' "$log" && break
        kill -0 "${DELAY_LINES[-1]}" 2>/dev/null || break
        sleep 0.05
    done
    if ! grep -q '^ready' "$log"; then
        echo "netns.sh: -D: $NETDELAY did not start: $(cat "$log")" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
    ip netns exec "$1" iptables -A INPUT -i "$2" -j NFQUEUE --queue-num 0
}

# Random loss of what a host receives: 1 in 100000 per 0.001 %.
lose() { # namespace device
    local per100k
    per100k=$(awk -v p="$LOSS" 'BEGIN { printf "%d", p * 1000 + 0.5 }')
    ip netns exec "$1" nft add table netdev ccl_loss
    ip netns exec "$1" nft add chain netdev ccl_loss ingress "{ type filter hook ingress device \"$2\" priority 0; }"
    ip netns exec "$1" nft add rule netdev ccl_loss ingress numgen random mod 100000 lt "$per100k" counter drop
}

ip netns add "$SWITCH"
ip netns exec "$SWITCH" ip link set lo up
ip netns exec "$SWITCH" ip link add br0 type bridge
ip netns exec "$SWITCH" ip link set br0 up
for ((i = 0; i < N; i++)); do
    ns=$PREFIX$i
    ip netns add "$ns"
    ip netns exec "$ns" ip link set lo up
    ip link add "ccl-p$i" netns "$SWITCH" mtu "$MTU" type veth peer name eth0 netns "$ns" mtu "$MTU"
    ip netns exec "$SWITCH" ip link set "ccl-p$i" master br0 up
    ip netns exec "$ns" ip addr add "$SUBNET.$((i + 1))/24" dev eth0
    # -1: one packet per buffer, as on a wire (see the option).
    [ "$ONE" = 1 ] && ip netns exec "$ns" ip link set dev eth0 gso_max_segs 1
    ip netns exec "$ns" ip link set eth0 up
    if [ -z "$DELAY" ] || ! netem_delay "$ns" eth0 2>/dev/null; then
        shape "$ns" eth0 # what host i sends
        if [ -n "$DELAY" ]; then
            line_delay "$ns" eth0 || exit 2
            DELAY_TEXT="$DELAY ms (ccl-netdelay)"
        fi
    else
        DELAY_TEXT="$DELAY ms (netem)"
    fi
    [ "$LOSS" != 0 ] && lose "$ns" eth0
    shape "$SWITCH" "ccl-p$i" # what host i receives
done
echo "netns.sh: $N namespaces ${PREFIX}0..${PREFIX}$((N - 1)) ($SUBNET.1-$N), links $RATE (tbf burst $BURST latency $LATENCY), mtu $MTU$([ "$ONE" = 1 ] && echo ' (one packet per buffer)'), loss ${LOSS}%, delay ${DELAY_TEXT:-none}" >&2
# Wait until the bridge forwards (ports leave the listening state at once with STP off).
for ((i = 1; i < N; i++)); do
    for _ in $(seq 50); do
        ip netns exec "${PREFIX}$i" ping -c1 -W1 "$SUBNET.1" >/dev/null 2>&1 && break
        sleep 0.1
    done
done

if [ $# -eq 0 ]; then
    echo "netns.sh: kept; run commands with: ip netns exec ${PREFIX}I ...; remove with: $0 -d" >&2
    exit 0
fi

for ((i = 0; i < N; i++)); do
    ip netns exec "$PREFIX$i" env RANK=$i WORLD_SIZE="$N" LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
        GROUP_RANK=$i MASTER_ADDR="$SUBNET.1" MASTER_PORT="$PORT" CCL_SOCKET_IFNAME=eth0 \
        CCL_HOST_ID="$PREFIX$i" timeout -s KILL "$TIMEOUT" \
        unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "$PREFIX$i" "$@" \
        > >(sed -u "s/^/[$i] /") 2> >(sed -u "s/^/[$i] /" >&2) &
    PIDS+=($!)
done
code=0
for pid in "${PIDS[@]}"; do
    wait "$pid" || code=$?
done
PIDS=()
stop_delay_lines
wait # the output filters
exit "$code"
