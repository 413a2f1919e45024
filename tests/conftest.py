"""Shared fixtures. Tests never touch the network; built models go to QARL_CACHE_DIR (the Makefile points it
into the checkout, so a clean clone builds from scratch)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402

# Without a GPU, the Triton kernels run under Triton's interpreter, which must be set up before the kernels are
# decorated; importing transformers' AutoTokenizer during collection (with gguf installed) leaves them unable
# to launch ("Cannot call @triton.jit'd outside of the scope of a kernel"). So on CPU that module runs in a
# process of its own (test_triton_interpreter.py starts it with QARL_TRITON_ALONE=1), never beside the others.
collect_ignore = [] if os.environ.get("QARL_TRITON_ALONE") == "1" else ["test_quant_triton.py"]


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
