#!/bin/bash
# GPU call 2: continue candidate B with large batches (two settings at once), evaluate.
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30 OMP_NUM_THREADS=6
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
B=${BUDGET:-320}
python3 .gpu/probe.py 5 128 2048 > /tmp/p1.txt 2>/dev/null &
python3 .gpu/probe.py 5 128 2048 > /tmp/p2.txt 2>/dev/null &
wait; cat /tmp/p?.txt
s=$(awk '{print $5}' /tmp/p1.txt); n=$(python3 -c "print(int($B / $s) // 60 * 60)")
echo "steps $n after $(( $(date +%s) - T0 )) s"
for v in E F; do mkdir -p /tmp/v$v && cp -r assets/tiny-clip /tmp/v$v/; done
COMMON="--resume --init .gpu/B/tiny-sd3 --n-scenes 150000 --dit-batch 2048 --dit-ema 0.999 --device cuda --dit-steps $n --text-lr 3e-4"
python3 -m flowrl.tiny.build --out /tmp/vE $COMMON --dit-lr 3e-4 > /tmp/logE 2>&1 &
python3 -m flowrl.tiny.build --out /tmp/vF $COMMON --dit-lr 3e-4 --dit-t-mean 0.5 > /tmp/logF 2>&1 &
wait
for v in E F; do
  tar cf $OUT/${v}_transformer.tar -C /tmp/v$v/tiny-sd3 transformer build.json
  tar cf $OUT/${v}_text.tar -C /tmp/v$v/tiny-sd3 text_encoder
done
echo "builds done after $(( $(date +%s) - T0 )) s"; for v in E F; do tail -c 300 /tmp/log$v; echo; done
for v in E F; do python3 -m flowrl.cli eval --model /tmp/v$v/tiny-sd3 --prompts test --out /tmp/eval_$v.json --device cuda > /tmp/loge$v 2>&1 & done; wait
for v in E F; do python3 benchmarks/base_headroom.py --model /tmp/v$v/tiny-sd3 --out /tmp/head_$v.json --device cuda > /tmp/logh$v 2>&1 & done; wait
echo "evals done after $(( $(date +%s) - T0 )) s"
python3 - <<'PY'
import json, os
r = {}
for v in ["E", "F"]:
    r[v] = {k: (json.load(open(f"/tmp/{k}_{v}.json")) if os.path.exists(f"/tmp/{k}_{v}.json") else None) for k in ["eval", "head"]}
    if r[v]["eval"]: print(v, "eval", round(r[v]["eval"]["overall"], 3), {t: round(x, 3) for t, x in r[v]["eval"]["per_tag"].items()})
    if r[v]["head"]: print(v, "pass@8", {t: (round(x["mean"], 3), round(x["pass_at_k"], 3)) for t, x in r[v]["head"]["pass_at_k"].items()}, r[v]["head"]["denoise_from_scenes"])
json.dump(r, open(os.environ["OUT"] + "/results2.json", "w"), indent=1)
PY
cat /tmp/log? /tmp/loge? /tmp/logh? > $OUT/log2.txt 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
