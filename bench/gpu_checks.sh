#!/usr/bin/env bash
# The GPU checks of issue #17 in one short run, for a machine with CUDA lent for minutes:
# the gpu-marked tests, memory decode against plain decode, longserve vs transformers'
# generate, and TTFT / decode for 8K, 128K and 1M-token documents through the HTTP API; and of
# issue #43: batched memory rows and int8 against float16 memory blocks (passkey, bytes per
# token) up to 1M tokens.
#
#   bash bench/gpu_checks.sh [SECONDS] [STEP...]   # budget (default 520); results under $OUT
#
# Needs longserve's dependencies and the embedded model importable (PYTHONPATH is fine).
# Each step gets what is left of the budget (capped per step) and writes $OUT/<step>.txt, so
# a run cut short still leaves every finished step's figures.
set -u
budget=${1:-520}
shift $(($# > 0 ? 1 : 0))
only=" $* "  # the steps to run; all of them when none is named
out=${OUT:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
deadline=$((SECONDS + budget))

log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$out/steps.txt"; }

step() {  # step NAME CAP COMMAND...: run with min(CAP, time left) seconds
    local name=$1 cap=$2 left=$((deadline - SECONDS))
    shift 2
    if [[ $only != "  " && $only != *" $name "* ]]; then
        return
    fi
    ((left < cap)) && cap=$left
    if ((cap < 20)); then
        log "skip $name (${left}s left)"
        return
    fi
    log "start $name (limit ${cap}s)"
    timeout "$cap" "$@" >"$out/$name.txt" 2>&1
    log "end $name rc=$?"
}

nvidia-smi -L | tee -a "$out/steps.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda',
torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', transformers.__version__)" \
    | tee -a "$out/steps.txt"

# the CPU kernels the tests compare against, built in the background while the GPU works
for stem in decode_attention memory_step; do
    python3 -c "from engine.runner.cpu_extensions import load_extension as l; print('$stem', l('$stem'))" &
done >"$out/extensions.txt" 2>&1

step peers 120 python3 -m bench.peers --device cuda --peers longserve transformers \
    --contexts 512 4096 8000 --rounds 2
step memory_speed 150 python3 -m bench.memory_speed --strategies segments tokens neurocache \
    --small 4096 --large 32768 --decode-rounds 3 --rounds 2
wait
step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/engine/test_cuda.py tests/engine/test_cuda_tiers.py tests/engine/test_memory_session.py
# the device machine's installed text holds about 6K tokens of docs (decision 078)
step memory_batch 90 python3 -m bench.memory_batch --rows 1 2 4 8 --memory-dtypes float16 int8 \
    --tokens 6000
step passkey_int8 120 python3 -m bench.passkey --lengths 131072 -n 4 --strategies segments \
    --memory-dtypes float16 int8
step passkey_1m 420 python3 -m bench.passkey --lengths 1048576 -n 2 --strategies segments \
    --memory-dtypes int8 float16
step long_docs 300 python3 -m bench.long_docs --device cuda --api completions \
    --lengths 8192 131072 1048576 --strategies segments --timeout 600
step long_docs_strategies 120 python3 -m bench.long_docs --device cuda --api completions \
    --lengths 8192 131072 --strategies tokens neurocache --seed 1
nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$out/steps.txt"
