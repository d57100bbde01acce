#!/bin/sh
# On the device machine: issue 12's fair accuracy table and long-generation table for one model, as detached runs
# (scripts/gpu_eval.sh; `poll` brings them back). After `sh scripts/gpu_eval.sh setup MODEL.gguf`:
#   sh scripts/gpu_eval_fair.sh MODEL.gguf LABELS.safetensors [LENGTHS] [EXTRA POLICIES ...]
# LABELS: Double Sparsity's label channels for MODEL (`sparsespec calibrate doublesparse`). LENGTHS default
# "4096 8192 16384 32704" (the last is 32k less the longest answer, so prompt + answer fit a 32k context).
# Every fixed-budget policy gets the same 4 sinks and 64-token recent window inside its budget and the same
# 256-token floor; budgets 1024 and 2048 tokens (as the literature reports them) and 2% of the context. Dense, the
# oracle top-p 0.9, Twilight and Double-P run at their defaults; EXTRA policies (e.g. other Double-P settings) run
# beside them. 20 samples of each of the eight tasks per length, the tasks of a length split over SPLIT processes
# for lengths above 8192 (default 2; 1, 2, 4 or 8) sharing the GPU; the long-generation run beside them unless
# LONGGEN=0.
model=$1 labels=$2 lengths=${3:-"4096 8192 16384 32704"}
shift 2; [ $# -gt 0 ] && shift
S=sinks=4,window=64,min_tokens=256
P="dense topp:p=0.9 twilight doublep"
for b in 1024 2048 0.02; do
  P="$P topk:budget=$b,$S binarypc:budget=$b,$S quest:budget=$b,$S doublesparse:budget=$b,$S,labels=$labels"
  P="$P streaming:budget=$b,min_tokens=256"
done
P="$P $*"
tasks="niah_single niah_multikey niah_multivalue niah_multiquery vt cwe fwe qa"
split=${SPLIT:-2}
for n in $lengths; do
  if [ "$n" -gt 8192 ] && [ "$split" -gt 1 ]; then
    per=$(( 8 / split )) i=0
    while [ $i -lt "$split" ]; do
      part=$(echo $tasks | tr ' ' '\n' | sed -n "$(( i * per + 1 )),$(( (i + 1) * per ))p" | paste -sd, -)
      sh scripts/gpu_eval.sh eval "fair-$n-$(echo abcdefgh | cut -c$(( i + 1 )))" --model "$model" --lengths "$n" \
        --tasks "$part" --samples 20 --batch 10 --attention $P
      i=$(( i + 1 ))
    done
  else
    sh scripts/gpu_eval.sh eval "fair-$n" --model "$model" --lengths "$n" --samples 20 --batch $(( n > 8192 ? 10 : 20 )) --attention $P
  fi
done
[ "${LONGGEN:-1}" = 0 ] || sh scripts/gpu_eval.sh longgen longgen --model "$model" --attention binarypc topk quest \
  streaming doublep "doublesparse:labels=$labels" twilight --kinds long-essay,long-text,long-code --prompts 3 \
  --long-chars 56000 --max-new-tokens 1024
