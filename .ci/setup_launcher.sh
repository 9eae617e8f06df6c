#!/usr/bin/env bash
# What the launcher tests need on a fresh machine: sshd (multi-node over real ssh on a loopback port),
# Open MPI and mpi4py (mpirun + MPI discovery), pdsh (the pdsh runner). Idempotent; run as root, no stdin.
set -euo pipefail

packages=(openssh-server openssh-client openmpi-bin libopenmpi-dev pdsh)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
fi

python -c "import mpi4py" 2>/dev/null || python -m pip install -q mpi4py </dev/null

# sshd refuses to start without its privilege separation directory. The tests start their own sshd
# (own keys and config, 127.0.0.1, a free port) and stop it; nothing else global is needed.
mkdir -p /run/sshd
chmod 0755 /run/sshd
