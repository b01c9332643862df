# On the GPU host (nvidia-h200, one H200): install spawnrun (and, from a carried .whl,
# pytest-forked) into /tmp/site, then measure issue 14's targets in one invocation of
# benchmarks/packing.py: 64 tests of 0.3 s of matmuls with gpu(memory="2GiB") under plain
# pytest, -n 8, spawnrun default and fast mode (packed); the same tests unbudgeted under
# --spawn-pack auto (learning run, then the measured one, each mode in a fresh cache); 12
# exclusive trivial tests (plain, pytest-forked, fast); the 60% leak case; budget overruns
# from stamps and NVML. About 5-6 minutes when the targets are met: no run starts after
# DEADLINE s, one pytest run is capped at RUN_TIMEOUT s (and at DEADLINE + 60 s), the whole
# at 480 s. Output: $OUT/packing.txt, $OUT/packing.json, one log per run in $OUT/packing_logs.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
nvidia-smi -L
python3 -c "import pytest, spawnrun, torch; print('pytest', pytest.__version__, 'torch', torch.__version__)"
python3 -c "import importlib.util as u; print(*(f'{m}: {bool(u.find_spec(m))}' for m in ('xdist', 'pytest_forked', 'pynvml')))"
timeout -k 10 480 python3 benchmarks/packing.py --deadline ${DEADLINE:-330} --run-timeout ${RUN_TIMEOUT:-110} \
  --logs $OUT/packing_logs --out $OUT/packing.json "$@" 2>&1 | tee $OUT/packing.txt
