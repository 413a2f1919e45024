"""The compressed-tensors `quantization_config` block (int8 W8A8 `int-quantized`, W4A16 `pack-quantized`, NVFP4
`nvfp4-pack-quantized`, MXFP4 `mxfp4-pack-quantized`), as
vLLM's CompressedTensorsConfig reads it. Plain JSON: writing a checkpoint does not need compressed-tensors."""

from __future__ import annotations

from typing import Optional


def quant_args(num_bits: int, strategy: str, dynamic: bool, group_size: Optional[int] = None) -> dict:
    """One QuantizationArgs: symmetric integer quantization."""
    return {"num_bits": num_bits, "type": "int", "symmetric": True, "group_size": group_size,
            "strategy": strategy, "block_structure": None, "dynamic": dynamic, "actorder": None,
            "observer": None if dynamic else "minmax", "observer_kwargs": {}}


def fp4_args(group_size: int, strategy: str, dynamic: "bool | str", scale_dtype: str) -> dict:
    """One QuantizationArgs of E2M1 values, as compressed-tensors' NVFP4 / MXFP4 presets serialize them
    (`quantization/quant_scheme.py`); dynamic="local": a static global scale with dynamic block scales."""
    observer = None if dynamic is True else ("static_minmax" if dynamic == "local" else "memoryless_minmax")
    return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": group_size, "strategy": strategy,
            "block_structure": None, "dynamic": dynamic, "actorder": None, "scale_dtype": scale_dtype,
            "zp_dtype": None, "observer": observer, "observer_kwargs": {}}


def config_block(fmt: str, weights: dict, input_activations: Optional[dict], ignore: list[str]) -> dict:
    """All Linear layers but `ignore` (exact module names) use one scheme; the tensors are already compressed."""
    group = {"targets": ["Linear"], "weights": weights, "input_activations": input_activations,
             "output_activations": None, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": sorted(ignore), "kv_cache_scheme": None,
            "global_compression_ratio": None}
