# On an NVIDIA GPU host (nvidia-h200, or -x2/-x4 for several GPUs): issue 17's check that
# a child sees exactly the device spawnrun assigned. A tiny suite under spawnrun, each test
# printing its CUDA_VISIBLE_DEVICES and torch.cuda.get_device_properties(i).uuid; then
# each test's assigned device (junitxml spawnrun_devices, mapped through nvidia-smi -L) is
# compared with the UUID torch saw in the child, one OK/FAIL line per test. Two runs: auto
# discovery (NVML or nvidia-smi -L: children get UUIDs) and an outer CUDA_VISIBLE_DEVICES=0
# given as an index under CUDA_DEVICE_ORDER=PCI_BUS_ID (handed on verbatim). Each pytest
# is capped at 120 s; about 1 minute.
# Output: $OUT/uuid_smi.txt, $OUT/uuid_<run>.txt (pytest), $OUT/uuid_<run>_check.txt.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
D=$(mktemp -d)
nvidia-smi -L | tee $OUT/uuid_smi.txt
python3 -c "import importlib.util as u, torch; print('torch', torch.__version__, 'pynvml', bool(u.find_spec('pynvml')))"
N=$(grep -c "^GPU " $OUT/uuid_smi.txt)

cat > $D/test_uuid.py <<'EOF'
import json, os, time
from pathlib import Path

import pytest

RECORDS = Path(os.environ["UUID_RECORDS"])
GPUS = int(os.environ["UUID_GPUS"])


def _record(name):
    import torch

    row = {
        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "uuids": [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())],
    }
    print(f"{name}: CUDA_VISIBLE_DEVICES={row['cvd']} torch uuids={row['uuids']}")
    (RECORDS / f"{name}.json").write_text(json.dumps(row))
    time.sleep(1.0)  # long enough for the tests on several GPUs to overlap


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(max(2, GPUS)))
def test_one(i):
    _record(f"test_one[{i}]")


@pytest.mark.gpu(count=2)
def test_two():
    _record("test_two")
EOF

cat > $D/check.py <<'EOF'
"""Each test's assigned device (spawnrun's junitxml) against the UUID torch saw in it."""
import json, re, sys, xml.etree.ElementTree as ET
from pathlib import Path

junit, records, smi = sys.argv[1:4]
uuid_of, gpu = {}, None
for line in Path(smi).read_text().splitlines():
    if m := re.match(r"^GPU (\d+):.*\(UUID: (GPU-[^)]+)\)", line):
        gpu, mig = m.group(1), 0
        uuid_of[gpu] = m.group(2)
    elif (m := re.match(r"^\s+MIG .*Device\s+(\d+): \(UUID: (MIG-[^)]+)\)", line)) and gpu:
        uuid_of[f"{gpu}:mig{m.group(1)}"] = m.group(2)


def norm(uuid):
    return re.sub(r"^(GPU|MIG)-", "", uuid.strip()).lower()


bad = checked = 0
for case in ET.parse(junit).getroot().iter("testcase"):
    name = case.get("name")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    record = Path(records) / f"{name}.json"
    if not record.exists():
        skipped = case.find("skipped") is not None
        print(f"{'SKIP' if skipped else 'FAIL'} {name}: no record (the test did not run)")
        bad += not skipped
        continue
    row = json.loads(record.read_text())
    labels = (props.get("spawnrun_devices") or "").split(",")
    # A label is nvidia-smi's index (or i:migj); a UUID given by the user names itself.
    assigned = [uuid_of.get(label, label) for label in labels]
    ok = [norm(a) for a in assigned] == [norm(u) for u in row["uuids"]]
    checked += 1
    bad += not ok
    print(
        f"{'OK' if ok else 'FAIL'} {name}: assigned [gpu {','.join(labels)}] = {assigned}; "
        f"child CUDA_VISIBLE_DEVICES={row['cvd']}; torch saw {row['uuids']}"
    )
print(f"uuid check: {checked} tests, {'OK' if checked and not bad else f'FAIL ({bad} wrong)'}")
sys.exit(1 if bad or not checked else 0)
EOF

status=0
for run in auto outer-index; do
  rm -rf $D/records && mkdir $D/records
  echo "=== $run"
  # The user's index is CUDA's; under PCI_BUS_ID it is nvidia-smi's too, which the check maps.
  if [ $run = outer-index ]; then export CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_ORDER=PCI_BUS_ID
  else unset CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER; fi
  UUID_RECORDS=$D/records UUID_GPUS=$N timeout -k 10 120 python3 -m pytest -p spawnrun.plugin \
    -p no:cacheprovider --rootdir $D $D/test_uuid.py -v -s -rs --junitxml=$D/$run.xml 2>&1 \
    | tee $OUT/uuid_$run.txt | grep -E "^spawnrun:|PASSED|FAILED|SKIPPED|ERROR|passed|failed"
  python3 $D/check.py $D/$run.xml $D/records $OUT/uuid_smi.txt | tee $OUT/uuid_${run}_check.txt
  [ ${PIPESTATUS[0]} -eq 0 ] || status=1
done
unset CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER
exit $status
