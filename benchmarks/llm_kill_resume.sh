#!/bin/bash
# kill -9 the real-model demo mid-run, resume it, and print what the ledger, history and
# checkpoints say (art_trio's ledger: art_trio_state.json). Usage: [OUTDIR]; PYTHON=venv python.
set -u
OUT=${1:-$(mktemp -d)}; rm -rf $OUT; mkdir -p $OUT
M=$OUT/.art/art-trio-demo/models/k1
export LITELLM_LOCAL_MODEL_COST_MAP=True
${PYTHON:-python} -m art_trio.demo --model smollm2 --name k1 --output-dir $OUT --steps 6 --eval-every 2 --no-plot > $OUT/run1.log 2>&1 &
PID=$!
# kill once step 3 has been trained (after the step-2 checkpoint), while step 4 is in flight
until grep -q "^step 3:" $OUT/run1.log 2>/dev/null; do sleep 1; done
sleep 5
kill -9 $PID; wait $PID 2>/dev/null
echo "killed after: $(grep '^step' $OUT/run1.log | tail -1)"
echo "checkpoints: $(ls $M/checkpoints)"
python3 -c "
import json
s=json.load(open('$M/art_trio_state.json')); print('ledger training_step', s['training_step'])
rows=[json.loads(l) for l in open('$M/history.jsonl') if l.strip()]
print('history train steps', sorted({r['step'] for r in rows if any(k.startswith('train/') for k in r)}))"
${PYTHON:-python} -m art_trio.demo --model smollm2 --name k1 --output-dir $OUT --steps 2 --eval-every 2 --no-plot > $OUT/run2.log 2>&1
grep -v "Converting\|Loading\|warn\|status\]" $OUT/run2.log | head -8
echo "checkpoints: $(ls $M/checkpoints)"
python3 -c "
import json, collections
s=json.load(open('$M/art_trio_state.json')); print('ledger training_step', s['training_step'])
rows=[json.loads(l) for l in open('$M/history.jsonl') if l.strip()]
c=collections.Counter(r['step'] for r in rows if 'train/reward' in r or 'train/loss' in r)
print('history train rows per step', dict(sorted(c.items())))"
