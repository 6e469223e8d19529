# The GPU benchmarks that all_check.sh leaves out, in one call of about 6 minutes: the learner
# step (`bench train`: the torch learner in bf16 on the GPU vs a bare fwd+bwd, plus packing and
# FSDP2), rollout importance sampling on GPU tensors (`bench importance`), and the default
# `asyncrl run` with the learner on the GPU (on a fresh machine it first builds the embedded
# model: a CPU warm-start of about 2 minutes). Wheels as all_check.sh says; run
# `bash tests/gpu/bench_check.sh` with carry [".gpu/whl", ".whl"] and timeout_s 480.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/*.whl .whl/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nproc; nvidia-smi -L
clean() { pkill -f asyncrl.engine.hf.server; ray stop --force >/dev/null 2>&1; true; }
echo "== bench train ($(el)s)"
timeout 170 python3 bench/train.py --out /tmp/b/train 2>&1 | tail -30 | tee "$OUT/train.log"
echo "== bench importance ($(el)s)"
timeout 80 python3 bench/importance.py --out /tmp/b/importance 2>&1 | tail -20 \
  | tee "$OUT/importance.log"
clean; echo "== default run ($(el)s)"
timeout 250 python3 -m asyncrl.cli run configs/default.yaml output_dir=/tmp/r1 2>&1 | tail -30 \
  | tee "$OUT/run.log"
cp /tmp/r1/metrics.jsonl "$OUT/run_metrics.jsonl" 2>/dev/null
for d in train importance; do cp /tmp/b/$d/$d.json "$OUT/" 2>/dev/null; done
clean; echo "== done ($(el)s)"; true
