"""Shared fixtures. Tests never touch the network; built models go to QARL_CACHE_DIR (the Makefile points it
into the checkout, so a clean clone builds from scratch)."""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Several xdist workers share the machine's cores, and each torch pool (and each run, engine and rank a test starts,
# which inherit it) would otherwise span all of them: two pools spin against each other, and one model's update
# then took 5 times as long as alone (docs/design.md, "Tests and benchmarks"). One thread each unless told
# otherwise; `vllm serve` processes still get their cores' count (qarl_cli.rollout.server_launch).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# Without a GPU, the Triton kernels run under Triton's interpreter, which must be set up before the kernels are
# decorated; importing transformers' AutoTokenizer during collection (with gguf installed) leaves them unable
# to launch ("Cannot call @triton.jit'd outside of the scope of a kernel"). So on CPU that module runs in a
# process of its own (test_triton_interpreter.py starts it with QARL_TRITON_ALONE=1), never beside the others.
collect_ignore = [] if os.environ.get("QARL_TRITON_ALONE") == "1" else ["test_quant_triton.py"]


def _heaviest_files_first(items) -> None:
    """Two xdist workers take whole files (`--dist loadfile`), the next one whenever they are nearly done. In
    xdist's own order (most tests first) the few files that start vLLM servers or torchrun come last, and one
    worker runs them alone while the other idles: order the files by their measured seconds instead
    (tests/file_seconds.json, written by scripts/test_durations.py; a file not listed goes last). A stable sort,
    so each file's tests keep their order."""
    seconds = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
    items.sort(key=lambda item: -seconds.get(item.path.name, 0.0))


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped here, run by scripts/gpu_check.sh on a machine that has one."""
    _heaviest_files_first(items)
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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny dense and MoE models, untrained (their weights are what a checkpoint test reads back), built per
    module into its own cache."""
    from qarl_cli.config.model import TinyModelConfig, TinyMoEModelConfig
    from qarl_cli.models.tiny import ensure_tiny_model

    cache = str(tmp_path_factory.mktemp("models"))
    return {"dense": ensure_tiny_model(TinyModelConfig(cache_dir=cache, warm_start_steps=0), log=lambda _: None),
            "moe": ensure_tiny_model(TinyMoEModelConfig(cache_dir=cache, warm_start_steps=0), log=lambda _: None)}


def read_safetensors(path):
    """Every tensor of a checkpoint directory's safetensors files, by name."""
    from safetensors import safe_open

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture
def read():
    return read_safetensors
