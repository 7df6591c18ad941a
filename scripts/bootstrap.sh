#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with CPU-or-CUDA torch and zerorun installed.
# `--system` also installs what the multi-node tests need (openssh-server, iproute2, Slurm's
# slurmctld/slurmd/slurm-client, munge and openmpi-bin; root only) and a C compiler (gcc).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--system" ]]; then
  need=()
  [[ -x /usr/sbin/sshd ]] || need+=(openssh-server)
  command -v ip >/dev/null || need+=(iproute2)
  command -v ssh-keygen >/dev/null || need+=(openssh-client)
  # A C compiler with OpenMP for the one-pass CPU Adam kernel (runtime/offload/cpu_kernel.py).
  command -v cc >/dev/null || need+=(gcc libc6-dev)
  # A real Slurm and Open MPI for the cluster tests (daemons started by the tests themselves).
  for pkg in slurmctld slurmd slurm-client munge openmpi-bin; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if ((${#need[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
      echo "bootstrap: need root to install ${need[*]} (multi-node tests)" >&2
      exit 1
    fi
    echo "bootstrap: installing ${need[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi

PY=${PYTHON:-python3}
# A venv without pip is one whose creation was interrupted: make it again.
if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  rm -rf .venv
  "$PY" -m venv .venv
fi
# torch first, pinned to the release our CI machines carry as a local CPU wheel (pip finds it
# there before any index); on other Linux machines this is PyPI's default (CUDA) build. A bare
# `torch` requirement from pyproject would otherwise pull whatever build is newest.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" numpy
fi
stamp=.venv/.zerorun-installed
if [[ ! -f $stamp ]] || [[ pyproject.toml -nt $stamp ]]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
  touch "$stamp"
fi
