#!/usr/bin/env bash
# Everything to check on a GPU host, in one call, most important first:
#   1. the kernel checks and bandwidth tables (bench.internals.gpu_check),
#   2. every `gpu` test (fused kernels in bf16, CUDA graphs vs eager, no recapture, speculative
#      decoding's verification, n-gram and draft model, against graphed decoding, the
#      multi-LoRA shrink / expand kernels in bf16 and under graph capture, and LoRA rows on
#      CUDA against PEFT: that one needs the peft wheel, else it skips; the fp8 / int8 cache
#      writes rounding as torch does), on 4 xdist workers when pytest-xdist is installed,
#   3. the engine benchmark with CUDA graphs, graphs + async scheduling, eager, and HF static
#      batches (bench.internals.gpu_engine), then ours again over fp8 and int8 KV caches,
#   4. the newer families' kernels (sliding window, soft-cap, fused MoE:
#      bench.internals.gpu_check_families), and attention over bf16 / fp8 / int8 KV caches at
#      a batch-1 decode of 8k and 32k tokens (bench.internals.gpu_kv_quant),
#   5. speculation at batch 1 and 64 against graphed decoding (bench.spec_bench): n-gram and
#      draft-model drafts (verification graphs), then EAGLE-3, when the speculative fixture
#      and its heads were carried in models/spec-fixture (write them on the CPU first:
#      `python -m bench.spec_bench --eagle3 4 --eagle3-ceiling --batches 1`),
#   6. on a host with several GPUs, tensor parallelism over NCCL (bench.internals.tp_bench).
# Usage: `bash bench/gpu_session.sh` from anywhere; logs go to $OUT when set, else /tmp. A rerun
# can take some parts only: GPU_SESSION_PARTS="tests engine" (of: check tests engine kv_engine
# families kv_quant spec tp).
# A GPU host without network access gets the Python packages it lacks as wheel files: put
# them in $WHEELS_DIR (default .whl; a relative path is taken from the repository root) and
# they are installed into .site, put first on PYTHONPATH, before anything runs. Without that
# directory nothing is installed and the host's own packages are used.
# Each part has its own time limit, so one that hangs cannot take the others' results with it
# (a device call is cut at 600 s; the logs written so far still come back).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out="${OUT:-/tmp}"
wheels="${WHEELS_DIR:-.whl}"
if [ -d "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site "$wheels"/*.whl \
    || exit 1
  export PYTHONPATH="$PWD/.site"
fi
python3 -m pagedserve._protogen || exit 1
status=0
parts=" ${GPU_SESSION_PARTS:-check tests engine kv_engine families kv_quant spec tp} "
want() { [[ "$parts" == *" $1 "* ]]; }
# In order of what matters most, so that a call cut at its limit loses the least.
want check && { timeout 120 python3 -m bench.internals.gpu_check 2>&1 | tee "$out/gpu_check.log" \
  || status=1; }
workers=()  # the tests JIT-compile on the host's cores: spread them when xdist is there
python3 -c "import xdist" 2>/dev/null && workers=(-n 4 --dist loadfile)
# (a test module that cannot be imported for want of a wheel is an error in the log, and the
# other modules' gpu tests still run)
want tests && { timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider "${workers[@]}" \
  --continue-on-collection-errors tests 2>&1 | tee "$out/gpu_tests.log" || status=1; }
want engine && { timeout 240 python3 -m bench.internals.gpu_engine "$@" 2>&1 | grep -v '"event"' \
  | tee "$out/gpu_engine.log" || status=1; }
for kv in fp8 int8; do  # the quantized KV caches through the engine (their tok/s, not HF's)
  want kv_engine && { timeout 60 python3 -m bench.internals.gpu_engine --kv-cache-dtype "$kv" \
    --skip-hf --parity-requests 0 --no-profile 2>&1 | grep -v '"event"' \
    | tee "$out/gpu_engine_kv_$kv.log" || status=1; }
done
want families && { timeout 60 python3 -m bench.internals.gpu_check_families 2>&1 \
  | tee "$out/gpu_check_families.log" || status=1; }
want kv_quant && { timeout 45 python3 -m bench.internals.gpu_kv_quant 2>&1 \
  | tee "$out/gpu_kv_quant.log" || status=1; }
if want spec && [ -f models/spec-fixture/target/config.json ]; then
  for method in ngram draft; do  # verification graphs against graphed plain decoding
    extra=()
    [ "$method" = draft ] && extra=(--draft-model 4)
    # (one set per batch, as the earlier GPU figures; the 19 M target is grown there in seconds)
    timeout 60 python3 -m bench.spec_bench --device cuda --batches 1,64 --repeats 2 \
      --requests-per-batch 1 "${extra[@]}" \
      2>&1 | grep -v '"event"' | tee "$out/spec_bench_$method.log" || status=1
  done
fi
if want spec && [ -f models/spec-fixture/eagle3-workload/eagle3_fixture.json ]; then
  timeout 90 python3 -m bench.spec_bench --device cuda --eagle3 4 --eagle3-ceiling \
    --batches 1,64 --repeats 2 --requests-per-batch 1 2>&1 | grep -v '"event"' \
    | tee "$out/spec_bench_eagle3.log" || status=1
fi
num_gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if want tp && [ "$num_gpus" -ge 2 ]; then
  sizes=1,2
  [ "$num_gpus" -ge 4 ] && sizes=1,2,4
  timeout 300 python3 -m bench.internals.tp_bench --device cuda --sizes "$sizes" --hidden-size 4096 \
    --intermediate-size 14336 --num-heads 32 --num-layers 2 --batch 64 --prompt-len 512 \
    2>&1 | tee "$out/tp_bench.log" || status=1
fi
exit $status
