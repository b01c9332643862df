# On a host with 2 GPUs: verbose scheduled run (devices per test, NCCL all-reduce),
# the speedup benchmark, and the same busy tests under pytest-xdist -n 2.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTEST_ADDOPTS="-p spawnrun.plugin"
nvidia-smi -L
python3 -m pytest -p no:cacheprovider tests/gpu/test_scheduling_gpu.py -v -rA 2>&1 | tee $OUT/sched_verbose.txt | grep -E "spawnrun:|PASSED|FAILED|ERROR|passed|failed|Error" | head -40
python3 benchmarks/gpu_scheduling.py 2>&1 | tee $OUT/bench.txt
SPAWNRUN_GPU_PARENT_INIT=0 python3 -m pytest -p no:cacheprovider -p no:benchmark tests/gpu/test_scheduling_gpu.py -n 2 -v 2>&1 | tee $OUT/sched_xdist.txt | tail -16
