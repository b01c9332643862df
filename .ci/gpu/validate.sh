export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch,pytest;print('torch',torch.__version__,'pytest',pytest.__version__,'gpus',torch.cuda.device_count())"
echo "=== run 1: conftest initializes CUDA in the parent"
python3 -m pytest -p spawnrun.plugin -p no:cacheprovider tests/gpu -v -rA 2>&1 | tee $OUT/run1_basic.txt | grep -v "^  File"
echo "=== run 2: no CUDA init in the parent; sample nvidia-smi compute apps during the run"
SPAWNRUN_GPU_PARENT_INIT=0 python3 -m pytest -p spawnrun.plugin -p no:cacheprovider tests/gpu -v > $OUT/run2_noinit.txt 2>&1 &
P=$!; echo "parent pid $P"
while kill -0 $P 2>/dev/null; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; sleep 0.2; done > $OUT/run2_smi.txt
tail -3 $OUT/run2_noinit.txt; echo "samples: $(wc -l < $OUT/run2_smi.txt); rows with parent pid $P: $(grep -c "^$P," $OUT/run2_smi.txt)"; sort -u -t, -k1,1 $OUT/run2_smi.txt | head
echo "=== run 3: crash demo"
SPAWNRUN_GPU_CRASH_DEMO=1 python3 -m pytest -p spawnrun.plugin -p no:cacheprovider tests/gpu/test_cuda_crashes.py -v -rA 2>&1 | tee $OUT/run3_crashes.txt | grep -v "site-packages\|pluggy" | head -150
