#!/usr/bin/env bash
# The GPU checks of issues 16 (item 6) and 18 (item 5), and the CUDA smoke checks of training,
# generation and the CUDA-marked tests, as one script for a lent GPU machine (whose time is short):
#
#     OUT=/tmp/gpu bash benchmarks/gpu_session.sh
#
# Each part runs under its own time limit and writes its output to $OUT as it goes, so a part that
# fails or runs long costs only itself (at most 8 files come back: eight logs). Packages the GPU image lacks (the server's: fastapi, uvicorn,
# pydantic, openai) travel as wheels in .whl/ when present. docs/benchmarks.md records the figures.
set -u
OUT=${OUT:-/tmp/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/benchmarks"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
mkdir -p /tmp/bin  # the `shardwise` command without installing the package (timeout runs programs, not functions)
printf '#!/bin/sh\nexec python3 -c "from shardwise.cli.main import main; main()" "$@"\n' > /tmp/bin/shardwise
chmod +x /tmp/bin/shardwise
export PATH="/tmp/bin:$PATH"

part() {  # part NAME SECONDS COMMAND...: one check, its output in $OUT/NAME.log (PARTS="a b": only those)
    local name=$1 limit=$2; shift 2
    [[ -z "${PARTS:-}" || " $PARTS " == *" $name "* ]] || return 0
    local start=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - start))s"
    tail -n 40 "$OUT/$name.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/machine.log"

part pytest_cuda 120 python3 -m pytest -q -p no:cacheprovider tests/train/test_validation_and_profile.py \
    tests/models/test_chunked_loss.py tests/planner/test_loss_memory.py -k cuda
part attention 90 python3 benchmarks/attention_kernels.py
part step_1b_b8 330 python3 benchmarks/compile_speed.py step --device cuda --autocast bfloat16 --preset llama3-1b \
    --batch 8 --seq-len 2048 --steps 10 --profile \
    --models ${STEP_MODELS:-shardwise_compiled,shardwise_compiled_torch_attention_order,transformers_compiled}
part rmsnorm 100 python3 benchmarks/compile_speed.py rmsnorm --device cuda --dtype bfloat16 --repeats 50
part step_1b 280 python3 benchmarks/compile_speed.py step --device cuda --autocast bfloat16 --preset llama3-1b \
    --batch 4 --seq-len 2048 --steps 10 \
    --models shardwise_compiled,transformers_eager,transformers_compiled,shardwise_eager
part serve_1b 260 python3 benchmarks/serve.py --device cuda --dtype bfloat16 --preset llama3-1b --clients 32 \
    --requests-per-client 1 --new-tokens 128 --capacity 512 --repeats 3 --skip-one-by-one
part train_demo 90 shardwise train --train.device cuda --train.autocast_dtype bfloat16 --train.compile true \
    --train.steps 60 --run.dir /tmp/run_demo --train.sample_tokens 0
part generate_demo 45 shardwise generate --run /tmp/run_demo --device cuda --temperature 0 --max-new-tokens 32
part engine 150 python3 benchmarks/gpu_engine.py
# Issue 40, item 5: float8 vs bf16 training, 200 steps of the 1B step's shapes, then of the 3B (the largest Llama
# whose AdamW state fits one 80 GB GPU); only when named (PARTS="float8_1b float8_3b"): each is 3 runs of 2-3 minutes
[[ " ${PARTS:-} " == *" float8_1b "* ]] && part float8_1b 560 python3 benchmarks/float8.py --preset llama3-1b --steps 200 --batch 8 --seq-len 2048 --out "$OUT/float8"
[[ " ${PARTS:-} " == *" float8_3b "* ]] && part float8_3b 560 python3 benchmarks/float8.py --preset llama3-3b --steps 200 \
    --batch 4 --seq-len 2048 --out "$OUT/float8_3b"
