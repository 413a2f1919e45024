#!/usr/bin/env bash
# as_cpu_kind.sh KIND COMMAND...: run COMMAND as if on another of the CPU kinds these machines come in.
#   avx2  emulated in software (scripts/cpu_kind/sitecustomize.py): vLLM's AVX2 kernel library and attention,
#         torch's and oneDNN's AVX2 kernels, and qarl's capability answers for an AMD EPYC with AVX2 only.
#         Needs a CPU with AVX-512 or AVX2 (what runs here runs there).
#   epyc  qarl's answers forced to an AMD EPYC with AVX-512, VNNI and BF16, no AMX (QARL_CPU_FLAGS)
#   amx   qarl's answers forced to an Intel Xeon with AMX (QARL_CPU_FLAGS): vLLM itself still sees this CPU,
#         so a test that starts vLLM on an AMX-only kernel meets the branch "told AMX on a CPU without"
# e.g. scripts/as_cpu_kind.sh avx2 make test
set -euo pipefail
kind=${1:?usage: as_cpu_kind.sh avx2|epyc|amx COMMAND...}; shift
here=$(cd "$(dirname "$0")" && pwd)
avx2="avx2 fma f16c"
epyc="$avx2 avx512f avx512_vnni avx512_bf16"
case $kind in
  avx2) export QARL_EMULATE_CPU=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 QARL_CPU_FLAGS="$avx2"
        export PYTHONPATH="$here/cpu_kind${PYTHONPATH:+:$PYTHONPATH}" ;;
  epyc) export QARL_CPU_FLAGS="$epyc" ;;
  amx)  export QARL_CPU_FLAGS="$epyc amx_tile amx_int8 amx_bf16" ;;
  *) echo "as_cpu_kind.sh: unknown kind '$kind' (avx2, epyc or amx)" >&2; exit 2 ;;
esac
exec "$@"
