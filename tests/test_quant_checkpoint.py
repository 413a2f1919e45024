"""`qarl quantize` and its writer: quantize -> save -> load -> dequantize equals the reference for every scheme
(dense and MoE), the tensor names, dtypes and shapes vLLM's loaders create, the config blocks as vLLM parses
them, the in-memory `quantized_state` equal to the written checkpoint, and the refusals."""

import json
import math

import pytest
import torch
from safetensors import safe_open

from qarl_cli.cli import main
from qarl_cli.config.errors import ConfigError
from qarl_cli.config.quant import SCHEMAS
from qarl_cli.quant import build_scheme
from qarl_cli.quant.checkpoint import plan_for, quantized_state, write_checkpoint

SCHEMES = ["int8", "fp8_block", "w4a16", "none"]


def _meta(path):
    from qarl_cli.quant.checkpoint import load_meta_model

    return load_meta_model(path)


def _expected_layout(name, n, k, dtype, scheme):
    """What vLLM's create_weights allocates per linear layer (see the module docstrings of the schemes); W4A16
    scales in the scheme's scale dtype (the engine's), whatever the weights' dtype."""
    return {
        "int8": {"weight": (torch.int8, (n, k)), "weight_scale": (torch.float32, (n, 1))},
        "fp8_block": {"weight": (torch.float8_e4m3fn, (n, k)),
                      "weight_scale_inv": (torch.float32, (math.ceil(n / 128), math.ceil(k / 128)))},
        "w4a16": {"weight_packed": (torch.int32, (n, k // 8)), "weight_scale": (scheme.scale_dtype() if name == "w4a16" else None, (n, k // 128)),
                  "weight_shape": (torch.int64, (2,))},
        "none": {"weight": (dtype, (n, k))},
    }[name]


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("name", SCHEMES)
def test_quantize_save_load_dequantize_equals_the_reference(models, tmp_path, kind, name, read):
    src = models[kind]
    scheme = build_scheme(SCHEMAS[name](), "cpu")
    summary = write_checkpoint(src, tmp_path / "out", scheme, progress=False)
    original, written = read(src), read(tmp_path / "out")
    plan = plan_for(_meta(src), scheme)
    assert summary["quantized"] == len(plan.quantized) == (0 if name == "none" else (28 if kind == "dense" else 32))
    for key, w in original.items():
        prefix = key.removesuffix(".weight")
        if key not in plan.quantized:
            assert torch.equal(written[key], w), key  # embeddings, norms, lm_head, router: unchanged
            continue
        layout = _expected_layout(name, *w.shape, w.dtype, scheme)
        packed = {s: written[f"{prefix}.{s}"] for s in layout}
        assert {s: (t.dtype, tuple(t.shape)) for s, t in packed.items()} == layout, key
        reference = scheme.fake_quant_weight(w)
        assert torch.equal(scheme.dequantize(packed, w.dtype), reference), key
        if name == "w4a16":
            assert packed["weight_shape"].tolist() == list(w.shape)
    for kept in ("lm_head.weight", "model.layers.0.mlp.gate.weight"):
        if kept in original:
            assert written[kept].dtype == original[kept].dtype and torch.equal(written[kept], original[kept])
    out = tmp_path / "out"
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / file).read_bytes() == (src / file).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert ("quantization_config" in config) == (name != "none")


def test_config_blocks_are_what_vllm_parses(models):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    plan = plan_for(_meta(models["moe"]), build_scheme(SCHEMAS["int8"](), "cpu"))
    assert plan.kept == ("lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate")
    expected = {"int8": "CompressedTensorsW8A8Int8", "w4a16": "CompressedTensorsWNA16"}
    for name, cls in expected.items():
        block = build_scheme(SCHEMAS[name](), "cpu").quantization_config(list(plan.kept))
        ct = pytest.importorskip("compressed_tensors.quantization")
        ct.QuantizationConfig.model_validate(block)
        config = CompressedTensorsConfig.from_config(json.loads(json.dumps(block)))
        assert config.ignore == list(plan.kept)
        parts = config.target_scheme_map["Linear"]
        scheme = config._get_scheme_from_parts(parts["weights"], parts["input_activations"],
                                               format=parts["format"])
        assert type(scheme).__name__ == cls
    block = build_scheme(SCHEMAS["fp8_block"](), "cpu").quantization_config(list(plan.kept))
    fp8 = Fp8Config.from_config(block)
    assert fp8.weight_block_size == [128, 128] and fp8.ignored_layers == list(plan.kept)
    assert fp8.activation_scheme == "dynamic" and fp8.is_checkpoint_fp8_serialized


@pytest.mark.parametrize("name", ["int8", "fp8_block", "w4a16"])
def test_quantized_state_of_the_model_in_memory_is_the_checkpoint(models, tmp_path, name, read):
    """transformers 5 holds the MoE experts fused; the state for the engine comes out per expert, equal to the
    checkpoint written from files."""
    from transformers import AutoModelForCausalLM

    scheme = build_scheme(SCHEMAS[name](), "cpu")
    write_checkpoint(models["moe"], tmp_path / "out", scheme, progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(models["moe"]), dtype=torch.float32)
    state = dict(quantized_state(model, scheme))
    written = read(tmp_path / "out")
    assert set(state) == set(written)
    for key, t in written.items():
        assert torch.equal(state[key].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else state[key],
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), key


def test_sharded_input_is_written_shard_by_shard(models, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(models["dense"])).save_pretrained(str(src), max_shard_size="300KB")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (src / file).write_bytes((models["dense"] / file).read_bytes())
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) > 1
    write_checkpoint(src, tmp_path / "out", build_scheme(SCHEMAS["w4a16"](), "cpu"), progress=False)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    written = {}
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            written.update(dict.fromkeys(f.keys(), shard))
    assert index["weight_map"] == written and "model.layers.3.mlp.down_proj.weight_packed" in written


def test_refuses_bad_inputs_and_existing_outputs(models, tmp_path):
    scheme = build_scheme(SCHEMAS["int8"](), "cpu")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ConfigError, match="not a causal-LM checkpoint"):
        write_checkpoint(bert, tmp_path / "o1", scheme, progress=False)
    write_checkpoint(models["dense"], tmp_path / "int8", scheme, progress=False)
    with pytest.raises(ConfigError, match="already quantized"):
        write_checkpoint(tmp_path / "int8", tmp_path / "o2", scheme, progress=False)
    with pytest.raises(ConfigError, match="already exists; pass overwrite=true"):
        write_checkpoint(models["dense"], tmp_path / "int8", scheme, progress=False)
    fp8 = build_scheme(SCHEMAS["fp8_block"](), "cpu")
    write_checkpoint(models["dense"], tmp_path / "int8", fp8, overwrite=True, progress=False)
    assert json.loads((tmp_path / "int8" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert not list(tmp_path.glob(".*tmp*"))


def test_a_failed_write_leaves_no_output(models, tmp_path, monkeypatch):
    scheme = build_scheme(SCHEMAS["int8"](), "cpu")
    calls = []

    def failing(prefix, w):
        calls.append(prefix)
        if len(calls) == 5:
            raise RuntimeError("disk full")
        return [(f"{prefix}.weight", w)]

    monkeypatch.setattr(scheme, "checkpoint_tensors", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        write_checkpoint(models["dense"], tmp_path / "out", scheme, progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the output nor the temporary directory


def test_cli(models, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "moe-w4a16"
    assert main(["quantize", "model=hf", f"model.path={models['moe']}", "quant=w4a16", f"out={out}"]) == 0
    assert "32 weights quantized" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    summary = json.loads(next(tmp_path.glob("outputs/*/*/quantize.json")).read_text())
    assert summary["kept"] == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert main(["quantize", "model=hf", f"model.path={models['moe']}", "quant=int8", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0]
    assert main(["quantize", "model=hf", f"model.path={out}", "quant=int8", f"out={tmp_path / 'again'}"]) == 2
    assert "already quantized" in capsys.readouterr().err


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_every_width_decodes_through_compressed_tensors(models, tmp_path, monkeypatch, capsys, bits, read):
    """`qarl quantize quant=wna16 quant.bits=N`: compressed-tensors' own pack-quantized decompressor reads the
    checkpoint back to q * scale, q being what its quantizer makes of the weights at our scales (round to nearest
    even, clamped to the width), and vLLM parses the block as its WNA16 scheme of that width."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)

    monkeypatch.chdir(tmp_path)
    out = tmp_path / f"w{bits}"
    assert main(["quantize", "model=hf", f"model.path={models['dense']}", "quant=wna16", f"quant.bits={bits}",
                 "quant.group_size=32", f"out={out}"]) == 0
    assert "28 weights quantized" in capsys.readouterr().out
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    args = QuantizationConfig.model_validate(block).config_groups["group_0"]
    assert args.weights.num_bits == bits and args.weights.group_size == 32 and args.weights.symmetric
    compressor = BaseCompressor.get_value_from_registry(block["format"])
    original, written = read(models["dense"]), read(out)
    plan = plan_for(_meta(models["dense"]), build_scheme(SCHEMAS["wna16"](bits=bits, group_size=32), "cpu"))
    for key in sorted(plan.quantized):
        prefix = key.removesuffix(".weight")
        n, k = original[key].shape
        local = {s: written[f"{prefix}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
        assert tuple(local["weight_packed"].shape) == (n, math.ceil(k / (32 // bits))), key
        assert tuple(local["weight_scale"].shape) == (n, k // 32), key
        scale = local["weight_scale"]
        q = quantize(original[key].float(), scale.float(), torch.zeros_like(scale, dtype=torch.int8), args.weights)
        decoded = compressor.decompress(dict(local), args)
        expected = q * scale.float().repeat_interleave(32, -1)
        assert torch.equal(decoded["weight"].float(), expected.to(decoded["weight"].dtype).float()), key
        assert q.abs().max() <= 2 ** (bits - 1)
    config = CompressedTensorsConfig.from_config(block)
    parts = config.target_scheme_map["Linear"]
    scheme = config._get_scheme_from_parts(parts["weights"], parts["input_activations"], format=parts["format"])
    assert type(scheme).__name__ == "CompressedTensorsWNA16" and scheme.num_bits == bits
