#!/bin/sh
# On the device machine: issue 14's table for one domain (results under $OUT/eda-DOMAIN.tar.gz when OUT is set).
#   sh scripts/gpu_eda.sh MODEL.gguf BASE_DRAFTER DOMAIN
# MODEL.gguf: the base target rebuilt there (scripts/chunks.py); BASE_DRAFTER: the DFlash drafter made for it (a path
# without .safetensors); DOMAIN: kjv or shakespeare. Every step writes into /root/eda/DOMAIN/<step> and resumes from
# there while the machine stays warm (run it detached: `OUT= setsid nohup sh scripts/gpu_eda.sh ... &`, read
# /root/eda/DOMAIN/log, then run it again with OUT set: finished steps are skipped and the results come back):
#   ft        train finetune --domain DOMAIN                      the fine-tuned target (a LoRA adapter folder)
#   loss      train eda --select loss                              (b) EDA: private MLPs, regenerated data, selection
#   reducible train eda --select reducible                         (b') selection by loss less the target's own loss
#   acceptance train eda --select acceptance                       (b''') selection by the base drafter's simulated tau
#   shift     train eda --select shift                             (b*) selection by the base target's loss on
#                                                                      the answer less the fine-tuned target's
#   random    train eda --select random                            (c) the same amount of data chosen at random
#   original  train eda --select loss --data original              (d) the domain's own text instead of regeneration
#   probe-loss   train eda --select loss --probe-tokens PROBE      (b") selection before regeneration: every prompt's
#                                                                      first PROBE answer tokens scored, only the kept
#                                                                      prompts answered in full
#   probe-shift  train eda --select shift --probe-tokens PROBE     (b*") the shift rule on the probes: the base
#                                                                      target's loss on each probe less the fine-tune's
#   probe-random train eda --select random --probe-tokens PROBE    (c") their control: as many prompts, at random
#   retrain   train dflash --target ft --kinds DOMAIN              (e) a drafter of the base's shape trained from
#                                                                      scratch for the fine-tune, RETRAIN x EDA's time,
#                                                                      on RETRAIN_PROMPTS answers (default PROMPTS)
#   bench     bench spec --target ft: the base drafter (a), then every run above that made a drafter (ONLY may skip
#             some), held-out DOMAIN prompts, T = 0, compiled, on cuda with --row-invariant (verify and decode
#             round alike: greedy output identical in bf16)
#   bench-general  (with MIX) the same drafters on held-out general prompts (code and text)
# MIX=F: every train eda run answers a mixed pool, a share F of general code and text prompts beside the domain's
# (`train eda --mix`), as a fine-tuned target's traffic mixes them, in a folder of its own (DOMAIN-mixF: the runs
# of another mix are not reused); `original` is skipped (the domain's text has no general prompts), the retrain
# stays on the domain.
# Every run after the loss run starts from its answers (same prompts, seed and sizes; the retrain answers anew).
# Sizes (environment): DEVICE (cuda), FT_STEPS (300), FT_EXAMPLES (4096), PROMPTS (1024), FRACTION (0.5),
# GEN_BATCH (128 prompts a generation batch), PROBE (32 answer tokens a probe), PRIVATE (256), STEPS (100000),
# TIME (120 s of optimisation for each EDA run), RETRAIN (4), RETRAIN_PROMPTS (PROMPTS), LAYERS (3),
# INTERMEDIATE (2048), BENCH_PROMPTS (32), NEW (128), EXTRA (more options for every train eda / train dflash),
# EDA_EXTRA (more options for the train eda runs only, e.g. "--lr 1e-3"), FT_EXTRA (more options for train
# finetune), ROOT (/root/eda), FT (a fine-tune folder made by an earlier run, e.g. /root/eda/DOMAIN/ft: linked as
# this root's ft and its step skipped, so a second ROOT, e.g. with another FRACTION, adapts to the same target).
model=$1; base=$2; domain=$3
[ -n "$model" ] && [ -n "$base" ] && [ -n "$domain" ] || { echo "usage: gpu_eda.sh MODEL BASE_DRAFTER DOMAIN"; exit 2; }
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
dev=${DEVICE:-cuda}; time=${TIME:-120}; prompts=${PROMPTS:-1024}
root=${ROOT:-/root/eda}/$domain${MIX:+-mix$MIX}
mkdir -p $root
. scripts/steps.sh
if [ -n "$FT" ] && [ ! -e $root/ft ]; then
  [ -f "$FT/adapter.json" ] || { echo "FT=$FT is not a fine-tune folder (no adapter.json)"; exit 2; }
  ln -s "$(cd "$FT" && pwd)" $root/ft && touch $root/ft.done
fi
S="python3 -m sparsespec"
step ft $S train finetune --model "$model" --domain $domain --out $root/ft --steps ${FT_STEPS:-300} \
  --examples ${FT_EXAMPLES:-4096} --device $dev --progress $FT_EXTRA
eda() {  # eda STEP OPTIONS...
  run=$1; shift
  step $run $S train eda --target $root/ft --base-drafter "$base" --domain $domain --out $root/$run \
    --prompts $prompts --fraction ${FRACTION:-0.5} --private-size ${PRIVATE:-256} --steps ${STEPS:-100000} \
    --gen-batch ${GEN_BATCH:-128} --time-limit $time --device $dev --progress ${MIX:+--mix $MIX} $EXTRA $EDA_EXTRA \
    "$@"
}
reuse() {  # reuse RUN: RUN starts from the loss run's answers
  if [ -f $root/loss.done ] && [ ! -d $root/$1 ]; then
    mkdir -p $root/$1 && cp $root/loss/data.safetensors $root/loss/heldout.safetensors $root/$1/
  fi
}
eda loss --select loss
reuse reducible; eda reducible --select reducible
reuse acceptance; eda acceptance --select acceptance
reuse shift; eda shift --select shift
reuse random; eda random --select random
[ -n "$MIX" ] || eda original --select loss --data original
eda probe-loss --select loss --probe-tokens ${PROBE:-32}
eda probe-shift --select shift --probe-tokens ${PROBE:-32}
eda probe-random --select random --probe-tokens ${PROBE:-32}
step retrain $S train dflash --target $root/ft --kinds $domain --out $root/retrain \
  --prompts ${RETRAIN_PROMPTS:-$prompts} --layers ${LAYERS:-3} --intermediate-size ${INTERMEDIATE:-2048} \
  --steps ${STEPS:-100000} --gen-batch ${GEN_BATCH:-128} --time-limit $(python3 -c "print($time * ${RETRAIN:-4})") \
  --lr 3e-4 --device $dev --progress $EXTRA
drafters=dflash:$base
for run in loss reducible acceptance shift random original probe-loss probe-shift probe-random retrain; do
  [ -f $root/$run/drafter.json ] && drafters="$drafters dflash:$root/$run/drafter"
done
step bench $S bench spec --target $root/ft --drafters $drafters --kinds $domain \
  --prompts ${BENCH_PROMPTS:-32} --batch 1 --temperatures 0 --max-new-tokens ${NEW:-128} --block-size 16 \
  --device $dev $([ "$dev" = cuda ] && echo --compile --row-invariant) --out $root/bench
[ -n "$MIX" ] && step bench-general $S bench spec --target $root/ft --drafters $drafters --kinds code,text \
  --prompts ${BENCH_PROMPTS:-32} --batch 1 --temperatures 0 --max-new-tokens ${NEW:-128} --block-size 16 \
  --device $dev $([ "$dev" = cuda ] && echo --compile --row-invariant) --out $root/bench-general
[ -f $root/log ] && tail -40 $root/log
[ -n "$OUT" ] || exit 0
cd $root && tar czf $OUT/eda-$domain.tar.gz log ft/adapter.json */drafter.json */summary.json bench*/spec.* \
  2>/dev/null; ls -la $OUT
