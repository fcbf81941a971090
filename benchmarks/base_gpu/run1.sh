#!/bin/bash
# GPU call 1: build three candidate bases concurrently, evaluate them and the shipped base.
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
python3 -c "import torch, diffusers, transformers, open_clip, omegaconf; print(torch.__version__, diffusers.__version__, transformers.__version__, torch.cuda.get_device_name())" || exit 1
B=${BUDGET:-290}
python3 .gpu/probe.py 5 128 256 > /tmp/pA.txt 2>/dev/null &
python3 .gpu/probe.py 8 192 256 > /tmp/pC.txt 2>/dev/null &
python3 .gpu/probe.py 5 128 256 > /tmp/pB.txt 2>/dev/null &
wait; cat /tmp/p?.txt
sA=$(awk '{print $5}' /tmp/pA.txt); sC=$(awk '{print $5}' /tmp/pC.txt)
nA=$(python3 -c "print(int($B / $sA) // 60 * 60)"); nC=$(python3 -c "print(int($B / $sC) // 60 * 60)")
echo "steps A/B $nA  C $nC  after $(( $(date +%s) - T0 )) s"
for v in A B C; do mkdir -p /tmp/v$v && cp -r assets/tiny-clip /tmp/v$v/; done
COMMON="--resume --init assets/tiny-sd3 --n-scenes 100000 --dit-batch 256 --dit-ema 0.999 --device cuda"
python3 -m flowrl.tiny.build --out /tmp/vA $COMMON --fresh-transformer --dit-steps $nA --dit-lr 6e-4 --text-lr 5e-4 > /tmp/logA 2>&1 &
python3 -m flowrl.tiny.build --out /tmp/vB $COMMON --dit-steps $nA --dit-lr 2e-4 --text-lr 3e-4 > /tmp/logB 2>&1 &
python3 -m flowrl.tiny.build --out /tmp/vC $COMMON --fresh-transformer --dit-layers 8 --dit-width 192 --dit-steps $nC --dit-lr 5e-4 --text-lr 5e-4 > /tmp/logC 2>&1 &
python3 -m flowrl.cli eval --model assets/tiny-sd3 --prompts test --out /tmp/eval_base.json --device cuda > /tmp/log_base 2>&1
python3 benchmarks/base_headroom.py --model assets/tiny-sd3 --out /tmp/head_base.json --device cuda >> /tmp/log_base 2>&1
wait
for v in A B C; do
  tar cf $OUT/${v}_transformer.tar -C /tmp/v$v/tiny-sd3 transformer build.json
  tar cf $OUT/${v}_text.tar -C /tmp/v$v/tiny-sd3 text_encoder
done
echo "builds done after $(( $(date +%s) - T0 )) s"; for v in A B C; do tail -c 600 /tmp/log$v; echo; done; tail -20 /tmp/log_base
for v in A B C; do
  python3 -m flowrl.cli eval --model /tmp/v$v/tiny-sd3 --prompts test --out /tmp/eval_$v.json --device cuda > /tmp/loge$v 2>&1 &
done; wait
for v in A B C; do python3 benchmarks/base_headroom.py --model /tmp/v$v/tiny-sd3 --out /tmp/head_$v.json --device cuda > /tmp/logh$v 2>&1 & done; wait
echo "evals done after $(( $(date +%s) - T0 )) s"
python3 - <<'PY'
import json, os
r = {}
for v in ["base", "A", "B", "C"]:
    r[v] = {}
    for k in ["eval", "head"]:
        f = f"/tmp/{k}_{v}.json"
        r[v][k] = json.load(open(f)) if os.path.exists(f) else None
    if r[v]["eval"]: print(v, "eval", round(r[v]["eval"]["overall"], 3), {t: round(x, 3) for t, x in r[v]["eval"]["per_tag"].items()})
    if r[v]["head"]: print(v, "pass@8", {t: (round(x["mean"], 3), round(x["pass_at_k"], 3)) for t, x in r[v]["head"]["pass_at_k"].items()}, r[v]["head"]["denoise_from_scenes"])
json.dump(r, open(os.environ["OUT"] + "/results.json", "w"), indent=1)
PY
cat /tmp/log? /tmp/loge? /tmp/logh? /tmp/log_base > $OUT/log.txt 2>/dev/null
ls -la $OUT; echo "total $(( $(date +%s) - T0 )) s"
