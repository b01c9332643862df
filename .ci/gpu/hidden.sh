#!/bin/bash
# Whether a child booted with every device hidden can tell that its boot touched CUDA.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
for val in "" "-1"; do
 for call in "torch.cuda.is_available()" "torch.cuda.device_count()" "torch.zeros(1).cuda() if torch.cuda.is_available() else None" "None"; do
  for nvml in 0 1; do
   CUDA_VISIBLE_DEVICES="$val" PYTORCH_NVML_BASED_CUDA_CHECK=$([ $nvml = 1 ] && echo 1) python -c "
import torch
from spawnrun.proc import _probe
r = $call
print(repr('$val'), 'nvml=$nvml', '$call'[:28].ljust(28), 'result', r, '| driver', _probe.cuda_driver_initialized(), '| runtime', repr(_probe.device_runtime()))
" 2>&1 | tail -1
  done
 done
done
python -c "import torch; print(torch.__version__)"
