"""reward=math_verify: answer equivalence by math-verify, in worker processes, each sample under a deadline.

math-verify guards its own parsing with signal.alarm, which works only in a main thread; and a pathological
answer (9^{9^{9}}: sympy sets out to compute 9^387420489) runs for minutes. So each sample runs in a worker
process under two deadlines: the worker's own SIGALRM at timeout_s interrupts Python-level work (CPython's
big-integer arithmetic included) and keeps the worker; the parent kills and replaces a worker that has not
answered by timeout_s + kill_grace_s: C code that never returns to the interpreter (gmpy2's arithmetic, which
sympy uses where it is installed, a native crash) is out of a signal handler's reach.
The parent never blocks longer than that per sample; a sample that times out or kills its worker gets a
failure status and wrong_reward, and the batch goes on."""

import logging
import multiprocessing as mp
import os
import re
import signal
import time
import weakref
from collections import deque
from functools import lru_cache
from multiprocessing.connection import wait
from typing import Optional

from qarl_cli.config.reward import MathVerifyRewardConfig
from qarl_cli.reward.base import RewardResult, SampleDetail
from qarl_cli.reward.boxed import has_boxed, last_boxed

_READY = "ready"
# Spawning a worker and importing sympy takes ~1.5 s on an idle core; allow for a busy machine.
_STARTUP_TIMEOUT_S = 120.0
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_INTEGER = re.compile(r"-?\d{1,30}")
# A plain number (GSM8K's, the arithmetic task's, most of AIME's and MATH's gold answers): sign, digits with
# thousands commas, one decimal point.
_PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
# Arithmetic left to do: an operator between two numbers (88+7, 3 \times 4, 6-(2)) or a power (2^3). A fraction
# (1/2, \frac12) is a value, not work left, and passes.
_ARITHMETIC = re.compile(r"\d\s*(?:[-+*\u00d7\u00b7\u00f7\u2212]|\\times|\\cdot|\\div|\\ast)\s*[({]?\s*-?\.?\d|\d\s*\^")
# Completions that, with _test_hooks on, make a worker exit at once / hang with SIGALRM blocked.
TEST_EXIT = "__qarl_test_exit__"
TEST_HANG = "__qarl_test_hang__"
# One of each kind of comparison: numeric, symbolic, interval against tuple.
_WARM_UP = (("\\boxed{1}", "1"), ("\\boxed{(x+1)^2}", "x^2+2x+1"), ("\\boxed{(2,1)}", "(1, 2)"))


# ----------------------------------------------------------------------------------------- worker side


class _Deadline(BaseException):
    """Raised by the worker's SIGALRM. A BaseException, so math-verify's `except Exception` cannot swallow it."""


_armed = False  # the alarm raises only while a sample is being judged, never during pipe I/O


def _on_alarm(signum, frame) -> None:
    if _armed:
        raise _Deadline()


def _as_latex(answer: str) -> str:
    """An extracted answer as one inline math environment, the form math-verify parses most completely:
    `\\%` becomes `%` (math-verify reads `50%` as a percentage equal to both 50 and 0.5, but drops `\\%`)."""
    body = _UNESCAPED_DOLLAR.sub(" ", answer).replace("\\%", "%").replace("\n", " ")
    return f"${body.strip()}$"


@lru_cache(maxsize=4096)  # a group of samples shares one gold answer
def _parse_gold(gold: str) -> list:
    from math_verify import parse

    boxed = last_boxed(gold)
    return parse(_as_latex(gold if boxed is None else boxed), parsing_timeout=None)


def _plain_number(gold: str) -> bool:
    boxed = last_boxed(gold)
    return _PLAIN_NUMBER.fullmatch(_UNESCAPED_DOLLAR.sub("", gold if boxed is None else boxed).strip()) is not None


def unevaluated(answer: str, gold: str) -> bool:
    """Whether `answer` restates arithmetic where the gold answer is a plain number: '88+7' for 95. math-verify
    evaluates both sides and calls them equal, so a policy rewarded for it learns to copy the problem instead
    of solving it (seen on the arithmetic task: accuracy 5% -> 98% in ten steps, all of it copying). Only what
    follows the last '=' counts: '88+7=95' is a worked answer."""
    return _plain_number(gold) and _ARITHMETIC.search(answer.rsplit("=", 1)[-1]) is not None


def _judge(completion: str, gold: str, float_rounding: int, require_evaluated: bool) -> str:
    """The status of one sample, without any deadline (the caller provides it)."""
    from math_verify import parse, verify

    # The last closed \boxed{} is the answer; without one, math-verify's own extraction ("final answer is",
    # "Answer:", the last math environment or number) has its turn.
    boxed = last_boxed(completion)
    if require_evaluated and boxed is not None and unevaluated(boxed, gold):
        return "unevaluated"
    # Fast path for the commonest case (GSM8K, AIME, arithmetic): two plain integers need no LaTeX parser,
    # which costs about 5 ms per answer. Longer digit strings go the general way.
    if boxed is not None and _INTEGER.fullmatch(boxed.strip()) and _INTEGER.fullmatch(gold.strip()):
        return "correct" if int(boxed) == int(gold) else "wrong"
    gold_parsed = _parse_gold(gold)
    if all(isinstance(g, str) for g in gold_parsed):  # nothing, or only the raw text: sympy could not read it
        return "bad_gold"
    pred = parse(_as_latex(boxed), parsing_timeout=None) if boxed is not None else []
    if not pred:
        pred = parse(completion, parsing_timeout=None)
        # parse returns [value, the text it read]: the text is what the policy offered as its answer.
        if require_evaluated and pred and isinstance(pred[-1], str) and unevaluated(pred[-1], gold):
            return "unevaluated"
    if not pred:
        return "no_answer"
    return "correct" if verify(gold_parsed, pred, float_rounding=float_rounding, timeout_seconds=None) else "wrong"


def _test_hook(completion: str) -> None:
    """Only with MathVerifyReward(..., _test_hooks=True): failures no real input triggers on demand."""
    if completion == TEST_EXIT:
        os._exit(70)  # die without a reply, as a segfault would
    if completion == TEST_HANG:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # as C code that never yields to Python
        time.sleep(3600)


def _worker_main(conn, timeout_s: float, float_rounding: int, require_evaluated: bool, memory_mb: int,
                 test_hooks: bool) -> None:
    global _armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then kills us
    if memory_mb:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeouts are off
    # Imports, regex compilation and sympy's lazily loaded simplification code (about 2 s in all) happen here,
    # outside any sample's deadline.
    for completion, gold in _WARM_UP:
        _judge(completion, gold, float_rounding, require_evaluated)
    signal.signal(signal.SIGALRM, _on_alarm)
    conn.send(_READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent is gone
            return
        if task is None:
            return
        completion, gold = task
        try:
            try:
                _armed = True
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
                if test_hooks:
                    _test_hook(completion)
                status = _judge(completion, gold, float_rounding, require_evaluated)
            finally:
                _armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Deadline:
            status = "timeout"
        except Exception:  # RecursionError, MemoryError, a sympy bug: this sample failed, the worker is sound
            status = "crash"
        conn.send(status)


# ----------------------------------------------------------------------------------------- parent side


class _Worker:
    """One worker process and the parent's end of its pipe; `task` is the sample index in flight."""

    def __init__(self, ctx, args: tuple) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, *args), daemon=True, name="qarl-reward")
        self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.task: Optional[int] = None
        self.sent = 0.0


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:  # ask all first, so they exit in parallel
        try:
            w.conn.send(None)
        except OSError:
            pass
    for w in workers:
        w.proc.join(1.0)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join()
        w.conn.close()


class MathVerifyReward:
    """The math_verify scorer (a RewardFn). Workers start in the constructor and warm up while the caller
    goes on; `score` waits for them. Also a TRL-style reward function: `scorer(completions, answer=golds)`.

    `_test_hooks` is for tests only: then a worker handed the completion TEST_EXIT exits without a reply, and
    one handed TEST_HANG hangs beyond the reach of SIGALRM, so the parent's kill path can be tested."""

    def __init__(self, cfg: MathVerifyRewardConfig, *, _test_hooks: bool = False) -> None:
        self.cfg = cfg
        # spawn, not fork: the parent may hold CUDA, vLLM or torch threads that a fork would copy half-way.
        self._ctx = mp.get_context("spawn")
        self._args = (cfg.timeout_s, cfg.float_rounding, cfg.require_evaluated, cfg.worker_memory_mb, _test_hooks)
        self._workers = [_Worker(self._ctx, self._args) for _ in range(cfg.num_workers)]
        self._close = weakref.finalize(self, _stop_all, self._workers)

    def score(self, completions: list[str], golds: list[str]) -> RewardResult:
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
        if not self._close.alive:
            raise RuntimeError("MathVerifyReward.score after close()")
        statuses, seconds = self._run(completions, golds)
        cfg = self.cfg
        rewards, details = [], []
        for text, status, sec in zip(completions, statuses, seconds):
            boxed = has_boxed(text)
            base = cfg.correct_reward if status == "correct" else cfg.wrong_reward
            rewards.append(base - (0.0 if boxed else cfg.format_penalty))
            details.append(SampleDetail(status=status, boxed=boxed, seconds=sec))
        return RewardResult(rewards=rewards, details=details)

    def __call__(self, completions: list, answer: list[str], **_) -> list[float]:
        """TRL reward-function form; chat-format completions are scored on their last message."""
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return self.score(texts, list(answer)).rewards

    def close(self) -> None:
        self._close()

    def __enter__(self) -> "MathVerifyReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, completions: list[str], golds: list[str]) -> tuple[list[str], list[float]]:
        n = len(completions)
        statuses: list[str] = ["crash"] * n  # every sample is assigned below; never left "correct" by mistake
        seconds = [0.0] * n
        todo = deque(range(n))
        hard = self.cfg.timeout_s + self.cfg.kill_grace_s
        try:
            while todo or any(w.task is not None for w in self._workers):
                now = time.monotonic()
                for k, w in enumerate(self._workers):
                    if w.ready and w.task is None and todo:
                        i = todo.popleft()
                        try:
                            w.conn.send((completions[i], golds[i]))
                            w.task, w.sent = i, now
                        except OSError:  # it died while idle (OOM killer, ...): not this sample's fault
                            todo.appendleft(i)
                            self._replace(k)
                waiting = [w for w in self._workers if w.task is not None or not w.ready]
                until = min(w.sent + hard if w.ready else w.started + _STARTUP_TIMEOUT_S for w in waiting)
                answered = wait([w.conn for w in waiting], timeout=max(0.0, until - now))
                now = time.monotonic()
                for k, w in enumerate(self._workers):
                    if w.conn in answered:
                        try:
                            msg = w.conn.recv()
                        except (EOFError, OSError):  # the worker died: segfault, os._exit, SIGKILL
                            if not w.ready:
                                w.proc.join(1.0)
                                raise RuntimeError(f"reward worker exited with code {w.proc.exitcode} "
                                                   "before it was ready") from None
                            statuses[w.task], seconds[w.task] = "crash", now - w.sent
                            self._replace(k)
                            continue
                        if msg == _READY:
                            w.ready = True
                        else:
                            statuses[w.task], seconds[w.task] = msg, now - w.sent
                            w.task = None
                    elif w.task is not None and now >= w.sent + hard:  # stuck where SIGALRM cannot reach
                        statuses[w.task], seconds[w.task] = "timeout", now - w.sent
                        self._replace(k)
                    elif not w.ready and now >= w.started + _STARTUP_TIMEOUT_S:
                        raise RuntimeError(f"reward worker not ready after {_STARTUP_TIMEOUT_S:.0f} s")
        except BaseException:
            # Interrupted (Ctrl-C, an error above): a busy worker would answer into the next batch; replace it.
            for k, w in enumerate(self._workers):
                if w.task is not None:
                    self._replace(k)
            raise
        return statuses, seconds

    def _replace(self, k: int) -> None:
        old = self._workers[k]
        old.proc.kill()
        old.proc.join()
        old.conn.close()
        self._workers[k] = _Worker(self._ctx, self._args)  # same list object: the finalizer sees it
