"""One vLLM server as qarl sees it (rollout=vllm_server): a process qarl started, or a URL it was given. Started
from one long-lived thread with the parent-death signal and in its own process group, so that stop() ends the
server with its engine core and workers, and a qarl killed outright takes it along; requests carry the run's key."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Optional

from qarl_cli.config.errors import UserError
from qarl_cli.machine.signals import die_with_parent

NAME = "rollout=vllm_server"

# An exception's last line, as a traceback ends: "pkg.module.SomeError: message". vLLM's processes prefix their
# lines with "(EngineCore pid=N) "; a traceback that vLLM logs (a multiprocess executor's worker, as on AVX2 CPUs)
# also carries the record's level, time and source: "(Worker pid=N) ERROR 12-04 15:49:54 [file.py:953] ".
_EXCEPTION = re.compile(r"^(?:\([\w ]+ pid=\d+\) )?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]+\] )?"
                        r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?:: .*)?)$")


def first_exception(log: str, limit: int = 400) -> str:
    """The first exception of a log (the root cause of what followed), with the indented lines that continue its
    message (pydantic's "1 validation error for X" says what only on the next line); else the last line."""
    lines = [ln.rstrip() for ln in log.splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        match = _EXCEPTION.match(line.strip())
        if match:
            more = []
            for cont in lines[i + 1:]:
                if not cont.startswith(" ") or cont.strip().startswith(("File ", "For further information")):
                    break
                more.append(cont.strip())
            text = " ".join([match.group(1), *more])
            return text if len(text) <= limit else text[:limit - 3] + "..."
    return lines[-1].strip() if lines else "an empty log"


def _reason(e: Exception) -> str:
    """A connection error's cause in a few words (requests nests the socket error deep in its message)."""
    text = str(e)
    for needle, words in (("Connection refused", "connection refused"), ("Name or service not known", "no such host"),
                          ("No route to host", "no route to host"), ("timed out", "connection timed out")):
        if needle in text:
            return words
    return type(e).__name__


class ServerDied(RuntimeError):
    """A server stopped answering (its process exited, the connection was refused or reset)."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Launcher:
    """Starts every server process from one thread that lives as long as this process: the parent-death signal
    fires when the *thread* that forked the child ends, so a server started from a request's worker thread (a
    restart) would be killed as soon as that thread finished."""

    _lock = threading.Lock()
    _queue: Any = None

    @classmethod
    def popen(cls, *args, **kwargs) -> subprocess.Popen:
        import queue

        with cls._lock:
            if cls._queue is None:
                cls._queue = queue.Queue()
                threading.Thread(target=cls._serve, name="qarl-server-launcher", daemon=True).start()
        answer: "queue.Queue" = queue.Queue(1)
        cls._queue.put((args, kwargs, answer))
        result = answer.get()
        if isinstance(result, BaseException):
            raise result
        return result

    @classmethod
    def _serve(cls) -> None:
        while True:
            args, kwargs, answer = cls._queue.get()
            try:
                answer.put(subprocess.Popen(*args, **kwargs, start_new_session=True, preexec_fn=die_with_parent))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                answer.put(e)


class Server:
    """One vLLM server: a process qarl started (`command` given) or a URL it was told about."""

    def __init__(self, index: int, url: str, key: str, command: Optional[list[str]] = None,
                 env: Optional[dict] = None, log: Optional[Path] = None, timeout: float = 600.0,
                 attach_grace: Optional[float] = None) -> None:
        import requests

        self.index, self.url, self.command, self.env, self.log = index, url.rstrip("/"), command, env, log
        self.timeout = timeout
        self.attach_grace = attach_grace  # an attached server (no command): rollout.attach_grace_s
        self.headers = {"Authorization": f"Bearer {key}"}
        self.proc: Optional[subprocess.Popen] = None
        self.stopped = False  # stop() was called: a start under way gives up (Ctrl-C during start-up)
        self.local = threading.local()  # one HTTP session per thread
        self.restarts = 0
        self._requests = requests

    def session(self):
        if not hasattr(self.local, "session"):
            self.local.session = self._requests.Session()
        return self.local.session

    def start(self, startup_timeout: float) -> None:
        self.stopped = False
        if self.command is None:
            self.wait_healthy(startup_timeout)
            return
        with open(self.log, "ab") as out:
            self.proc = _Launcher.popen(self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        if self.stopped:  # stopped while it was being launched
            self.stop()
        self.wait_healthy(startup_timeout)

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def wait_healthy(self, timeout: float) -> None:
        """Until /health answers 200. A server qarl started may take `timeout` (loading); an attached one that
        nothing answers for at any attempt over its attach grace (connection refused, no such host) is not coming."""
        deadline = time.monotonic() + timeout
        unreachable_since: Optional[float] = None
        while True:
            if self.stopped:
                raise UserError(f"{NAME}: server {self.index} ({self.url}) was stopped while starting")
            if not self.alive():
                raise UserError(f"{NAME}: server {self.index} ({self.url}) exited with code {self.proc.returncode} "
                                f"while starting: {self.root_cause()} (log: {self.log})")
            try:
                if self.session().get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
                unreachable_since = None  # it answers: starting
            except self._requests.RequestException as e:
                if self.command is None:
                    unreachable_since = unreachable_since or time.monotonic()
                    if time.monotonic() - unreachable_since > self.attach_grace:
                        raise UserError(f"{NAME}: nothing answers at {self.url} (rollout.urls[{self.index}]: "
                                        f"{_reason(e)} for {self.attach_grace:g} s, rollout.attach_grace_s); start "
                                        "the server first (qarl serve) or fix the address") from None
            if time.monotonic() > deadline:
                raise UserError(f"{NAME}: server {self.index} ({self.url}) not healthy after {timeout:.0f} s "
                                f"(rollout.startup_timeout_s)" + (f"; the last lines of {self.log}:\n{self.tail()}"
                                                                  if self.log else ""))
            time.sleep(0.5)

    def root_cause(self) -> str:
        """The first exception the server's log names: vLLM logs the engine core's own error first and then the
        front end's "Engine core initialization failed. See root cause above." (the last lines hold only that)."""
        try:
            text = Path(self.log).read_text(errors="replace")
        except (OSError, TypeError):
            return "no log"
        return first_exception(text)

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-lines:])
        except (OSError, TypeError):
            return ""

    def post(self, path: str, body: Optional[dict] = None, params: Optional[dict] = None,
             timeout: Optional[float] = None) -> Any:
        """POST to the server; its JSON answer. ServerDied when it is gone; RuntimeError naming the route and the
        server's message when it answers with an error."""
        return self._request("post", path, json=body, params=params, timeout=timeout)

    def get(self, path: str, timeout: Optional[float] = None) -> Any:
        """GET from the server (as post)."""
        return self._request("get", path, timeout=timeout)

    def _request(self, method: str, path: str, timeout: Optional[float] = None, **kwargs) -> Any:
        try:
            r = self.session().request(method, f"{self.url}{path}", headers=self.headers,
                                       timeout=timeout or self.timeout, **kwargs)
        except (self._requests.ConnectionError, self._requests.Timeout,
                self._requests.exceptions.ChunkedEncodingError) as e:  # the last: it died mid-answer
            raise ServerDied(f"server {self.index} ({self.url}): {type(e).__name__}") from e
        if r.status_code >= 500 and not self.alive():
            raise ServerDied(f"server {self.index} ({self.url}) exited (code {self.proc.returncode})")
        if r.status_code != 200:
            raise RuntimeError(f"{NAME}: server {self.index} {path} answered {r.status_code}: {r.text[:300]}")
        return r.json() if r.content else None

    def stop(self, grace: float = 15.0) -> None:
        self.stopped = True
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)  # the server and its engine core and workers
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # a group member that outlived its leader (an orphaned worker)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
