# On the GPU host (nvidia-h200, one H200): install spawnrun and pytest-forked (carried
# wheel) into /tmp/site, then measure targets (a) and (b) in one invocation: 12 trivial
# CUDA tests with a clean conftest and with one that runs torch.zeros(1, device="cuda")
# at import, under plain pytest, pytest-forked, spawnrun default (no pins) and spawnrun
# fast (forkserver). pytest there is 9.1 (pytest-forked works). About 8 minutes at most:
# no repetition starts that would end past the deadline, and one pytest run is capped.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
python3 -c "import pytest, pytest_forked, spawnrun, torch; print('pytest', pytest.__version__, 'torch', torch.__version__)"
python3 benchmarks/speed.py --gpu -n ${N:-12} -r ${R:-3} --suites ${SUITES:-cuda-trivial cuda-at-import} \
  --deadline ${DEADLINE:-420} --run-timeout 200 --logs $OUT/speed_logs 2>&1 | tee $OUT/speed_gpu.txt
