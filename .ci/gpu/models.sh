# On the GPU host (nvidia-h200, one H200): the transformers half of examples/models
# (vllm is not in that image), with spawnrun installed from this tree, then the same
# device-filling pair in-process (--no-spawn) for contrast, then tests/gpu as a
# regression check of the GPU validation suite. Results land in $OUT.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
nvidia-smi -L
python3 -c "import torch, transformers, pytest; print('torch', torch.__version__, 'transformers', transformers.__version__, 'pytest', pytest.__version__)"
echo "=== models: spawned (default settings)"
/usr/bin/time -f "wall %e s" python3 -m pytest examples/models -v -rA --junitxml=$OUT/models.xml 2>&1 \
  | tee $OUT/models.txt | grep -v "^  File" | tail -40
echo "=== models: the device-filling pair in-process (--no-spawn), no cleanup code"
python3 -m pytest examples/models -v -k "fills_the_device" --no-spawn --junitxml=$OUT/models_nospawn.xml 2>&1 \
  | tee $OUT/models_nospawn.txt | grep -E "PASSED|FAILED|assert|free_gib|passed|failed" | tail -20
echo "=== tests/gpu"
python3 -m pytest -p no:cacheprovider tests/gpu -q 2>&1 | tail -5
