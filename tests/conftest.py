"""Shared fixtures. Tests never touch the network; built models go to QARL_CACHE_DIR (the Makefile points it
into the checkout, so a clean clone builds from scratch)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped here, run by scripts/gpu_check.sh on a machine that has one."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs it on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
