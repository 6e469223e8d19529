# The training loop on a lent GPU machine (the device tool's `run`): Ray rollout actors, the hf
# engine server on the CPU cores, ZMQ, the torch learner on the GPU, gloo weight sync. Runs
# tests/test_e2e.py, a default `asyncrl run`, `bench e2e` and `bench peer` (one round each).
# The machine has no index and lacks Ray, pyzmq, msgspec, gymnasium, math-verify, TRL and
# datasets: they travel as cp312 wheels. Once, here, in the repo root (`.gpu/` is ignored):
#   echo /.gpu/ >> .git/info/exclude; mkdir -p .gpu/whl
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     --platform any -d .gpu/whl ray==2.60.0 pyzmq msgspec gymnasium farama-notifications \
#     math-verify latex2sympy2_extended antlr4-python3-runtime jsonschema referencing \
#     rpds-py jsonschema-specifications trl datasets dill multiprocess
# Ray's wheel (79 MB) is over the 64 MiB a call carries; its Java jar (ray/jars, 32 MB) and
# dashboard client are not needed: rewrite the wheel without them (47 MB in all), e.g.
#   python3 - <<'PY'
#   import zipfile, glob; src = glob.glob(".gpu/whl/ray-*.whl")[0]; z = zipfile.ZipFile(src)
#   items = [(i, z.read(i)) for i in z.infolist()
#            if not i.filename.startswith(("ray/jars/", "ray/dashboard/client/"))]
#   with zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as out:
#       for i, data in items: out.writestr(i, data)
#   PY
# then run `bash tests/gpu/loop_check.sh` with carry [".gpu/whl"] (about 8 minutes).
# Results come back under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nproc; nvidia-smi -L
python3 -c "import ray, zmq, msgspec, torch; print('ray', ray.__version__, 'torch', torch.__version__)"
clean() { pkill -f asyncrl.engine.hf.server; ray stop --force >/dev/null 2>&1; true; }
t0=$(date +%s); echo "== e2e tests"
timeout 170 python3 -m pytest tests/test_e2e.py -v -rs -p no:cacheprovider -o addopts="" \
  --timeout 160 2>&1 | tail -25 | tee "$OUT/e2e_tests.log"
clean; echo "== default run ($(( $(date +%s)-t0 ))s)"
timeout 120 python3 -m asyncrl.cli run configs/default.yaml max_steps=60 output_dir=/tmp/r1 2>&1 \
  | tail -25 | tee "$OUT/run.log"
cp /tmp/r1/metrics.jsonl "$OUT/run_metrics.jsonl" 2>/dev/null
clean; echo "== bench e2e ($(( $(date +%s)-t0 ))s)"
timeout 150 python3 bench/e2e.py --rounds 1 --out /tmp/b/e2e 2>&1 | tail -30 | tee "$OUT/bench_e2e.log"
cp /tmp/b/e2e/e2e.json "$OUT/" 2>/dev/null
clean; echo "== bench peer ($(( $(date +%s)-t0 ))s)"
left=$(( 470 - ($(date +%s)-t0) ))
[ $left -gt 40 ] && timeout $left python3 bench/peer.py --rounds 1 --out /tmp/b/peer 2>&1 \
  | tail -30 | tee "$OUT/bench_peer.log"
cp /tmp/b/peer/peer.json "$OUT/" 2>/dev/null
echo "== done ($(( $(date +%s)-t0 ))s)"; true
