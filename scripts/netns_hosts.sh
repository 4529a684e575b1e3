#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces joined by a veth pair, each with its own address,
# so multi-node launches (torchrun --nnodes=2, the legacy launcher) go over a real network link
# between separate network stacks instead of one loopback.
#
#   bash scripts/netns_hosts.sh up      # cbhost0 = 10.77.0.1 (veth cb0), cbhost1 = 10.77.0.2 (veth cb1)
#   bash scripts/netns_hosts.sh down    # safe to call when they do not exist
#   ip netns exec cbhost0 env GLOO_SOCKET_IFNAME=cb0 torchrun --nnodes=2 --node-rank=0 \
#       --master-addr=10.77.0.1 --master-port=29500 --nproc-per-node=1 distributed.py ...
#   ip netns exec cbhost1 env GLOO_SOCKET_IFNAME=cb1 torchrun --nnodes=2 --node-rank=1 \
#       --master-addr=10.77.0.1 --master-port=29500 --nproc-per-node=1 distributed.py ...
#
# GLOO_SOCKET_IFNAME: gloo advertises the address the host name resolves to, and on many machines
# (this one included) that is 127.0.0.1, so the other host would connect to its own loopback
# ("Gloo connectFullMesh failed ... Connection refused"). Naming the interface makes it advertise
# the veth address. Needs root (CAP_NET_ADMIN).
set -euo pipefail
PATH=$PATH:/usr/sbin:/sbin

HOSTS=(cbhost0 cbhost1)
IFACES=(cb0 cb1)
ADDRS=(10.77.0.1 10.77.0.2)

die() { echo "netns_hosts.sh: error: $*" >&2; exit 1; }

down() {
    local ns
    for ns in "${HOSTS[@]}"; do
        ip netns del "$ns" 2>/dev/null || true  # deleting a namespace deletes its end of the veth pair
    done
}

up() {
    command -v ip >/dev/null || die "the 'ip' command is missing: apt-get install iproute2"
    down
    ip netns add "${HOSTS[0]}" 2>/dev/null || die "cannot create network namespaces (needs root and CAP_NET_ADMIN)"
    ip netns add "${HOSTS[1]}"
    ip link add "${IFACES[0]}" netns "${HOSTS[0]}" type veth peer name "${IFACES[1]}" netns "${HOSTS[1]}" \
        || die "cannot create the veth pair (is the veth kernel module available?)"
    local i
    for i in 0 1; do
        ip -n "${HOSTS[i]}" addr add "${ADDRS[i]}/24" dev "${IFACES[i]}"
        ip -n "${HOSTS[i]}" link set "${IFACES[i]}" up
        ip -n "${HOSTS[i]}" link set lo up  # torchrun's agents and workers also talk over the local loopback
    done
    for i in 0 1; do
        ip -n "${HOSTS[i]}" link show "${IFACES[i]}" | grep -q "state UP" || die "${IFACES[i]} in ${HOSTS[i]} is not up"
    done
    echo "netns_hosts.sh: ${HOSTS[0]} ${ADDRS[0]} (${IFACES[0]}) <-> ${HOSTS[1]} ${ADDRS[1]} (${IFACES[1]})"
}

case ${1:-} in
    up) up ;;
    down) down ;;
    *) echo "usage: bash scripts/netns_hosts.sh up|down" >&2; exit 2 ;;
esac
