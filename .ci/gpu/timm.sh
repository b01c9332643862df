# On the GPU host (nvidia-h200, one H200): issue 25's third-party target. timm's own layer
# tests (tests/test_layers*.py; test_layers.py asks torch.cuda.is_available() while pytest
# collects) on CUDA (TORCH_DEVICE=cuda), from a carried checkout of
# huggingface/pytorch-image-models: its timm package, tests and pyproject.toml (whose
# pytest settings apply) in .thirdparty/timm, which git ignores: carry it. Plain, then
# spawnrun fast mode with --spawn-gpu twice, pytest's cache kept; per-id outcomes
# compared with plain's. About 3 minutes.
# Output: $OUT/timm.txt, $OUT/timm.json, logs in $OUT/timm_logs.
test -d .thirdparty/timm/tests || { echo "carry .thirdparty/timm"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site:$PWD/.thirdparty/timm PYTHONUNBUFFERED=1 TORCH_DEVICE=cuda || exit 1
python3 -c "import timm; print('timm', timm.__version__, timm.__file__)"
timeout -k 10 ${TIMM_LIMIT:-400} python3 benchmarks/thirdparty.py --root .thirdparty/timm \
  --run-timeout ${RUN_TIMEOUT:-120} --logs $OUT/timm_logs --out $OUT/timm.json \
  tests/test_layers.py tests/test_layers_drop.py tests/test_layers_pool.py "$@" 2>&1 | tee $OUT/timm.txt
