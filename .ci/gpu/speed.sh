# On the GPU host: install spawnrun and pytest-forked (carried wheel) into /tmp/site,
# then run the speed benchmark's CUDA suites. pytest there is 9.1 (pytest-forked works).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
python3 -c "import pytest, pytest_forked, spawnrun; print('pytest', pytest.__version__)"
python3 benchmarks/speed.py --gpu -n ${N:-10} -r ${R:-2} --suites cuda-trivial cuda-work-0.5s 2>&1 | tee $OUT/speed_gpu.txt
