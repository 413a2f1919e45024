"""The handshake with a vLLM server before anything is sent to it (rollout=vllm_server, attached or launched): the
run's key, then what the server serves against what the run would serve, each difference one line naming the
option and both values, before a sample is drawn or a byte of weights is sent.

What a server says of itself: its key guard answers a keyed route (/weight_info, with the weight version); vLLM's
/server_info (the dev routes qarl's servers run with) its dtype and weight-transfer backend; and its served model
names (/v1/models) hold the identity qarl gave it (`identity`: the source model, the scheme and a fingerprint of
the checkpoint it loaded), which `qarl serve` and qarl's own launches both set (server_launch.server_command). A server
started without it is refused: whatever it serves, qarl cannot tell that pushing the run's tensors into it is
safe (another model's, or int8 parameters fed float32 ones, break it for every client)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from qarl_cli.config.errors import UserError

PREFIX = "qarl:"  # a served model name of this form is the identity
WHOLE_BYTES = 1 << 30  # files up to this size are hashed whole; larger ones by header and sampled chunks
SAMPLES, CHUNK = 64, 1 << 20
START_VERSIONS = (None, "", "0", "default")  # what a server reports before any push ("default": vLLM 0.32's)


def fingerprint(ckpt: Path) -> str:
    """sha256 over a checkpoint directory's config.json and its safetensors files (whole up to WHOLE_BYTES, else
    their header, size and SAMPLES chunks spread over the file: a 60 GB model is fingerprinted in a second)."""
    h = hashlib.sha256()
    ckpt = Path(ckpt)
    for file in [ckpt / "config.json", *sorted(ckpt.glob("*.safetensors"))]:
        h.update(file.name.encode())
        size = file.stat().st_size
        h.update(str(size).encode())
        with open(file, "rb") as f:
            if size <= WHOLE_BYTES:
                while block := f.read(1 << 22):
                    h.update(block)
                continue
            for i in range(SAMPLES):
                f.seek(i * (size - CHUNK) // (SAMPLES - 1))
                h.update(f.read(CHUNK))
    return h.hexdigest()[:16]


def identity(source: Path, served: Path, quant: str) -> str:
    """The served model name that says what a server loaded: source model, scheme, fingerprint of the checkpoint."""
    return f"{PREFIX}model={Path(source).name}:quant={quant}:fp={fingerprint(served)}"


def _fields(identity: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in identity[len(PREFIX):].split(":") if "=" in part)


def check(server: Any, expected_identity: str, dtype: str, backend: str) -> None:
    """UserError in one line unless `server` takes the run's key and serves `expected_identity` in `dtype` with
    transfer backend `backend`, at its start-up weights (no other run's push)."""
    where = f"rollout=vllm_server: server {server.index} ({server.url})"
    try:
        info = server.get("/weight_info", timeout=30)
    except RuntimeError as e:
        if " answered 401" in str(e):
            raise UserError(f"{where} refused the run's key: set rollout.api_key (or QARL_SERVER_KEY) to the key it "
                            "was started with (qarl serve prints where it is)") from None
        raise
    try:
        config = server.get("/server_info?config_format=json", timeout=120)["vllm_config"]
    except RuntimeError as e:
        if " answered 404" not in str(e):
            raise
        raise UserError(f"{where} has no /server_info: it was not started by qarl (start it with `qarl serve`, "
                        "which runs the routes qarl checks a server with)") from None
    model = config.get("model_config") or {}
    names = [card.get("id") for card in (server.get("/v1/models", timeout=30) or {}).get("data", [])]
    theirs = next((n for n in names if str(n).startswith(PREFIX)), None)
    if theirs is None:
        raise UserError(f"{where} serves {model.get('model')!r} without qarl's identity: it was not started by qarl "
                        "(start it with `qarl serve` and the run's model, quant and dtype)")
    if theirs != expected_identity:
        a, b = _fields(theirs), _fields(expected_identity)
        diff = [f"{k}={a.get(k)} (this run: {b.get(k)})" for k in ("model", "quant") if a.get(k) != b.get(k)]
        what = ", ".join(diff) or (f"another checkpoint of model={b.get('model')} quant={b.get('quant')} "
                                   f"(fingerprint {a.get('fp')}, this run's {b.get('fp')})")
        raise UserError(f"{where} serves {what}: start it with `qarl serve` and this run's model and quant, or "
                        "attach to one that does; nothing was sent to it")
    served_dtype = str(model.get("dtype", "")).removeprefix("torch.")
    if served_dtype != dtype:
        raise UserError(f"{where} runs in dtype {served_dtype}, this run's engine in {dtype}: start it with the "
                        "run's model.dtype (qarl serve picks the same on the same machine kind)")
    served_backend = (config.get("weight_transfer_config") or {}).get("backend")
    if served_backend != backend:
        raise UserError(f"{where} takes weights over transfer backend {served_backend}, this run's "
                        f"rollout.transfer_backend={backend}: set it to {served_backend}, or start the server with "
                        f"rollout.transfer_backend={backend}")
    version = (info or {}).get("weight_version")
    if version not in START_VERSIONS:
        raise UserError(f"{where} serves weight version {version}, another run's pushed weights, not this run's "
                        "start-up checkpoint: restart it (qarl serve) before attaching a new run")
