#!/bin/sh
# On the device machine: issue 12's fair accuracy table and long-generation table for one model, as detached runs
# (scripts/gpu_eval.sh; `poll` brings them back). After `sh scripts/gpu_eval.sh setup MODEL.gguf`:
#   sh scripts/gpu_eval_fair.sh MODEL.gguf LABELS.safetensors [LENGTHS]
# LABELS: Double Sparsity's label channels for MODEL (`sparsespec calibrate doublesparse`). LENGTHS default
# "4096 8192 16384 32704" (the last is 32k less the longest answer, so prompt + answer fit a 32k context).
# Every fixed-budget policy gets the same 4 sinks and 64-token recent window inside its budget and the same
# 256-token floor; budgets 1024 and 2048 tokens (as the literature reports them) and 2% of the context. Dense, the
# oracle top-p 0.9, Twilight and Double-P run at their defaults. 20 samples of each of the eight tasks per length,
# one process per length (two for the longest) sharing the GPU; the long-generation run beside them.
model=$1 labels=$2 lengths=${3:-"4096 8192 16384 32704"}
S=sinks=4,window=64,min_tokens=256
P="dense topp:p=0.9 twilight doublep"
for b in 1024 2048 0.02; do
  P="$P topk:budget=$b,$S binarypc:budget=$b,$S quest:budget=$b,$S doublesparse:budget=$b,$S,labels=$labels"
  P="$P streaming:budget=$b,min_tokens=256"
done
first="niah_single,niah_multikey,niah_multivalue,niah_multiquery" second="vt,cwe,fwe,qa"
for n in $lengths; do
  if [ "$n" -gt 16384 ]; then
    sh scripts/gpu_eval.sh eval "fair-$n-a" --model "$model" --lengths "$n" --tasks $first --samples 20 --batch 10 --attention $P
    sh scripts/gpu_eval.sh eval "fair-$n-b" --model "$model" --lengths "$n" --tasks $second --samples 20 --batch 10 --attention $P
  else
    sh scripts/gpu_eval.sh eval "fair-$n" --model "$model" --lengths "$n" --samples 20 --batch $(( n > 8192 ? 10 : 20 )) --attention $P
  fi
done
sh scripts/gpu_eval.sh longgen longgen --model "$model" --attention binarypc topk quest streaming doublep \
  "doublesparse:labels=$labels" twilight --kinds long-essay,long-text,long-code --prompts 3 --long-chars 56000 \
  --max-new-tokens 1024
