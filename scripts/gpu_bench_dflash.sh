#!/bin/sh
# On the device machine: issue 13's benchmarks of a DFlash drafter (results in $OUT/dflash-bench.tar.gz when OUT set).
#   sh scripts/gpu_bench_dflash.sh MODEL.gguf DRAFTER [TARGET_NAME]
# MODEL.gguf: the target rebuilt there (scripts/chunks.py); DRAFTER: its DFlash drafter (a path without .safetensors);
# TARGET_NAME: its registry name (default qwen2.5-coder-1.5b: the shape of the verify-cost rows). Every step writes
# into /root/dflash-bench/<step> and resumes there while the machine stays warm (each `bench spec` run continues its
# spec.jsonl); run it detached (`OUT= setsid nohup sh scripts/gpu_bench_dflash.sh ... &`), read
# /root/dflash-bench/log, then once more with OUT set to bring the results back:
#   he-t0-b1 / he-t1-b1 / he-t0-b4   HumanEval's 164 problems: T = 0 and 1 at batch 1, T = 0 at batch 4
#   he-t0-b1-inv                     he-t0-b1 with --row-invariant (decode and verify round alike: greedy output
#                                    identical in bf16 too; plain and speculative both with the row-invariant kernels)
#   chat-t0-b1                       held-out code and text chat prompts (N_CHAT of each kind), T = 0 and 1
#   tau                              bench/tau_estimate.py: training's held-out τ estimates against the loop's τ
#                                    (N_TAU held-out prompts each of code and text)
#   verify                           bench/verify_cost.py: decode, 16-wide verify and a LAYERS-layer drafter's steps
#                                    in the target's shape and in Llama-3.1-8B's (random weights, compiled graphs)
#   project                          bench/project_dflash.py: the 8B row projected from those and he-t0-b1's τ
# Environment: NEW (128 new tokens), N_HE (164), N_CHAT (32), N_TAU (16), LAYERS (3), ROOT (/root/dflash-bench).
model=$1; drafter=$2; name=${3:-qwen2.5-coder-1.5b}
[ -n "$model" ] && [ -n "$drafter" ] || { echo "usage: gpu_bench_dflash.sh MODEL DRAFTER [TARGET_NAME]"; exit 2; }
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
root=${ROOT:-/root/dflash-bench}
mkdir -p $root
. scripts/steps.sh
spec() {  # spec STEP OPTIONS...
  run=$1; shift
  step $run python3 -m sparsespec bench spec --target "$model" --target-name $name --drafters dflash:"$drafter" \
    --max-new-tokens ${NEW:-128} --block-size 16 --device cuda --compile --out $root/$run "$@"
}
spec he-t0-b1 --kinds humaneval --prompts ${N_HE:-164} --batch 1 --temperatures 0
spec he-t1-b1 --kinds humaneval --prompts ${N_HE:-164} --batch 1 --temperatures 1
spec he-t0-b4 --kinds humaneval --prompts ${N_HE:-164} --batch 4 --temperatures 0
spec he-t0-b1-inv --kinds humaneval --prompts ${N_HE:-164} --batch 1 --temperatures 0 --row-invariant
spec chat-t0-b1 --kinds code,text --prompts ${N_CHAT:-32} --batch 1 --temperatures 0,1
mkdir -p $root/tau
step tau python3 bench/tau_estimate.py --target "$model" --drafter "$drafter" --kinds code,text \
  --prompts ${N_TAU:-16} --max-new-tokens ${NEW:-128} --device cuda --out $root/tau/tau.json
step verify python3 bench/verify_cost.py --models llama-3.1-8b,$name --widths 1,16 --drafters ${LAYERS:-3} \
  --out $root/verify
step project python3 bench/project_dflash.py --spec $root/he-t0-b1/spec.jsonl --verify $root/verify/verify_cost.json \
  --layers ${LAYERS:-3}
tail -30 $root/log
[ -n "$OUT" ] || exit 0
cd $root && tar czf $OUT/dflash-bench.tar.gz log */spec.jsonl */spec.md */spec.settings.json verify/verify_cost.json \
  tau/tau.json 2>/dev/null; ls -la $OUT
