#!/bin/bash
# GPU call 4: longer RL runs on candidate F, four settings at once; killed at the time limit.
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
M="model.path=.gpu/F/tiny-sd3 run.device=cuda run.iterations=400 eval.every=50"
L=${LIMIT:-350}
timeout $L python3 -m flowrl.cli train configs/tiny_geneval.yaml $M train.kl_beta=0.04 train.learning_rate=1e-4 run.output_dir=/tmp/r/g_kl > /tmp/l_g_kl 2>&1 &
timeout $L python3 -m flowrl.cli train configs/tiny_geneval.yaml $M sampling.prompts_per_iteration=16 run.output_dir=/tmp/r/g_16 > /tmp/l_g_16 2>&1 &
timeout $L python3 -m flowrl.cli train configs/diffusion_nft.yaml $M train.learning_rate=3e-5 train.nft.old_decay=0 run.output_dir=/tmp/r/n_slow > /tmp/l_n_slow 2>&1 &
timeout $L python3 -m flowrl.cli train configs/diffusion_nft.yaml $M train.learning_rate=1e-4 train.nft.old_decay=0 sampling.prompts_per_iteration=16 run.output_dir=/tmp/r/n_16 > /tmp/l_n_16 2>&1 &
wait
echo "done after $(( $(date +%s) - T0 )) s"
for r in g_kl g_16 n_slow n_16; do python3 - $r <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"/tmp/r/{sys.argv[1]}/metrics.jsonl")]
print(sys.argv[1], "iterations", len(rows), [(r["iteration"], round(r["eval/overall"], 3)) for r in rows if "eval/overall" in r])
PY
done
cd /tmp/r && tar cf $OUT/runs4.tar --exclude=checkpoints --exclude='*.png' --exclude='*.safetensors' . ; cp /tmp/l_* $OUT/ 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
