# The project's GPU checks in one command, for a lent GPU machine (the device tool's `run`):
# every `gpu` test, then the GPU benchmarks. megatron-core travels as a wheel (the machine has
# no index); once, here, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
# then run with carry [".whl"]:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && bash tests/gpu/device_check.sh
# Ray's wheel (79 MB for cp312) is over the 64 MiB transfer as it is: the loop runs from
# tests/gpu/loop_check.sh, which says how to carry it. Results come back under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi -L
echo "== gpu tests"
timeout 240 python3 -m pytest -m gpu tests/gpu -v -rs -p no:cacheprovider -o addopts="" \
  --timeout 230 2>&1 | tee "$OUT/gpu_tests.log"
echo "== bench mfu"
timeout 120 python3 bench/mfu.py --out /tmp/b/mfu 2>&1 | tail -12 | tee "$OUT/mfu.log"
echo "== bench rollout"
timeout 150 python3 bench/rollout.py --out /tmp/b/rollout 2>&1 | tail -14 | tee "$OUT/rollout.log"
cp /tmp/b/*/*.json "$OUT/" 2>/dev/null
true
