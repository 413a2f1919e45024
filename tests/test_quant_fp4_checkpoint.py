"""`qarl quantize quant=nvfp4|mxfp4`: the checkpoint's tensors have the names, dtypes and shapes vLLM's
compressed-tensors schemes allocate, decode through compressed-tensors' own decompressor (and, for nvfp4, vLLM's
weight dequantization after its load-time processing) bit for bit to the reference's values and scales, fused
layers share their global scale, and the config block is what both libraries parse as the format."""

import json

import pytest
import torch

from qarl_cli.config.quant import MxFp4Config, NvFp4Config
from qarl_cli.quant import build_scheme, fp4, mxfp4, nvfp4
from qarl_cli.quant.checkpoint import load_meta_model, plan_for, quantized_state, write_checkpoint

CASES = {"nvfp4": NvFp4Config(), "nvfp4_a16": NvFp4Config(activations=False), "mxfp4": MxFp4Config()}


def _ct_scheme(out):
    from compressed_tensors.quantization import QuantizationConfig

    block = json.loads((out / "config.json").read_text())["quantization_config"]
    return block, QuantizationConfig.model_validate(block).config_groups["group_0"]


def _reference(name, original, prefix):
    """The reference's codes and scales for one matrix, its nvfp4 global scale from its fused group's amax."""
    w = original[f"{prefix}.weight"].float()
    if name == "mxfp4":
        codes, e8m0 = mxfp4.quantize_ref(w)
        return codes, e8m0, None
    group = nvfp4.fused_group(prefix)
    amax = torch.stack([t.float().abs().amax() for k, t in original.items()
                        if k.endswith(".weight") and nvfp4.fused_group(k.removesuffix(".weight")) == group]).amax()
    p = nvfp4.quantize_weight_ref(w, amax)
    return fp4.unpack_e2m1(p["weight_packed"]), p["weight_scale"], p["weight_global_scale"]


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("name", list(CASES))
def test_written_tensors_decode_through_compressed_tensors_to_the_reference(models, tmp_path, kind, name, read):
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    scheme = build_scheme(CASES[name], "cpu")
    out = tmp_path / "out"
    write_checkpoint(models[kind], out, scheme, progress=False)
    original, written = read(models[kind]), read(out)
    plan = plan_for(load_meta_model(models[kind]), scheme)
    block, ct_scheme = _ct_scheme(out)
    compressor = BaseCompressor.get_value_from_registry(block["format"])
    block_size = 32 if name == "mxfp4" else 16
    checked = 0
    for key in sorted(plan.quantized):
        prefix = key.removesuffix(".weight")
        n, k = original[key].shape
        expected = {"weight_packed": (torch.uint8, (n, k // 2)),
                    "weight_scale": (torch.uint8 if name == "mxfp4" else torch.float8_e4m3fn, (n, k // block_size))}
        if name != "mxfp4":
            expected["weight_global_scale"] = (torch.float32, (1,))
        if name == "nvfp4":
            expected["input_global_scale"] = (torch.float32, (1,))
        parts = {s: t for s, t in written.items() if s.rsplit(".", 1)[0] == prefix}
        assert {s.rsplit(".", 1)[1]: (t.dtype, tuple(t.shape)) for s, t in parts.items()} == expected, key
        local = {s.rsplit(".", 1)[1]: t for s, t in parts.items()}
        codes, scale, g = _reference(name, original, prefix)
        decoded = compressor.decompress(dict(local), ct_scheme)
        values = unpack_fp4_from_uint8(local["weight_packed"], n, k, dtype=torch.float32)
        assert torch.equal(values, fp4.decode_e2m1(codes)), key  # the E2M1 values, -0 included
        if name == "mxfp4":
            assert torch.equal(local["weight_scale"], scale), key
            step = mxfp4.exponent_scale(scale).repeat_interleave(32, -1)
            assert torch.equal(decoded["weight"], (values * step).to(decoded["weight"].dtype)), key
        else:
            assert torch.equal(local["weight_scale"].view(torch.uint8), scale.view(torch.uint8)), key
            assert torch.equal(local["weight_global_scale"], g), key
            step = (decoded["weight_scale"].float() / g).repeat_interleave(16, -1)  # compressed-tensors' s / g
            assert torch.equal(decoded["weight"], (values * step).to(decoded["weight"].dtype)), key
        checked += 1
    assert checked == len(plan.quantized) == (28 if kind == "dense" else 32)
    for key, t in original.items():
        if key not in plan.quantized:
            assert torch.equal(written[key], t), key  # embeddings, norms, lm_head, router


def test_fused_layers_share_the_global_scale_and_vllm_dequantizes_the_reference(models, tmp_path, read):
    """vLLM serves q/k/v (gate/up) as one layer scaled by the largest of their global scales: they are equal, so
    its dequantization (dequantize_to_dtype with 1 / g, what process_weights_after_loading keeps) is ours."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    scheme = build_scheme(NvFp4Config(input_amax=100.0), "cpu")
    write_checkpoint(models["moe"], tmp_path / "out", scheme, progress=False)
    written = read(tmp_path / "out")
    for layer in ("model.layers.0.self_attn", "model.layers.1.mlp.experts.3"):
        projs = ("q_proj", "k_proj", "v_proj") if "attn" in layer else ("gate_proj", "up_proj")
        scales = {written[f"{layer}.{p}.weight_global_scale"].item() for p in projs}
        assert len(scales) == 1, layer
    g_in = torch.tensor([448.0 * 6]) / torch.tensor([100.0])  # fp32, as the checkpoint holds it
    assert torch.equal(written["model.layers.0.self_attn.o_proj.input_global_scale"], g_in)
    prefix = "model.layers.0.self_attn.k_proj"
    packed = {s: written[f"{prefix}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale")}
    inv = 1.0 / packed["weight_global_scale"].max()
    ours = scheme.dequantize(packed, torch.bfloat16)
    assert torch.equal(ours, dequantize_to_dtype(packed["weight_packed"], packed["weight_scale"], inv,
                                                 torch.bfloat16, 16, swizzle=False))


def test_config_blocks_are_what_vllm_and_compressed_tensors_parse(models, tmp_path):
    from compressed_tensors.compressors.base import BaseCompressor
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)

    plan = plan_for(load_meta_model(models["moe"]), build_scheme(MxFp4Config(), "cpu"))
    for name, cfg in CASES.items():
        block = build_scheme(cfg, "cpu").quantization_config(list(plan.kept))
        config = CompressedTensorsConfig.from_config(json.loads(json.dumps(block)))
        parts = config.target_scheme_map["Linear"]
        weights, acts = parts["weights"], parts["input_activations"]
        if name == "mxfp4":
            assert config._is_mxfp4(weights) and not config._is_mxfp4_w4a8_fp8(weights, acts)
        else:
            assert config._is_nvfp4_format(weights) and (acts is None) == (name == "nvfp4_a16")
            assert acts is None or (config._is_nvfp4_format(acts) and acts.dynamic == "local")
        assert config.ignore == list(plan.kept)
        assert BaseCompressor.get_value_from_registry(block["format"]).__name__ == \
            ("MXFP4PackedCompressor" if name == "mxfp4" else "NVFP4PackedCompressor")


def test_the_synced_state_of_an_aligned_model_is_the_checkpoint(models, tmp_path, read):
    """What the in-place sync sends (quantized_state of the aligned trainer) equals the written checkpoint."""
    from transformers import AutoModelForCausalLM

    from qarl_cli.forward.aligned import align

    scheme = build_scheme(NvFp4Config(), "cpu")
    write_checkpoint(models["dense"], tmp_path / "out", scheme, progress=False)
    model = align(AutoModelForCausalLM.from_pretrained(str(models["dense"]), dtype=torch.float32), scheme)
    sent, written = dict(quantized_state(model, scheme)), read(tmp_path / "out")
    assert sent.keys() == written.keys()
    for key, t in written.items():
        bits = (lambda x: x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x)
        assert torch.equal(bits(sent[key]), bits(t)), key
