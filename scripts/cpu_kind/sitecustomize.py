"""Run a process as if on another CPU kind, as far as software can: loaded by Python at start-up from PYTHONPATH
(scripts/as_cpu_kind.sh puts this folder there), so every process of a run sees it, vLLM's engines and servers
and torchrun's ranks included.

QARL_EMULATE_CPU=avx2 makes torch.cpu report no AVX-512, VNNI, BF16 or AMX. vLLM reads exactly those answers:
it loads its AVX2 kernel library (vllm/_C_AVX2, which lacks cpu_gemm_wna16 and the fp8 and fused-MoE ops) and
picks its AVX2 attention. as_cpu_kind.sh also sets ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2, so
torch's and oneDNN's own kernels are the AVX2 ones (oneDNN's int8 GEMM then sums pairs into a saturating int16,
as it does on a CPU without VNNI), and QARL_CPU_FLAGS, so that qarl's capability answers agree. torch is patched
when it is first imported, not here: a process that never imports torch (`qarl --help`) stays torch-free."""

import importlib.abc
import importlib.machinery
import os
import sys

_FALSE = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
          "_is_amx_tile_supported", "_is_amx_fp16_supported")


class _PatchTorchCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            for attr in _FALSE:
                if hasattr(module, attr):
                    setattr(module, attr, lambda: False)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("QARL_EMULATE_CPU") == "avx2":
    sys.meta_path.insert(0, _PatchTorchCpu())
