"""logger=wandb with wandb itself, offline (this machine has no network): what the run file holds, read back with
wandb's own record definitions: the composed config with its secrets redacted, every metric of every step as
metrics.jsonl has it, and the samples table.

An offline run keeps its records in `run-ID.wandb`, wandb's append-only log (LevelDB's log format: 32 KiB
blocks of records, each a 7-byte header, CRC32C + length + type, then a piece of one protobuf `Record`); `wandb
sync` uploads that file later. The reader below follows that format; the Records are wandb's protobuf."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

BLOCK = 32 * 1024
HEADER = 7  # the file starts with ":W&B", a 2-byte magic and a version byte; each record with its own 7 bytes
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """The protobuf Records of an offline run file, in the order wandb wrote them."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:  # zero padding at the end of the file
            break
        piece = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        pending = piece if kind in (FULL, FIRST) else pending + piece
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _items(items) -> dict:
    """A history or config update's items as a dict, values decoded from JSON (a media value, the samples table,
    comes as nested keys: samples -> path, _type, ...; a metric name's own '/' is part of one key)."""
    out: dict = {}
    for item in items:
        keys = [item.key] if item.key else list(item.nested_key)
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = json.loads(item.value_json)
    return out


def _config(records) -> dict:
    """The run's config: the run record's, then any later config updates."""
    config = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            config.update(_items((r.run.config if kind == "run" else r.config).update))
    return config


def _run_file(run_dir: Path) -> Path:
    found = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
def test_an_offline_run_holds_the_config_every_metric_and_the_samples(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "qarl_cli.cli", "train", "rollout=torch", "logger=wandb", "steps=2",
                          "eval_every=2", "checkpoint_every=0", "prompts_per_step=8", "samples_per_prompt=2",
                          "data.test_size=8", "eval_samples=2", "lr=1e-3", f"hydra.run.dir={run}"],
                         capture_output=True, text=True, timeout=600, env={k: v for k, v in os.environ.items() if not k.startswith("WANDB_")})
    assert out.returncode == 0, out.stderr[-3000:]
    records = wandb_records(_run_file(run))
    config = _config(records)
    assert config["lr"] == 1e-3 and config["steps"] == 2 and config["rollout"]["name"] == "torch"
    assert config["model"]["name"] == "tiny_arith" and config["logger"]["mode"] == "offline"
    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["_step"] for h in history] == [m["step"] for m in logged] == [0, 1, 2]
    for h, m in zip(history, logged):
        for key, value in m.items():
            if key != "step":
                assert h[key] == pytest.approx(value, rel=1e-12, abs=0), key
    tables = [h["samples"] for h in history if "samples" in h]
    assert len(tables) == 2 and all(t["_type"] == "table-file" for t in tables)  # the two training steps
    table = json.loads((_run_file(run).parent / "files" / tables[0]["path"]).read_text())
    assert len(table["data"]) == 8 and table["columns"] == ["prompt", "answer", "completion", "reward"]


REDACTED_RUN = """
import dataclasses, sys
from pathlib import Path
from qarl_cli.config.root import TrainConfig
from qarl_cli.config.stages import VLLMServerRolloutConfig, WandbLoggerConfig
from qarl_cli.train.loggers import WandbLogger
from qarl_cli.train.rundir import config_dict

# the key comes on stdin, not in argv: wandb records argv
cfg = dataclasses.replace(TrainConfig(), rollout=VLLMServerRolloutConfig(api_key=sys.stdin.read()))
logger = WandbLogger(WandbLoggerConfig(log_samples=0), Path(sys.argv[1]), config_dict(cfg))
logger.log(1, {"reward/mean": 0.5})
logger.close()
"""


def test_the_config_wandb_gets_has_the_key_redacted(tmp_path):
    """A run with a server key: wandb's config records that a key was set, and the key is nowhere in its files.
    The logger runs in a process of its own, as in a run: wandb keeps process-wide state (its service, its
    settings from WANDB_* variables), and an offline run file read in a long-lived test worker once lacked
    its config."""
    key = "k3y-" + os.urandom(8).hex()
    out = subprocess.run([sys.executable, "-c", REDACTED_RUN, str(tmp_path)], input=key, capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items() if not k.startswith("WANDB_")})
    assert out.returncode == 0, out.stderr[-3000:]
    records = wandb_records(_run_file(tmp_path))
    config = _config(records)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "rollout" in config, (kinds, sorted(config))
    assert config["rollout"]["api_key"] == "<set>" and config["rollout"]["name"] == "vllm_server"
    for f in (tmp_path / "wandb").rglob("*"):
        assert not f.is_file() or key.encode() not in f.read_bytes(), f
