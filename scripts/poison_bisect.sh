#!/usr/bin/env bash
# Finds the device allocation a trial reads before writing it: the trial (MODEL, CONFIG) run by
# BINARY with its allocations poisoned (INFERSWEEP_POISON_DEVICE_MEMORY, engine/cuda/
# device_util.h) must come out other than OK; the range of allocations poisoned is then halved
# until one allocation alone makes it so, and that allocation's size, label and caller are
# printed. GPU machine only.
#   bash scripts/poison_bisect.sh BINARY MODEL CONFIG [WORKLOAD]
set -uo pipefail
binary=$1 model=$2 config=$3
workload=${4:-prompt=16,output=4,batch=1,repeats=1,warmup=0,timeout=120}
work=$(mktemp -d)

# The trial's verdict with allocations $1 poisoned: OK, or the status it got instead.
verdict() {
  INFERSWEEP_POISON_DEVICE_MEMORY=$1 INFERSWEEP_POISON_LOG=${2:-} "$binary" run --model "$model" \
    --config "$config" --workload "$workload" --json "$work/r.json" > "$work/run.log" 2>&1
  python3 - "$work/r.json" <<'PY'
import json, sys
try:
    results = json.load(open(sys.argv[1]))
except Exception as e:
    print("NO_RESULT"); sys.exit()
items = results if isinstance(results, list) else results.get("results", [])
bad = [r.get("status", "?") for r in items if r.get("status") != "OK"]
print(bad[0] if bad else "OK")
PY
}

rm -f "$work/all.log"
first=$(verdict 1 "$work/all.log")
count=$(grep -c '^poisoned #' "$work/all.log" 2>/dev/null || echo 0)
echo "# $model $config: every allocation poisoned ($count in the last process): $first"
if [ "$first" = OK ]; then echo "# nothing to bisect"; exit 0; fi
hi=$(grep '^poisoned #' "$work/all.log" | sed -E 's/^poisoned #([0-9]+) .*/\1/' | sort -n | tail -1)
hi=$((hi + 1))

# Halves [lo, hi) down to the one allocation that, poisoned with the ranges in $held, keeps the
# trial from OK; prints its number.
narrow() {
  local lo=$1 hi=$2 held=$3 mid a
  while ((hi - lo > 1)); do
    mid=$(((lo + hi) / 2))
    a=$(verdict "$held$lo-$mid")
    echo "#   ${held}[$lo, $mid): $a" >&2
    if [ "$a" != OK ]; then hi=$mid; else lo=$mid; fi
  done
  echo "$lo"
}

# One allocation, or a pair when neither half alone keeps the trial from OK (a read that needs
# two garbage buffers): the right one found with the left half held poisoned, then the left one
# with the right one held.
mid=$((hi / 2))
if [ "$(verdict "0-$mid")" != OK ]; then
  found=$(narrow 0 "$mid" "")
elif [ "$(verdict "$mid-$hi")" != OK ]; then
  found=$(narrow "$mid" "$hi" "")
else
  echo "# neither half alone: a pair"
  right=$(narrow "$mid" "$hi" "0-$mid,")
  left=$(narrow 0 "$mid" "$right-$((right + 1)),")
  found="$left $right"
fi
spec=""
for n in $found; do spec="$spec$n-$((n + 1)),"; done
rm -f "$work/one.log"
last=$(verdict "${spec%,}" "$work/one.log")
echo "# allocations $found alone: $last"
# OK here: no one allocation or pair does it (many at once, or a verdict that varies run to run).
[ "$last" = OK ] && echo "# inconclusive: those alone leave the trial OK"
grep '^poisoned #' "$work/one.log"
# The callers' frames, raw (resolve them against the same binary with addr2line -f -C), then
# the binary's own resolved here.
grep -vE '^poisoned #' "$work/one.log" | grep -v libc.so | sed 's/^/#   /'
grep -oE '^[^ ]+\(\+0x[0-9a-f]+\)' "$work/one.log" | while IFS= read -r frame; do
  object=${frame%%(*} offset=${frame##*(+}
  offset=${offset%)}
  echo "#   $(addr2line -f -C -e "$object" "$offset" 2>/dev/null | head -1 | cut -c1-160)"
done
