# On the GPU host (nvidia-h200, one H200): install spawnrun into /tmp/site, then measure
# issue 16's target in one invocation of benchmarks/scopes.py: 4 modules x 8 tests, each
# module with a scope="module" fixture building a ~100M-parameter Llama on the GPU, each
# test an 8-token greedy generate: plain pytest, pytest -n 4 (spawnrun off), spawnrun
# --spawn-scope module in default and fast mode, and --spawn-scope test in fast mode
# (capped at TEST_SCOPE_TIMEOUT s). About 4 minutes. Output: $OUT/scopes.txt, .json, logs.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
timeout -k 10 420 python3 benchmarks/scopes.py --run-timeout ${RUN_TIMEOUT:-120} \
  --test-scope-timeout ${TEST_SCOPE_TIMEOUT:-80} --logs $OUT/scopes_logs --out $OUT/scopes.json \
  "$@" 2>&1 | tee $OUT/scopes.txt
