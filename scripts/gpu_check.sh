#!/usr/bin/env bash
# The checks that need a CUDA device, as one run on a lent GPU machine (docs/benchmarks.md,
# "Async save on a GPU"): the CUDA tests (pinned staging, lazy snapshots on CUDA streams, JAX on
# the GPU), the async-gpu benchmark suite, then the stage call timed and profiled
# (scripts/stage_call.py). Everything it writes goes under $OUT.
#
#   OUT=/tmp/gpu-out CKPTSTORE_BENCH_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_check.sh
#
# Wheels the machine lacks (built for its Python) may lie in .whl/; they go to /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if compgen -G ".whl/*.whl" >/dev/null; then
    # Into the machine's own environment where it may be written, else into /tmp/site on
    # PYTHONPATH. At aa56214 two tests failed on the lent machine for want of orjson, which
    # lay only in /tmp/site: their Python child's PYTHONPATH held the checkout alone. Since
    # 4215dd4 a child keeps the parent's entries after the checkout (tests/children.py).
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl ||
    {
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    }
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The compiled pack kernel (setup.py), as an install builds it; without a compiler the
# Python loop runs, and gpu.txt says which.
python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || echo "build_ext failed" >>"$OUT/build.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, jax; print("torch", torch.__version__, torch.cuda.get_device_name(),
"jax", jax.__version__, jax.devices())
from ckptstore.store import checksum; print("native pack kernel:", checksum.NATIVE)' | tee -a "$OUT/gpu.txt"
status=0
# -p no:cacheprovider: the copy's tree may be read-only in places; the suite's config (strict
# markers, warnings as errors) applies as on every machine.
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q -rA tests/test_stage.py \
    tests/test_lazy_snapshot.py -k "cuda or jax or torch or pinned" 2>&1 | tee "$OUT/tests.log"
status=$((status | PIPESTATUS[0]))
# WORKLOADS=transformer: on an H200 at aa56214 three rounds of both workloads took more than
# 420 s (the 1 GiB DCP child alone loops 7 s); three of the transformer took about 260 s.
timeout "${BENCH_TIMEOUT:-420}" python3 scripts/bench.py async-gpu -r "${REPEAT:-3}" \
    ${WORKLOADS:+--workloads "$WORKLOADS"} --workdir /tmp --out "$OUT" 2>&1 | tee "$OUT/bench.log"
status=$((status | PIPESTATUS[0]))
# The stage call alone, with the collector's share of it and a profile of 30 calls of each
# stage (the lazy call's 5 ms at c9a24fd is the goal's gap: 0.1x one memcpy is 1 ms here).
timeout "${STAGE_TIMEOUT:-90}" python3 scripts/stage_call.py --profile 30 >"$OUT/stage_call.json" \
    2>"$OUT/stage_profile.txt"
status=$((status | $?))
cp docs/benchmarks.md "$OUT/benchmarks.md" 2>/dev/null
cp docs/img/bench-async-gpu.png "$OUT/" 2>/dev/null
exit $status
