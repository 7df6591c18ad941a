#!/usr/bin/env bash
# Download into .whl-peer/ (git-ignored through .git/info/exclude) every wheel the peer suites need on
# the GPU machine beyond what its image has (torch, numpy, pyarrow, pandas, typer, rich, pyyaml): for
# its python3 (CPython 3.12, x86-64 Linux), the versions this repo's CPU runs use. gpu.sh installs them.
# Also copies the suites (ZERORUN_PEER_SUITES, default ../shared/peer-suites) into .peer-suites/
# (git-ignored too), which gpu.sh reads: the GPU machine does not get ../shared.
#   bash scripts/peer_suites/wheels.sh [PIP]        (PIP default: .venv/bin/pip; needs the package index)
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP="${1:-.venv/bin/pip}"
PYVER="${PEER_PYTHON_VERSION:-3.12}"
DEST="${PEER_WHEELS:-.whl-peer}"
grep -qx '/.whl-peer/' .git/info/exclude 2>/dev/null || echo '/.whl-peer/' >>.git/info/exclude
grep -qx '/.peer-suites/' .git/info/exclude 2>/dev/null || echo '/.peer-suites/' >>.git/info/exclude
PACKAGES=(
  # the suites and the libraries under test
  transformers==5.24.0 accelerate==1.15.0 datasets==5.2.0 parameterized==0.9.0
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4
  # transformers / accelerate / huggingface_hub
  huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 regex==2026.11.19 hf-xet==1.8.0 tqdm==4.70.1
  psutil==7.2.2 filelock==4.3.1 fsspec==2026.9.0 click==8.5.1 typing_extensions==4.16.0
  httpx2==2.16.2 httpcore2==2.16.2 anyio==4.16.0 idna==3.20 h11==0.16.0 truststore==0.10.5
  certifi==2026.10.19.post1
  # datasets (beside the image's pyarrow and pandas)
  dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
  # zerorun's own configuration
  pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5
)
mkdir -p "$DEST"
"$PIP" download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
  --platform manylinux1_x86_64 -d "$DEST" "${PACKAGES[@]}" 2>&1 | grep -v '^WARNING: Location' || true
count=$(ls "$DEST"/*.whl | wc -l)
[[ "$count" -eq "${#PACKAGES[@]}" ]] || { echo "wheels.sh: $count wheels in $DEST for ${#PACKAGES[@]} packages"; exit 1; }
echo "$count wheels in $DEST ($(du -sh "$DEST" | cut -f1))"
SRC="${ZERORUN_PEER_SUITES:-../shared/peer-suites}"
if [[ -d "$SRC/transformers" && -d "$SRC/accelerate" ]]; then
  rm -rf .peer-suites && cp -r "$SRC" .peer-suites && chmod -R u+w .peer-suites
  echo "suites copied from $SRC into .peer-suites ($(du -sh .peer-suites | cut -f1))"
else
  echo "wheels.sh: no suites at $SRC (set ZERORUN_PEER_SUITES); .peer-suites not updated"
fi
