# On the GPU host, as on CI's 2-core machine (taskset -c 0,1, no GPU visible): issue 16's
# CPU targets. 40 trivial torch tests, in files of 10 and one per file, under plain
# pytest, pytest-forked (carried wheel), spawnrun fast (its files' tests forked from a
# template that collected them), fast with --spawn-template library (each child collects
# its file), and fast with --spawn-scope module. About 2 minutes with R=2.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
export CUDA_VISIBLE_DEVICES=
for per in ${PER:-10 1}; do
  taskset -c 0,1 python3 benchmarks/speed.py -n 40 --per-file $per -r ${R:-2} --suites trivial \
    --modes plain pytest-forked "spawnrun fast" "spawnrun fast, library template" \
    "spawnrun fast, run template" "spawnrun fast, scope module" --deadline ${DEADLINE:-80} --run-timeout 60 2>&1 \
    | tee $OUT/cpu_per_file_$per.txt
done
