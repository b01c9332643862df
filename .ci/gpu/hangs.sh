# On the GPU host (nvidia-h200): the shapes that hung, with real CUDA work, each run twice
# in one directory (the first run records the peaks that --spawn-pack auto learns from):
# case 1 (budgets, exclusive tests, bare tests with learned budgets, one more exclusive)
# in fast mode and in the default mode; two modules pytest interleaves under
# --spawn-scope module; a fork that leaves a thread; case 1 under pytest-xdist (-n 4).
# Every pytest is capped at CAP
# seconds (a hang shows as "rc=124"). Output: $OUT/hangs.txt.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
CAP=${CAP:-150}
root=$(mktemp -d)
mkdir -p "$root/case1" "$root/scopes" "$root/thread"
cat > "$root/case1/test_mixed.py" <<'PY'
import time

import pytest
import torch


def work(seconds, gib=0.5):
    held = torch.empty(int(gib * 2**30) // 4, device="cuda")
    a = torch.randn(2048, 2048, device="cuda")
    end = time.time() + seconds
    while time.time() < end:
        a @ a
    torch.cuda.synchronize()
    del held


@pytest.mark.gpu(memory="3GiB")
@pytest.mark.parametrize("i", range(10))
def test_budget(i):
    work(0.1 + 0.05 * i)


@pytest.mark.gpu(exclusive=True)
@pytest.mark.parametrize("i", range(3))
def test_exclusive(i):
    work(0.2)


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(2))
def test_bare(i):
    work(0.3)


@pytest.mark.gpu(exclusive=True)
def test_last_exclusive():
    work(0.2)
PY
cat > "$root/scopes/conftest.py" <<'PY'
def pytest_collection_modifyitems(items):
    a = [i for i in items if i.module.__name__ == "test_a"]
    b = [i for i in items if i.module.__name__ == "test_b"]
    items[:] = [x for pair in zip(a, b) for x in pair]
PY
for m in a b; do cat > "$root/scopes/test_$m.py" <<PY
import pytest
import torch


@pytest.fixture(scope="module")
def weights():
    return torch.randn(4096, 4096, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(3))
def test_$m(weights, i):
    assert (weights @ weights).isfinite().all()
PY
done
cat > "$root/thread/test_thread.py" <<'PY'
import threading
import time

import pytest
import torch


@pytest.mark.gpu
def test_leaves_a_thread():
    torch.ones(1, device="cuda")
    threading.Thread(target=time.sleep, args=(300,)).start()


@pytest.mark.gpu
def test_next():
    assert torch.ones(1, device="cuda").item() == 1
PY
run() {  # name dir args...
  local name=$1 dir=$2; shift 2
  local start=$(date +%s.%N)
  (cd "$dir" && timeout -k 5 "$CAP" python3 -m pytest -q -p no:randomly "$@" > "$OUT/$name.log" 2>&1)
  local rc=$?
  local end=$(date +%s.%N)
  printf '%-34s rc=%-3s %6.6s s  %s\n' "$name" "$rc" "$(awk "BEGIN{print $end - $start}")" \
    "$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/$name.log" | tail -1)" | tee -a "$OUT/hangs.txt"
}
nvidia-smi -L | tee "$OUT/hangs.txt"
run case1-plain "$root/case1" --no-spawn
run case1-fast-auto-1 "$root/case1" --spawn-method forkserver --spawn-pack auto
run case1-fast-auto-2 "$root/case1" --spawn-method forkserver --spawn-pack auto
run case1-fast-auto-3 "$root/case1" --spawn-method forkserver --spawn-pack auto
run case1-default-auto-2 "$root/case1" --spawn-pack auto
# xdist workers share the GPU through the ledger (Peers, Denied): one H200, four workers.
run case1-xdist4-auto "$root/case1" -n 4 --spawn-pack auto
run case1-xdist4-fast-auto "$root/case1" -n 4 --spawn-method forkserver --spawn-pack auto
run scopes-interleaved "$root/scopes" -p no:cacheprovider --spawn-scope module
run scopes-interleaved-fast "$root/scopes" -p no:cacheprovider --spawn-scope module --spawn-method forkserver
run thread-fast "$root/thread" -p no:cacheprovider --spawn-method forkserver --spawn-jobs 1 -rw
grep -h "spawnrun\|packing\|Warning\|did not exit" "$OUT"/case1-fast-auto-2.log "$OUT"/thread-fast.log | head -20 >> "$OUT/hangs.txt"
