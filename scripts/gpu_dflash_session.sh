#!/bin/sh
# On the device machine: one session's DFlash pipeline for a target, run detached so that it outlasts the calls
# (the twenty-seventh session's run of issue 13):
#   setsid nohup sh scripts/gpu_dflash_session.sh MODEL.gguf TARGET_NAME [train dflash options ...] > LOG 2>&1 &
# 1. trains a drafter into /root/run (`scripts/gpu_train_dflash.sh`, OUT unset; e.g. --init FILE --seed N to go on
#    from a shipped drafter), 2. splits it into 15 MiB parts in /root/parts (with its json) for a later call to copy
#    back, 3. waits until no pytest runs (the timings need the GPU alone), 4. times `bench spec` on HumanEval for
#    DFlash alone and ngram+dflash against compiled plain decoding: T = 0 at batch 1 (164 problems), T = 1 at batch 1
#    (48), T = 0 and 1 at batch 4 (32), into /root/eval/spec-{t0-b1,t1-b1,b4} (each under `timeout`: T0 330 s,
#    others 150 s; a run cut short keeps the rows it measured in its spec.jsonl).
# SKIP_TRAIN=1 benches the drafter already in /root/run, or DRAFTER (a path without .safetensors, e.g. the shipped
# sparsespec/drafters/qwen2.5-coder-1.5b-dflash). After training, /root/dataparts holds the answers' tokens in
# parts (data.safetensors, ~19 MB for 16k prompts) for a later session's --add-data. T0_DRAFTERS (e.g.
# "ngram dflash:/root/run/drafter ngram+dflash:/root/run/drafter") and T0_LIMIT change the first run's drafters and
# time limit; ONLY_T0=1 stops after it. Each line of progress goes to the log with the time.
model=$1; name=$2; shift 2
export PYTHONPATH=.:/tmp/site:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
D=${DRAFTER:-/root/run/drafter}; E=/root/eval; mkdir -p $E
if [ -z "$SKIP_TRAIN" ]; then
  echo "train start $(date +%T)"
  OUT= sh scripts/gpu_train_dflash.sh "$model" "$@" > /root/train.out 2>&1
  echo "train done $(date +%T)"
fi
[ -f $D.safetensors ] || { echo "no drafter at $D.safetensors"; exit 1; }
if [ -z "$SKIP_TRAIN" ]; then  # the drafter, and the answers' tokens for a later --add-data, in parts to copy back
  rm -rf /root/parts && python3 scripts/chunks.py split $D.safetensors /root/parts --size 15 && cp $D.json /root/parts/
  rm -rf /root/dataparts && python3 scripts/chunks.py split /root/run/data.safetensors /root/dataparts --size 15
fi
while pgrep -f pytest > /dev/null; do sleep 3; done
bench() {  # NAME SECONDS DRAFTERS [bench spec options ...]
  run=$1; limit=$2; drafters=$3; shift 3
  echo "$run start $(date +%T)"
  timeout "$limit" python3 -m sparsespec bench spec --target "$model" --target-name "$name" \
    --drafters $drafters --kinds humaneval --max-new-tokens 128 --block-size 16 --device cuda \
    --compile --out $E/spec-$run "$@" > $E/spec-$run.log 2>&1
  rc=$?
  echo "$run done $(date +%T) rc $rc (124: the time limit cut it short)"
}
bench t0-b1 ${T0_LIMIT:-330} "${T0_DRAFTERS:-dflash:$D ngram+dflash:$D}" --prompts 164 --batch 1 --temperatures 0
[ -n "$ONLY_T0" ] && { echo "all done $(date +%T)"; exit 0; }
bench t1-b1 150 "dflash:$D ngram+dflash:$D" --prompts 48 --batch 1 --temperatures 1
bench b4 150 "dflash:$D ngram+dflash:$D" --prompts 32 --batch 4 --temperatures 0,1
echo "all done $(date +%T)"
