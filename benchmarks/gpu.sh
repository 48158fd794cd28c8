#!/usr/bin/env bash
# refcoll's GPU checks in one go: the GPU tests, the conformance batteries on device
# arrays, the NCCL comparison and the compressor throughput, on a machine with an
# NVIDIA GPU, CuPy, mpi4py and NCCL.
#
#   benchmarks/gpu.sh [RESULTS]     RESULTS: a folder (default: $OUT, else ./gpu-results)
#
# Python: $PYTHON (default python3) lends its packages (CuPy, mpi4py, NCCL) to a
# fresh virtual environment, even when it is itself a virtual environment's.
# Wheels in $REFCOLL_WHEELS (default ./.whl) are installed there without an
# index: an MPI library (the mpich wheel) where mpi4py finds none, and refcoll's
# own wheel; without one, refcoll runs from this checkout. Every step runs, under
# its own time limit (together 550 s), even when one before it failed;
# summary.txt lists each step's exit status and the script exits with the first
# failure's. One rank per GPU: the batteries and the benchmark run on one rank.
#
# Results, nine files:
#   environment.txt   GPU, driver, Python, CuPy, NCCL, MPI; refcoll's device path and why
#   tests.txt         python -m pytest tests/test_gpu.py -v -rs (skips give their reason)
#   verify.txt        refcoll verify --device gpu: the battery (ring, auto, rabenseifner),
#                     then the compressed battery (every compressor, ring)
#   bench_nccl.txt    refcoll bench --device gpu --against nccl -n 1 -b 8 -e 256M -f 4
#   bench_nccl.json   the same as JSON (schema refcoll-bench/1)
#   torch_nccl.txt    refcoll's algorithms over torch's NCCL; verify --backend torch on NCCL
#   compressors.txt   device copy bandwidth, and every compressor's throughput on 256M float32
#   compressors.json  the same as JSON (schema refcoll-gpu-compressors/1)
#   summary.txt       one line per step: its name, exit status and seconds

set -u
cd "$(dirname "$0")/.."
RESULTS=${1:-${OUT:-gpu-results}}
PYTHON=${PYTHON:-python3}
WHEELS=${REFCOLL_WHEELS:-.whl}
VENV=${REFCOLL_GPU_VENV:-${TMPDIR:-/tmp}/refcoll-gpu-venv}
mkdir -p "$RESULTS"
: > "$RESULTS/summary.txt"

"$PYTHON" -m venv --system-site-packages --clear "$VENV" || exit 2
"$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
    > "$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/lender.pth"
PY=$VENV/bin/python
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl || exit 2
fi
if ! compgen -G "$WHEELS/refcoll-*.whl" > /dev/null; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# MPI from the mpich wheel lives in the environment's bin/ and lib/, MPI the lending
# Python had in its own: mpi4py and the tests look for the library and mpiexec there.
lender=$("$PYTHON" -c 'import sys; print(sys.prefix)')
export PATH="$VENV/bin:$PATH:$lender/bin" PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="$VENV/lib:$lender/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

status=0
step() {  # step NAME SECONDS LOG COMMAND...: run COMMAND under a time limit, output added to LOG
    local name=$1 limit=$2 log=$3 start=$SECONDS rc
    shift 3
    echo "== $name" >> "$RESULTS/$log"
    timeout -k 10 "$limit" "$@" >> "$RESULTS/$log" 2>&1
    rc=$?
    echo "$name: exit $rc, $((SECONDS - start)) s" | tee -a "$RESULTS/summary.txt"
    if [ "$status" -eq 0 ] && [ "$rc" -ne 0 ]; then status=$rc; fi
}

step environment 40 environment.txt bash -c '
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$0" - <<"EOF"
import json, platform
import cupy, numpy
from mpi4py import MPI
from refcoll.transport import cuda_aware
print("python", platform.python_version(), "numpy", numpy.__version__, "cupy", cupy.__version__)
runtime = cupy.cuda.runtime
print("cuda runtime", runtime.runtimeGetVersion(), "driver", runtime.driverGetVersion())
try:
    from cupy.cuda import nccl
    print("nccl", nccl.get_version())
except Exception as exc:
    print("nccl: unavailable:", exc)
print("mpi", MPI.Get_library_version().splitlines()[0])
print("libraries", cuda_aware.mpi_library_paths())
print(json.dumps(cuda_aware.device_path(), indent=2))
EOF' "$PY"

step tests 170 tests.txt "$PY" -m pytest tests/test_gpu.py -v -rs -p no:cacheprovider

step verify 60 verify.txt "$PY" -m refcoll verify -n 1 --device gpu \
    --algorithm ring,auto,rabenseifner

step verify_compressed 60 verify.txt "$PY" -m refcoll verify -n 1 --device gpu \
    --compressor all --algorithm ring

step bench_nccl 120 bench_nccl.txt "$PY" -m refcoll bench --device gpu --against nccl \
    -n 1 -b 8 -e 256M -f 4 --json "$RESULTS/bench_nccl.json"

# refcoll's algorithms over torch.distributed's NCCL (the torch transport), then torch's
# own NCCL collectives judged by the oracle; skipped, saying why, without CUDA torch. One
# GPU: one process (NCCL refuses two ranks on one GPU), so the tensor path is what it checks.
step torch_nccl 60 torch_nccl.txt bash -c '
    "$0" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" \
        || { echo "skipped: no torch with CUDA here"; exit 0; }
    script=$(mktemp --suffix .py)
    cat > "$script" <<"EOF"
import numpy as np, torch
import refcoll, refcoll.torch as rt
rt.init_process_group("nccl")
x = torch.arange(4099, dtype=torch.float32, device="cuda") / 7
for a in ["ring", "tree", "rabenseifner", "auto"]:
    got = rt.allreduce(x, algorithm=a).cpu().numpy()
    want = refcoll.simulate("allreduce", [x.cpu().numpy()], algorithm="ring").outputs[0]
    print(a, "same bits as the simulator:", np.array_equal(got.view(np.uint8), want.view(np.uint8)))
EOF
    "$0" -m torch.distributed.run --standalone --nproc-per-node 1 "$script" || exit 1
    "$0" -m torch.distributed.run --standalone --nproc-per-node 1 -m refcoll verify --backend torch \
        --device gpu --sizes 0,1,5003' "$PY"

step compressors 100 compressors.txt "$PY" - "$RESULTS/compressors.json" <<'EOF'
"""Device copy bandwidth and each compressor's throughput on 256M float32 (1 GiB)."""
import json
import sys

sys.path.insert(0, "benchmarks")
from compressors import SPECS  # noqa: E402 - the CPU benchmark's list of compressors

from refcoll.bench import throughput  # noqa: E402
from refcoll.transport import cuda_aware  # noqa: E402

n = 256 << 20
copies = throughput.copy_bandwidth(4 * n)
rows = throughput.compressor_throughput(SPECS, n)
for row in rows:
    row["vs_device_copy"] = row["GBps"] / copies["device_to_device_GBps"]
json.dump({"schema": "refcoll-gpu-compressors/1", "elements": n, "dtype": "float32",
           "copy": copies, "device_path": cuda_aware.device_path(), "rows": rows},
          open(sys.argv[1], "w"), indent=2)
print(f"device copy {copies['device_to_device_GBps']:.0f} GB/s, to host "
      f"{copies['device_to_host_GBps']:.1f} GB/s, "
      f"from host {copies['host_to_device_GBps']:.1f} GB/s")
print(f"{'compressor':<24} {'compress(ms)':>12} {'decompress(ms)':>14} {'GB/s':>8} {'x copy':>7} "
      f"{'ratio':>8}")
for r in rows:
    print(f"{r['spec']:<24} {r['compress_s'] * 1e3:>12.2f} {r['decompress_s'] * 1e3:>14.2f} "
          f"{r['GBps']:>8.1f} {r['vs_device_copy']:>7.3f} {r['ratio']:>8.1f}")
EOF

exit "$status"
