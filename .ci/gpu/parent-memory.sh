# Only gpu-marked tests, no deliberate CUDA init in the parent: sample nvidia-smi's
# compute apps while the run goes, and count rows that belong to the pytest parent.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPAWNRUN_GPU_PARENT_INIT=0
python3 -m pytest -p spawnrun.plugin -p no:cacheprovider tests/gpu -m gpu -v > $OUT/run4_marked_only.txt 2>&1 &
P=$!; echo "parent pid $P"
while kill -0 $P 2>/dev/null; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; sleep 0.2; done > $OUT/run4_smi.txt
tail -2 $OUT/run4_marked_only.txt; echo "samples: $(wc -l < $OUT/run4_smi.txt); rows with parent pid $P: $(grep -c "^$P," $OUT/run4_smi.txt)"; sort $OUT/run4_smi.txt | uniq -c
