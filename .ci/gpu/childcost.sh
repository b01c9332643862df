# On the GPU host, on two of its cores without a GPU (as templates.sh): where a fast-mode
# child's own configuration and collection go there (the library template costs far
# more per test on that image than on the 2-core dev machine). Prints the image's pytest
# plugins, the slowest imports of a plain `pytest --co` of one file of trivial torch tests
# (-X importtime), and a library-template run's boot times. About a minute.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES= || exit 1
python3 -c "import importlib.metadata as m; print('pytest11:', sorted(e.value for e in m.entry_points(group='pytest11')))"
s=$(mktemp -d) && printf '[pytest]\nmarkers =\n    gpu: spawned\n' > $s/pytest.ini
for i in 0 1 2 3 4 5 6 7 8 9; do printf 'import torch\n\ndef test_t%s():\n    assert torch.ones(2).sum().item() == 2.0\n' $i >> $s/test_0.py; done
cd $s
for n in 1 2; do
  /usr/bin/time -f "plain --co: %e s" taskset -c 0,1 python3 -X importtime -m pytest -q -p no:cacheprovider -p no:spawnrun --co 2> $OUT/importtime_$n.txt >/dev/null
  tail -1 $OUT/importtime_$n.txt
done
echo "slowest imports (self us, cumulative us, module):"
grep "import time:" $OUT/importtime_2.txt | sort -t'|' -k2 -n -r | head -25
echo "torch-free configure+collect, cProfile top:"
taskset -c 0,1 python3 -m cProfile -s cumtime -m pytest -q -p no:cacheprovider -p no:spawnrun --co 2>&1 | head -45 | tail -35
for t in library file; do
  taskset -c 0,1 python3 -m pytest -q -p no:cacheprovider --spawn-method forkserver --spawn-gpu --spawn-template $t 2>&1 | tail -4
done
