"""Read back what an offline W&B run recorded: its run-*.wandb file, in W&B's own format.

The file is a 7-byte header (":W&B", magic 0xBEE1, version 0) and then a LevelDB-style log
of 32 KiB blocks: each chunk is a 4-byte checksum, a 2-byte little-endian length and a type
(1 whole, 2 first, 3 middle, 4 last), and a block's last < 7 bytes are padding. Each record
is a `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK, HEADER = 32768, 7


def records(path: Path) -> list:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pieces, out = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + HEADER : pos + HEADER + length], pos + HEADER + length
        if kind == 0:  # zeroed padding
            continue
        pieces = payload if kind in (1, 2) else pieces + payload
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pieces)
            out.append(record)
    return out


def offline_run(where: Path) -> dict:
    """The one offline run under `where`: its group, job_type, config (top-level keys) and the
    keys it logged."""
    (path,) = Path(where).rglob("offline-run-*/run-*.wandb")
    run, config, logged = None, {}, set()
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            logged.update(item.key or "/".join(item.nested_key) for item in record.history.item)
    assert run is not None, f"{path} holds no run record"
    return {"group": run.run_group, "job_type": run.job_type, "config": config, "logged": logged, "dir": path.parent}
