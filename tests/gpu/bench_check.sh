# The GPU benchmarks that all_check.sh leaves out, in one call of under 8 minutes: the learner
# step at Qwen2.5-1.5B's shape (`bench shape`: the torch learner vs a bare fwd+bwd and Megatron
# on ~4k-token sequences packed into 32k-token micro-batches, MFU; about 3 minutes, its later
# rows skipped past --time-budget), the learner step on the embedded model (`bench train`: the
# torch learner in bf16 on the GPU vs a bare fwd+bwd, plus packing and FSDP2), then rollout
# importance sampling on GPU tensors (`bench importance`), each within the seconds left. The
# default `asyncrl run` with the learner on the GPU runs in loop_check.sh. Wheels as
# all_check.sh says; run `bash tests/gpu/bench_check.sh` with carry [".gpu/whl", ".whl"] and
# timeout_s 540.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
export HF_HUB_DISABLE_PROGRESS_BARS=1
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( $1 - $(el) )); }  # seconds until second $1 of the call
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/*.whl .whl/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nproc; nvidia-smi -L
clean() { pkill -f asyncrl.engine.hf.server; ray stop --force >/dev/null 2>&1; true; }
echo "== bench shape ($(el)s)"
timeout 210 python3 bench/shape.py --time-budget 170 --out /tmp/b/shape 2>&1 \
  | grep -Ev "Loading weights|Writing model|UserWarning|warnings.warn" | tee "$OUT/shape.log"
clean; echo "== bench train ($(el)s)"
[ "$(left 390)" -gt 60 ] && timeout "$(left 390)" python3 bench/train.py --out /tmp/b/train 2>&1 \
  | tail -30 | tee "$OUT/train.log"
clean; echo "== bench importance ($(el)s)"
[ "$(left 470)" -gt 30 ] && timeout "$(left 470)" python3 bench/importance.py \
  --out /tmp/b/importance 2>&1 | tail -20 | tee "$OUT/importance.log"
for d in shape train importance; do cp /tmp/b/$d/$d.json "$OUT/" 2>/dev/null; done
clean; echo "== done ($(el)s)"; true
