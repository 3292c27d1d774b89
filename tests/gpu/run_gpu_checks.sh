#!/usr/bin/env bash
# One prepared GPU check for a CUDA machine (built for the lent H200: fresh, offline, 15 min of device time).
# Builds async_io and gds, runs tests/gpu (the gds handle; weights streamed to the GPU: test_stream_cuda.py;
# MoE experts grouped on the GPU with their step time per path: test_moe_grouped_cuda.py),
# measures GPU<->file throughput, prints a compact summary.
# Installs nothing: such a machine cannot reach a registry; it needs a CUDA torch, nvcc and nvidia-cufile
# (the device image has all three). Usage: bash tests/gpu/run_gpu_checks.sh [bench MiB, default 1024]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
BENCH_MIB=${1:-1024}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(mktemp -d /tmp/dnv-ext.XXXX)}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
PY=${PYTHON:-python3}
t0=$(date +%s)
stamp() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }

stamp "machine"
nvidia-smi -L 2>&1 | head -4
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
command -v nvcc >/dev/null && nvcc --version | tail -1
if ! $PY -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA device visible to torch: nothing to check here (tests/gpu skip themselves on such machines)"
    exit 0
fi
lsmod 2>/dev/null | grep -E '^nvidia_fs' || echo "nvidia-fs kernel module: not loaded (expect cuFile compatibility mode)"

# A work folder on a real disk (not tmpfs): O_DIRECT and cuFile behave as they would for NVMe.
WORK=$(mktemp -d -p /var/tmp dnv-gpu.XXXX 2>/dev/null || mktemp -d)
df -hT "$WORK" | tail -1

stamp "cufile location"
# The builder's probe should find the nvidia-cufile wheel. CUDA 13 wheels install under nvidia/cu13/, which
# older probes do not search: then expose the wheel's files through /usr/local (a disposable machine).
if ! $PY -c "import sys; from op_builder import probe; sys.exit(probe.find_cufile().include_dir is None)"; then
    inc=$($PY - <<'PYEOF'
import glob, site, sys
dirs = [p for p in sys.path if p] + site.getsitepackages()
hits = sorted({h for d in dirs for h in glob.glob(f"{d}/nvidia/*/include/cufile.h")})
print(hits[0] if hits else "")
PYEOF
)
    if [ -n "$inc" ]; then
        lib=$(dirname "$(dirname "$inc")")/lib
        echo "probe missed $inc: linking it into /usr/local/include and /usr/local/lib"
        ln -sf "$inc" /usr/local/include/cufile.h
        for so in "$lib"/libcufile*.so*; do ln -sf "$so" /usr/local/lib/; done
        ldconfig 2>/dev/null || true
    else
        echo "no cufile.h anywhere: gds cannot be built here"
    fi
fi
$PY -c "from op_builder import probe; print(probe.find_cufile()); print(probe.cufile())"

stamp "build async_io and gds (JIT, $MAX_JOBS jobs)"
$PY - <<'PYEOF' 2>&1 | tee "$OUT/build.log" | tail -40
import time
from op_builder import AsyncIOBuilder, GDSBuilder
for b in (AsyncIOBuilder(), GDSBuilder()):
    t = time.time()
    if not b.is_compatible(verbose=True):
        print(f"{b.name}: NOT compatible")
        continue
    m = b.load()
    print(f"{b.name}: built/loaded in {time.time() - t:.1f}s -> {m.__file__}")
PYEOF

stamp "tests/gpu"
timeout_arg=()
$PY -c "import pytest_timeout" 2>/dev/null && timeout_arg=(--timeout=120)  # a hung test must not eat the lease
$PY -m pytest -q -rs -s -p no:cacheprovider --basetemp="$WORK/pytest" "${timeout_arg[@]}" tests/gpu 2>&1 \
    | tee "$OUT/tests.log" | grep -vE '^\s*$' | tail -60
test_rc=${PIPESTATUS[0]}

stamp "bench ($BENCH_MIB MiB per transfer)"
timeout 300 $PY tests/gpu/bench_gds.py --dir "$WORK/bench" --mib "$BENCH_MIB" --json "$OUT/bench.json" 2>&1 \
    | tee "$OUT/bench.log" | tail -30
bench_rc=${PIPESTATUS[0]}

stamp "summary"
echo "tests: rc=$test_rc  ($(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -1))"
echo "bench: rc=$bench_rc  (table above; $OUT/bench.json)"
rm -rf "$WORK"
exit $(( test_rc != 0 || bench_rc != 0 ))
