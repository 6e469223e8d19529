# Every GPU check of the project in one call of under 9 minutes, for a lent GPU machine whose
# session has 15 minutes of device time (start included), most important first, each part
# skipped when too little of the call is left: the `gpu` tests, the real-shape learner bench
# (`bench shape`), the Megatron MFU bench, the learner-step bench (`bench train`), the real
# loop's tests, then rollout, e2e and importance benches in the time left (bench_check.sh runs
# the same benches with more time each). Wheels as loop_check.sh and device_check.sh say; run
# `bash tests/gpu/all_check.sh` with carry [".gpu/whl", ".whl"] and timeout_s 570. Logs and
# result JSON come back under $OUT (at most 8 files: the logs are concatenated into one).
# `ONLY="gpu tests,bench e2e"` runs just the parts named (a rerun in a short call).
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
END=${END:-540}  # seconds of the call this script may use
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }  # seconds since the call began
left() { echo $(( END - $(el) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/*.whl .whl/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
LOG="$OUT/all.log"
nproc; nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
clean() { pkill -f asyncrl.engine.hf.server; ray stop --force >/dev/null 2>&1; true; }
pytest() { python3 -m pytest -v -rs -p no:cacheprovider -o addopts="" "$@"; }
# part NAME NEED_SECONDS CAP_SECONDS CMD...: run CMD under min(CAP, time left) when NEED is left
part() {
  local name=$1 need=$2 cap=$3; shift 3
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi  # ONLY: a comma list
  local budget; budget=$(left); [ "$budget" -gt "$cap" ] && budget=$cap
  if [ "$(left)" -lt "$need" ]; then echo "== $name: skipped, $(left)s left" | tee -a "$LOG"; return; fi
  echo "== $name ($(el)s, up to ${budget}s)" | tee -a "$LOG"
  timeout "$budget" "$@" 2>&1 | tee -a "$LOG" | tail -45
  echo "== $name: rc $? at $(el)s" | tee -a "$LOG"; clean
}
part "gpu tests" 60 170 pytest -m gpu tests/gpu --timeout 160
part "bench shape" 120 240 python3 bench/shape.py --out /tmp/b/shape --time-budget 200
part "bench mfu" 40 60 python3 bench/mfu.py --out /tmp/b/mfu
part "bench train" 60 100 python3 bench/train.py --out /tmp/b/train
part "e2e tests" 60 120 pytest tests/test_e2e.py --timeout 110
part "bench rollout" 40 80 python3 bench/rollout.py --out /tmp/b/rollout
part "bench importance" 30 60 python3 bench/importance.py --out /tmp/b/importance
part "bench e2e" 60 150 python3 bench/e2e.py --rounds 1 --out /tmp/b/e2e
for d in shape mfu train rollout importance e2e; do cp /tmp/b/$d/$d.json "$OUT/" 2>/dev/null; done
echo "== done ($(el)s)"; true
