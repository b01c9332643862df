#!/usr/bin/env bash
# Issue 56 on a GPU: a test that outgrew its learned budget runs out of memory under
# torch's cap (real CUDA words) and runs again alone, shown; a failure of its own on a
# guessed budget runs once; DataLoader workers in a spawned test against plain pytest.
# Usage (device machine, repository root): bash .ci/gpu/once.sh; logs under $OUT.
set -u
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
suite=$(mktemp -d); cd "$suite"
cat > test_grow.py <<'PY'
import os, torch, pytest

def test_grows():
    gib = 3 if os.environ.get("GROW") else 0.25
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    del x

def test_own_failure():
    torch.ones(1, device="cuda")
    assert os.environ.get("GROW") is None, "a failure of its own"

@pytest.mark.parametrize("i", range(4))
def test_small(i):
    torch.ones(1024, device="cuda").sum().item()
PY
args="-p no:randomly -v --spawn-gpu --junitxml=j.xml"
timeout 240 python3 -m pytest $args > "$out/run1.log" 2>&1; echo "run1 rc=$?" | tee -a "$out/summary.txt"
GROW=1 timeout 240 python3 -m pytest $args -rA > "$out/run2.log" 2>&1; echo "run2 rc=$?" | tee -a "$out/summary.txt"
cp j.xml "$out/run2.xml"
grep -E "RERUN|PASSED|FAILED|ran again|out of memory|passed|failed" "$out/run2.log" | cut -c1-300 | tee -a "$out/summary.txt"
cd - > /dev/null
timeout 300 python3 benchmarks/dataloader.py --runs 3 --workers 4 2>&1 | tee "$out/dataloader.txt"
