#!/usr/bin/env bash
# Run `zoa-train bench comm` on two ranks joined by an emulated network link instead of loopback.
#
#   sudo PYTHON=$(command -v python) scripts/shaped_link.sh RATE [bench comm options...]
#   sudo scripts/shaped_link.sh 1gbit --sizes 16M,64M --json
#
# Each rank runs in its own network namespace; the two are joined by a veth pair whose both ends
# are shaped to RATE (a tc rate such as 100mbit, 1gbit, 10gbit) by a token-bucket filter, so every
# byte between the ranks crosses a link of that speed. The ranks are started by torchrun (one node
# each, static rendezvous) with one CPU thread each. Needs root and iproute2 (ip, tc). Namespaces
# and links are removed on exit. PYTHON is the interpreter that has zoa-train installed (default: python).
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 RATE [zoa-train bench comm options...]   (RATE as tc writes it: 100mbit, 1gbit, 10gbit)" >&2
    exit 2
fi
rate=$1
shift
if [[ $(id -u) -ne 0 ]]; then
    echo "$0 needs root to create network namespaces." >&2
    exit 2
fi
for tool in ip tc; do
    command -v "$tool" >/dev/null || { echo "$0 needs $tool (Debian package iproute2)." >&2; exit 2; }
done

python=${PYTHON:-$(command -v python)}
prefix="zoa-link-$$"
port=$((20000 + $$ % 20000))
address=(10.231.0.1 10.231.0.2)

cleanup() {
    for rank in 0 1; do ip netns del "$prefix-$rank" 2>/dev/null || true; done
}
trap cleanup EXIT

for rank in 0 1; do
    ip netns add "$prefix-$rank"
    ip -n "$prefix-$rank" link set lo up
done
ip link add zoa-l0 netns "$prefix-0" type veth peer name zoa-l1 netns "$prefix-1"
for rank in 0 1; do
    ns="$prefix-$rank"
    ip -n "$ns" addr add "${address[$rank]}/24" dev "zoa-l$rank"
    ip -n "$ns" link set "zoa-l$rank" up
    # burst: enough for the rate's tick; latency bounds the queue (packets beyond it are held back).
    ip netns exec "$ns" tc qdisc add dev "zoa-l$rank" root tbf rate "$rate" burst 1mb latency 100ms
done

pids=()
for rank in 0 1; do
    ip netns exec "$prefix-$rank" env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME="zoa-l$rank" \
        "$python" -m torch.distributed.run --nnodes 2 --node-rank "$rank" --nproc-per-node 1 \
        --master-addr "${address[0]}" --master-port "$port" \
        -m zoa_train.cli bench comm --backend gloo "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
exit $status
