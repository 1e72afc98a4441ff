#!/bin/sh
# What the tests need from a fresh Debian machine besides Python packages, installed as root:
# network namespaces, NAT and link caps (iproute2, nftables, iptables), added latency (the NFQUEUE
# headers NetfilterQueue builds against), and a Docker engine, compose and debootstrap for the
# compose check (tests/test_compose.py). Starts dockerd when none answers. Safe to run twice.
set -eu
if [ "$(id -u)" != 0 ]; then
    echo "error: run as root: the tests build network namespaces and start a Docker engine" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends iproute2 nftables iptables libnetfilter-queue-dev \
    docker.io docker-compose debootstrap >/dev/null
if ! docker info >/dev/null 2>&1; then
    (dockerd >/tmp/lioncub-dockerd.log 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { echo "error: dockerd did not start; see /tmp/lioncub-dockerd.log" >&2; exit 1; }
fi
