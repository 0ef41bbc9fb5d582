#!/usr/bin/env bash
# bench/quic-vs-tcp.sh: ccl's TCP and QUIC links side by side across N
# simulated hosts (bench/netns.sh) on a rate-limited, lossy network. Needs
# root. Runs a ring allreduce through each variant in turn, ROUNDS times
# (interleaved, so machine noise hits all alike), and prints rank 0's figures
# with the bus bandwidth as a share of the line rate.
#
#   sudo bench/quic-vs-tcp.sh [options]
#
# Options:
#   -n N         hosts (ranks)                                   [4]
#   -r RATE      link rate, tc syntax                            [1gbit]
#   -m MTU       MTU of the links                                [1500]
#   -L PERCENT   packets lost at random                          [0.5]
#   -D DELAY     delay of every packet, ms (netem or ccl-netdelay) [none]
#   -1           one wire packet per buffer (see bench/netns.sh -1)
#   -s SIZE      allreduce size                                  [64MB]
#   -i ITERS     timed iterations per run                        [5]
#   -R ROUNDS    rounds of every variant                         [2]
#   -v LIST      variants, transport[:congestion controller]     ["tcp quic"]
#   -b PATH      ccl-bench binary               [target/release/ccl-bench]
#   -B PATH      ccl-netdelay binary, for -D    [target/release/ccl-netdelay]
#
# Example (what the README quotes):
#   cargo build --release -p ccl-bench -p ccl-tests --bin ccl-bench --bin ccl-netdelay
#   sudo bench/quic-vs-tcp.sh -n 4 -r 1gbit -L 0.5 -D 20 -v "tcp quic quic:cubic"

set -euo pipefail
cd "$(dirname "$0")/.."

N=4
RATE=1gbit
MTU=1500
LOSS=0.5
DELAY=
SIZE=64MB
ITERS=5
ROUNDS=2
VARIANTS="tcp quic"
BENCH=target/release/ccl-bench
NETDELAY=target/release/ccl-netdelay
ONE=0
while getopts "n:r:m:L:D:s:i:R:v:b:B:1h" opt; do
    case "$opt" in
    n) N=$OPTARG ;;
    r) RATE=$OPTARG ;;
    m) MTU=$OPTARG ;;
    L) LOSS=$OPTARG ;;
    D) DELAY=$OPTARG ;;
    s) SIZE=$OPTARG ;;
    i) ITERS=$OPTARG ;;
    R) ROUNDS=$OPTARG ;;
    v) VARIANTS=$OPTARG ;;
    b) BENCH=$OPTARG ;;
    B) NETDELAY=$OPTARG ;;
    1) ONE=1 ;;
    h) sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) exit 2 ;;
    esac
done
[ -x "$BENCH" ] || { echo "quic-vs-tcp.sh: no $BENCH (cargo build --release -p ccl-bench)" >&2; exit 2; }

# Line rate in GB/s, from tc's rate syntax (kbit, mbit, gbit).
line=$(awk -v r="$RATE" 'BEGIN {
    n = r + 0; u = tolower(substr(r, length(n "") + 1))
    m = (u == "kbit") ? 1e3 : (u == "mbit") ? 1e6 : (u == "gbit") ? 1e9 : 1
    printf "%.6f", n * m / 8 / 1e9 }')
netns=(bench/netns.sh -n "$N" -r "$RATE" -m "$MTU" -L "$LOSS" -t 900)
[ -n "$DELAY" ] && netns+=(-D "$DELAY" -B "$NETDELAY")
[ "$ONE" = 1 ] && netns+=(-1)

delay_text=none
[ -n "$DELAY" ] && delay_text="${DELAY%ms} ms"
echo "# ring allreduce of $SIZE, $N hosts, links $RATE (${line} GB/s), MTU $MTU$([ "$ONE" = 1 ] && echo ' (one packet per buffer)'), loss ${LOSS}%, delay $delay_text"
printf "# %-5s  %-12s  %12s  %9s  %6s\n" round variant "time (us)" "busbw" "% line"
failed=0
for ((round = 1; round <= ROUNDS; round++)); do
    for v in $VARIANTS; do
        transport=${v%%:*}
        cc=
        [ "$v" != "$transport" ] && cc=${v#*:}
        out=$(env ${cc:+CCL_QUIC_CC=$cc} CCL_ALGO=ring "${netns[@]}" -- \
            "$BENCH" allreduce --size "$SIZE" --transport "$transport" -n "$ITERS" -w 1 --check 2>&1) || {
            # Recorded, and the other variants still run; the script fails at the end.
            reason=$(echo "$out" | grep -m1 -o 'timed out after [0-9a-z]*' || echo "see its output")
            printf "  %-5s  %-12s  failed: %s\n" "$round" "$v" "$reason"
            echo "quic-vs-tcp.sh: $v failed:" >&2
            echo "$out" | tail -20 >&2
            failed=1
            continue
        }
        # Rank 0's result line: size count type redop root algo time algbw busbw wrong.
        row=$(echo "$out" | awk '$1 == "[0]" && $2 ~ /^[0-9]+$/ { print $8, $10, $11; exit }')
        [ -n "$row" ] || { echo "quic-vs-tcp.sh: no result from $v:" >&2; echo "$out" | tail -20 >&2; exit 1; }
        read -r time busbw wrong <<<"$row"
        [ "$wrong" = 0 ] || { echo "quic-vs-tcp.sh: $v: $wrong wrong values" >&2; exit 1; }
        printf "  %-5s  %-12s  %12s  %9s  %5.0f%%\n" "$round" "$v" "$time" "$busbw" \
            "$(awk -v b="$busbw" -v l="$line" 'BEGIN { print 100 * b / l }')"
    done
done
exit "$failed"
