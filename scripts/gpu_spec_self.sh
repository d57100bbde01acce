#!/bin/sh
# On the device machine: issue 15's self-speculation benchmark with real weights (results under $OUT).
#   sh scripts/gpu_spec_self.sh MODEL.gguf [DRAFTER ...]
# MODEL.gguf: qwen2.5-coder-1.5b rebuilt there with `scripts/chunks.py append` (needs the gguf package: carry its
# wheel). Batches 16, 4 and 1 of long code prompts, bf16, compiled graphs; then greedy identity in fp32 (batch 4).
# EXTRA: more `bench spec` options (e.g. EXTRA=--row-invariant: bf16 identity through the row-invariant products);
# TEMPS: temperatures (default 0; e.g. TEMPS=0,1); CHARS, N, BLOCK: context characters, new tokens, block size.
# RUNS: which of b16 b4 b1 fp32 (default all four: more than one device call's 600 s with compilation; on the H200
# b16 took ~350 s with --row-invariant, b1 more than 200 s).
model=$1; shift
drafters=${*:-"self:binarypc:budget=0.02,select_every=8,dense_layers=0"}
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
bench() {  # name batch prompts dtype
  python3 -m sparsespec bench spec --target "$model" --target-name qwen2.5-coder-1.5b --kinds long-code \
    --long-chars ${CHARS:-80000} --prompts "$3" --batch "$2" --temperatures ${TEMPS:-0} --max-new-tokens ${N:-128} \
    --block-size ${BLOCK:-8} --device cuda --dtype "$4" --compile $EXTRA --out "$OUT/$1" --drafters $drafters 2>&1 \
    | grep -v -E 'Warning: |^ +warn' | tail -8
}
for run in ${RUNS:-b16 b4 b1 fp32}; do
  case $run in
    b16) bench b16 16 16 bfloat16 ;;
    b4) bench b4 4 8 bfloat16 ;;
    b1) bench b1 1 4 bfloat16 ;;
    fp32) bench fp32 4 4 float32 ;;
    *) echo "unknown run $run (b16 b4 b1 fp32)"; exit 2 ;;
  esac
done
