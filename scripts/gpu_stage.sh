#!/usr/bin/env bash
# Run HERE, on a machine that reaches the package index, before scripts/gpu_check.sh runs on a lent GPU
# machine that reaches none. Stages into .gpu/ (git-ignored; the device tool's `carry` takes it along)
# what the check needs beyond that machine's own torch / triton / transformers, within its 64 MiB carry:
#   .gpu/wheels/  this package's runtime dependencies that the machine lacks (msgspec), for Python 3.12;
#   .gpu/site/mamba_ssm/  mamba-ssm's Triton SSD kernels (the training scan), unmodified source files from
#       its sdist; its CUDA extensions are not built (no compiler time, no index there), so the package's
#       __init__, which imports them, is replaced by one that imports nothing - what
#       MAMBA_SKIP_CUDA_BUILD=TRUE installs, minus that import;
#   .gpu/site/sglang/  SGLang's Triton selective_state_update (the serving scan): its module file unmodified,
#       under package stubs. SGLang's 39 MB wheel does not fit beside this repo's checkpoint, and its package
#       __init__s import the whole server (pydantic, zmq, ...), which that machine lacks. The kernel imports
#       one helper, is_arch_support_pdl, from SGLang's JIT utilities: a stub computes it as SGLang does.
# gpu_check.sh installs the wheels into a temporary folder and puts .gpu/site on PYTHONPATH. Its serving-path
# checks need nothing more: HSpecDraftModel's seven SGLang imports (a result dataclass, marker classes, heads
# its forward never calls) get stand-ins in scripts/gpu_check.py `_import_draft_model` under these package
# stubs; transformers and safetensors (config.json, model.safetensors) are the machine's own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MAMBA_SSM_VERSION=${MAMBA_SSM_VERSION:-2.3.2.post1}
SGLANG_VERSION=0.5.23  # pyproject.toml's `sglang` extra
rm -rf .gpu.tmp && mkdir -p .gpu.tmp/wheels .gpu.tmp/site
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gpu/' >> .git/info/exclude; }
grep -qx '/.gpu.tmp/' .git/info/exclude || echo '/.gpu.tmp/' >> .git/info/exclude

echo "gpu_stage: wheels for Python 3.12 (manylinux x86-64)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu.tmp/wheels "msgspec>=0.18" 2>&1 | grep -v "WARNING: Location" || true
ls .gpu.tmp/wheels/msgspec-*.whl >/dev/null

echo "gpu_stage: mamba-ssm $MAMBA_SSM_VERSION Triton kernels"
tmp=$(mktemp -d)
"$PY" - "$MAMBA_SSM_VERSION" "$tmp" <<'EOF'
import re, sys, tarfile, urllib.request
version, tmp = sys.argv[1], sys.argv[2]
name = f"mamba_ssm-{version}.tar.gz"  # the sdist, from the simple index (PEP 503), which is what pip reads
page = urllib.request.urlopen("https://pypi.org/simple/mamba-ssm/", timeout=60).read().decode()
url = next(u for u in re.findall(r'href="([^"#]+)', page) if u.endswith("/" + name))
path = f"{tmp}/{name}"
urllib.request.urlretrieve(url, path)
with tarfile.open(path) as tar:
    tar.extractall(tmp, filter="data")
EOF
src=$(ls -d "$tmp"/mamba_ssm-*/mamba_ssm)
mkdir -p .gpu.tmp/site/mamba_ssm/ops/triton .gpu.tmp/site/mamba_ssm/utils
cp "$src"/ops/triton/*.py .gpu.tmp/site/mamba_ssm/ops/triton/
cp "$src"/utils/torch.py "$src"/utils/determinism.py .gpu.tmp/site/mamba_ssm/utils/
touch .gpu.tmp/site/mamba_ssm/ops/__init__.py .gpu.tmp/site/mamba_ssm/utils/__init__.py
printf '__version__ = "%s"  # Triton kernels only (scripts/gpu_stage.sh)\n' "$MAMBA_SSM_VERSION" \
  > .gpu.tmp/site/mamba_ssm/__init__.py

echo "gpu_stage: SGLang $SGLANG_VERSION's Triton selective_state_update"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 -d "$tmp" "sglang==$SGLANG_VERSION" 2>&1 | grep -v "WARNING: Location" || true
(cd .gpu.tmp/site && unzip -q "$tmp"/sglang-*.whl sglang/kernels/ops/mamba/triton_ops/mamba_ssm.py)
for pkg in sglang sglang/kernels sglang/kernels/ops sglang/kernels/ops/mamba sglang/kernels/ops/mamba/triton_ops \
           sglang/kernels/jit; do
  mkdir -p ".gpu.tmp/site/$pkg"
  echo "\"\"\"Package stub (scripts/gpu_stage.sh): SGLang $SGLANG_VERSION's Mamba kernel module alone.\"\"\"" \
    > ".gpu.tmp/site/$pkg/__init__.py"
done
cat > .gpu.tmp/site/sglang/kernels/jit/utils.py <<'EOF'
"""The one name SGLang's mamba_ssm.py imports from sglang.kernels.jit.utils (scripts/gpu_stage.sh): whether
the GPU supports programmatic dependent launch, decided as SGLang decides it (CUDA compute capability >= 9,
never on ROCm), without SGLang's JIT toolchain behind it."""
import functools

import torch


@functools.cache
def is_arch_support_pdl() -> bool:
    return torch.version.hip is None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
EOF
rm -rf "$tmp" .gpu && mv .gpu.tmp .gpu
du -sh .gpu
