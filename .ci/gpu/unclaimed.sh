#!/bin/bash
# On the GPU host: tests/gpu twice in one directory with pytest's cache kept. Its conftest
# calls torch.cuda.is_available() in every child (a boot that initializes the driver):
# the first run learns that, the second boots children unclaimed, bound to the device
# they saw. Each run capped at CAP seconds. Output: $OUT/unclaimed.txt.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTEST_ADDOPTS="-p spawnrun.plugin"
CAP=${CAP:-100}
for run in 1 2; do
  start=$(date +%s.%N)
  timeout -k 5 "$CAP" python3 -m pytest tests/gpu -q -rs -p no:randomly > "$OUT/unclaimed-$run.log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  printf 'run %s rc=%s %.1f s  %s\n' "$run" "$rc" "$(awk "BEGIN{print $end - $start}")" \
    "$(grep -E '[0-9]+ (passed|failed)' "$OUT/unclaimed-$run.log" | tail -1)" | tee -a "$OUT/unclaimed.txt"
done
python3 -c "import json; print(json.load(open('.pytest_cache/v/spawnrun/boots')))" 2>&1 | tee -a "$OUT/unclaimed.txt"
