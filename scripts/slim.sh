#!/bin/sh
# Here, around the device calls: the tracked tree travels with every call and a call carries at most 64 MiB. With
# both shipped drafters (0.5B 24.5 MB, 1.5B 52 MB) the whole tree is ~95 MB, so every call needs a slim tree, and a
# 52 MiB model part fits only beside one.
#   sh scripts/slim.sh out    move the tracked files of 500 kB and more (the shipped drafters, the eval rows) and the
#                             result files of 20 kB and more to .slim/ (git-ignored), keeping their paths (the tree
#                             then travels at ~3 MB, so a 55 MiB model part fits beside it)
#   sh scripts/slim.sh in     put them back, and check that git sees the tree unchanged
# A moved file travels as a carried path (at most ~55 MB a call beside the slim tree), e.g. carry
# [".slim/sparsespec/drafters/qwen2.5-coder-1.5b-dflash.safetensors"] and, on the device, `cp -a .slim/. DEST/`
# into the tree copy DEST the runs use. While slimmed, commit nothing: git would record the moved files as deleted
# (`out` refuses a second time, `in` refuses to overwrite a file that reappeared).
set -e
cd "$(git rev-parse --show-toplevel)"
store=.slim
case $1 in
  out)
    [ ! -e $store/.slimmed ] || { echo "already slimmed (files in $store): sh scripts/slim.sh in"; exit 1; }
    # files of 500 kB and more, and the result files of 20 kB and more (no device run reads docs/results)
    git ls-files -z | xargs -0 du -b | awk '$1 >= 500000 || ($1 >= 20000 && $2 ~ /^docs\/results\//) {print $2}' \
      > /tmp/slim.list
    mkdir -p $store
    while read -r f; do mkdir -p "$store/$(dirname "$f")"; mv "$f" "$store/$f"; done < /tmp/slim.list
    cp /tmp/slim.list $store/.slimmed
    echo "moved $(wc -l < $store/.slimmed) files to $store; the tree is now $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes" ;;
  in)
    [ -e $store/.slimmed ] || { echo "not slimmed"; exit 1; }
    while read -r f; do
      [ ! -e "$f" ] || { echo "$f exists: not overwritten"; exit 1; }
      mv "$store/$f" "$f"
    done < $store/.slimmed
    rm $store/.slimmed
    if git status --porcelain | grep -q '^ D'; then echo "tracked files still missing:"; git status --short; exit 1; fi
    echo "restored" ;;
  *) echo "usage: sh scripts/slim.sh out|in"; exit 2 ;;
esac
