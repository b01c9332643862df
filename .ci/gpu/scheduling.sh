# On a host with 2 GPUs (nvidia-h200-x2): target (d), then the verbose scheduled run of
# tests/gpu (devices per test, NCCL all-reduce) and the same busy tests under
# pytest-xdist -n 2. Each step is capped so the whole stays under about 9 minutes
# (expected: 4-5).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTEST_ADDOPTS="-p spawnrun.plugin"
nvidia-smi -L
# A conftest that calls torch.cuda.is_available() at import, default settings (booting
# ahead on): wrong-device tests, overlapping pairs on one UUID, count=0 violations, and
# the speedup of 8 busy tests on all GPUs over --spawn-jobs 1.
timeout 360 python3 benchmarks/gpu_scheduling.py --run-timeout 110 --logs $OUT/sched_logs 2>&1 | tee $OUT/bench.txt
timeout 100 python3 -m pytest -p no:cacheprovider tests/gpu/test_scheduling_gpu.py -v -rA 2>&1 | tee $OUT/sched_verbose.txt | grep -E "spawnrun:|PASSED|FAILED|ERROR|passed|failed|Error" | head -40
SPAWNRUN_GPU_PARENT_INIT=0 timeout 100 python3 -m pytest -p no:cacheprovider -p no:benchmark tests/gpu/test_scheduling_gpu.py -n 2 -v 2>&1 | tee $OUT/sched_xdist.txt | tail -16
