# On the GPU host (nvidia-h200, one H200): issue 25's third-party target. timm's own tests
# on CUDA (TORCH_DEVICE=cuda), from a carried checkout of huggingface/pytorch-image-models:
# its timm package, tests and pyproject.toml (whose pytest settings apply) in
# .thirdparty/timm, which git ignores: carry it. Plain, then spawnrun fast mode with
# --spawn-gpu twice, pytest's cache kept; per-id outcomes compared with plain's.
#
# TIMM_SUITE=layers (default): tests/test_layers*.py, 146 short tests (test_layers.py asks
#   torch.cuda.is_available() while pytest collects).
# TIMM_SUITE=models: the suite the issue measured, test_models.py and test_layers.py:
#   TIMM_MODELS (40) ids of test_model_forward / test_model_backward taken evenly from
#   their collected list (GITHUB_ACTIONS=1: timm's CI list, without its biggest models),
#   and all of tests/test_layers.py.
# First the CUDA-context floor of this GPU (benchmarks/contexts.py; CONTEXTS=0: not), side by side.
# Output: $OUT/timm.txt, $OUT/timm.json, $OUT/timm_<suite>.tgz (logs and junit XMLs).
test -d .thirdparty/timm/tests || { echo "carry .thirdparty/timm"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site:$PWD/.thirdparty/timm PYTHONUNBUFFERED=1 TORCH_DEVICE=cuda || exit 1
python3 -c "import timm; print('timm', timm.__version__, timm.__file__)"
[ "${CONTEXTS:-1}" = 1 ] && timeout -k 5 60 python3 benchmarks/contexts.py -n 24 --at-once 1 8 2>&1 | tee $OUT/contexts.txt
paths="tests/test_layers.py tests/test_layers_drop.py tests/test_layers_pool.py"
if [ "${TIMM_SUITE:-layers}" = models ]; then
  export GITHUB_ACTIONS=1
  ids=$(cd .thirdparty/timm && timeout 120 python3 -m pytest --co -q -p no:spawnrun \
    -p no:cacheprovider tests/test_models.py -k "test_model_forward or test_model_backward" 2>/dev/null \
    | grep -E '::test_model_(forward|backward)\[' | awk -v n="${TIMM_MODELS:-40}" \
      '{ids[NR]=$0} END {step=NR/n; for (i=0; i<n; i++) print ids[int(i*step)+1]}')
  echo "$ids" | head -3; echo "$(echo "$ids" | wc -l) model ids"
  paths="$ids tests/test_layers.py"
fi
timeout -k 10 ${TIMM_LIMIT:-400} python3 benchmarks/thirdparty.py --root .thirdparty/timm \
  --run-timeout ${RUN_TIMEOUT:-120} --logs /tmp/timm_logs --out $OUT/timm.json \
  $paths "$@" 2>&1 | tee $OUT/timm.txt
cp .thirdparty/timm/*.xml /tmp/timm_logs/ 2>/dev/null
tar czf $OUT/timm_${TIMM_SUITE:-layers}.tgz -C /tmp timm_logs
