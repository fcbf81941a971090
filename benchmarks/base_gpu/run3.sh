#!/bin/bash
# GPU call 3: RL on candidate F, three settings at once (the CPU presets, run on the GPU).
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30 OMP_NUM_THREADS=5
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
M="model.path=.gpu/F/tiny-sd3 run.device=cuda"
L=${LIMIT:-500}
timeout $L python3 -m flowrl.cli train configs/diffusion_nft.yaml eval.every=50 $M run.output_dir=/tmp/r/nft > /tmp/l_nft 2>&1 &
timeout $L python3 -m flowrl.cli train configs/diffusion_nft.yaml eval.every=50 $M train.learning_rate=1e-4 train.nft.old_decay=0 run.output_dir=/tmp/r/nft_gentle > /tmp/l_gentle 2>&1 &
timeout $L python3 -m flowrl.cli train configs/tiny_geneval.yaml run.iterations=90 eval.every=30 $M run.output_dir=/tmp/r/grpo > /tmp/l_grpo 2>&1 &
wait
echo "done after $(( $(date +%s) - T0 )) s"
for r in nft nft_gentle grpo; do echo "== $r"; tail -c 400 /tmp/l_$r; echo; python3 - $r <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"/tmp/r/{sys.argv[1]}/metrics.jsonl")]
ev = [(r.get("iteration"), {k: v for k, v in r.items() if "eval" in k and "overall" in k}) for r in rows if any("eval" in k for k in r)]
print("iterations", len(rows), ev[-6:])
PY
done
cd /tmp/r && tar cf $OUT/runs.tar --exclude=checkpoints --exclude='*.png' . ; cp /tmp/l_* $OUT/ 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
