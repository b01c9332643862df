# On a GPU host: install spawnrun into /tmp/site, check JAX's own peak is readable, then
# measure issue 45's targets in one invocation of benchmarks/engines.py (an engine-shaped
# suite and a JAX suite: plain, then fast mode three times, pytest's cache kept).
# Output: $OUT/engines.txt, $OUT/engines.json, one log per run in $OUT/engines_logs.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
nvidia-smi -L
python3 -c "import jax, jax.numpy as jnp; x = jnp.ones((4096, 4096)); (x @ x).block_until_ready(); from spawnrun.proc import _probe; print('jax', jax.__version__, 'its own peak', _probe.jax_peak())" 2>&1 | tail -2
timeout -k 10 ${ENGINES_LIMIT:-420} python3 benchmarks/engines.py --run-timeout ${RUN_TIMEOUT:-90} \
  --logs $OUT/engines_logs --out $OUT/engines.json "$@" 2>&1 | tee $OUT/engines.txt
