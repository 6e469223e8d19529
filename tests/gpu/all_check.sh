# Every GPU check of the project in one call of under 8 minutes, for a lent GPU machine whose
# session has 15 minutes of device time (start included): the `gpu` tests, the real loop's
# tests, then the GPU benchmarks (rollout, e2e, mfu) in the time left. Wheels as
# device_check.sh and loop_check.sh say; run `bash tests/gpu/all_check.sh` with carry
# [".gpu/whl", ".whl"] and timeout_s 540. Logs and result JSON come back under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }  # seconds since the call began
left() { echo $(( $1 - $(el) )); }  # seconds until second $1 of the call
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/*.whl .whl/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nproc; nvidia-smi -L
clean() { pkill -f asyncrl.engine.hf.server; ray stop --force >/dev/null 2>&1; true; }
pytest() { python3 -m pytest -v -rs -p no:cacheprovider -o addopts="" "$@"; }
echo "== gpu tests ($(el)s)"
timeout 170 pytest -m gpu tests/gpu --timeout 160 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
clean; echo "== e2e tests ($(el)s)"
timeout 130 pytest tests/test_e2e.py --timeout 120 2>&1 | tee "$OUT/e2e_tests.log" | tail -20
clean; echo "== bench rollout ($(el)s)"
timeout 100 python3 bench/rollout.py --out /tmp/b/rollout 2>&1 | tail -16 | tee "$OUT/rollout.log"
clean; echo "== bench e2e ($(el)s)"
[ "$(left 420)" -gt 60 ] && timeout "$(left 420)" python3 bench/e2e.py --rounds 1 --out /tmp/b/e2e \
  2>&1 | tail -24 | tee "$OUT/bench_e2e.log"
clean; echo "== bench mfu ($(el)s)"
[ "$(left 470)" -gt 30 ] && timeout "$(left 470)" python3 bench/mfu.py --out /tmp/b/mfu 2>&1 \
  | tail -10 | tee "$OUT/mfu.log"
for d in rollout e2e mfu; do cp /tmp/b/$d/$d.json "$OUT/" 2>/dev/null; done
echo "== done ($(el)s)"; true
