# A/B on one H200: the previous release (2288d37) against the current tree, alternating,
# default mode on the trivial CUDA suite, 3 rounds each. Prepare the old tree first:
#   mkdir .ab-old && git archive 2288d37 spawnrun pyproject.toml README.md | tar -x -C .ab-old
# and carry .ab-old and .whl to the device.
set -u
for v in old new; do
  src=.; [ $v = old ] && src=.ab-old
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_$v .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_$v $src || exit 1
done
export PYTHONUNBUFFERED=1
for r in 1 2 3; do
  for v in old new; do
    echo "== round $r: $v"
    PYTHONPATH=/tmp/site_$v timeout 150 python3 benchmarks/speed.py --gpu -n 12 -r 1 --suites cuda-trivial --modes "spawnrun default" 2>&1 | grep -E "^  (plain|pytest-forked|spawnrun default) .*(ms|-) " | head -3
  done
done
