# One call on the GPU host (nvidia-h200): the real CUDA suite in both start methods
# (the conftest initializes CUDA in the parent and in every child at import), then the
# speed targets (speed.sh). Keeps the session's device time to one machine start.
export PYTHONUNBUFFERED=1
nvidia-smi -L
for method in spawn forkserver; do
  echo "=== tests/gpu, --spawn-method $method"
  PYTHONPATH=$PWD timeout 150 python3 -m pytest -p spawnrun.plugin -p no:cacheprovider tests/gpu \
    -v -rA --spawn-method $method 2>&1 | tee $OUT/gpu_$method.txt | grep -E "PASSED|FAILED|ERROR|passed|failed|booted|Warning" | head -30
done
N=${N:-12} R=${R:-2} DEADLINE=${DEADLINE:-330} bash .ci/gpu/speed.sh
