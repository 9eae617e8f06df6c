#!/usr/bin/env bash
# What the tests need besides pip's packages, on a fresh Debian/Ubuntu machine (as root, no stdin; idempotent):
# - g++ (the host Adam's CPU kernel, ops/adam_cpu.cpp, is built on first use);
# - sshd (multi-node over real ssh on a loopback port), Open MPI and mpi4py (mpirun + MPI discovery), pdsh;
# - slurm and munge (the slurm launcher's tests start a private single-node cluster: munged, slurmctld and
#   slurmd with their own key, config and ports, and stop it; the packages' own services are not used);
# - real DeepSpeed, the reference for DeepSpeed semantics in the tests: 0.19.8 built from its source
#   distribution without ops (DS_BUILD_OPS=0), a test-only dependency that runs on the CPU (DS_ACCELERATOR=cpu).
set -euo pipefail

packages=(openssh-server openssh-client openmpi-bin libopenmpi-dev pdsh g++ munge slurmctld slurmd slurm-client)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    # The packages' services (sshd, munged, slurmctld, slurmd) are not to start: the tests start their own,
    # and slurmctld has no config. Debian's docker images deny them already (policy-rc.d, as here).
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
fi

python -c "import mpi4py" 2>/dev/null || python -m pip install -q mpi4py </dev/null

# sshd refuses to start without its privilege separation directory. The tests start their own sshd
# (own keys and config, 127.0.0.1, a free port) and stop it; nothing else global is needed.
mkdir -p /run/sshd
chmod 0755 /run/sshd

DEEPSPEED_VERSION=0.19.8
if ! python -c "import importlib.metadata as m; assert m.version('deepspeed') == '$DEEPSPEED_VERSION'" 2>/dev/null; then
    build=$(mktemp -d)
    python -m pip download -q --no-deps --no-binary :all: -d "$build" "deepspeed==$DEEPSPEED_VERSION" </dev/null
    tar -xzf "$build/deepspeed-$DEEPSPEED_VERSION.tar.gz" -C "$build"
    (cd "$build/deepspeed-$DEEPSPEED_VERSION" && DS_BUILD_OPS=0 python -m pip wheel -q --no-deps \
        --no-build-isolation -w "$build/wheel" . </dev/null)
    # its requirements (pydantic, hjson, ...) come from PyPI; torch stays the one already installed
    python -m pip install -q "$build/wheel/deepspeed-$DEEPSPEED_VERSION-py3-none-any.whl" </dev/null
    rm -rf "$build"
fi

