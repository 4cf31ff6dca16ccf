"""Read the records of an offline W&B run file (run-*.wandb), for tests.

The file is a LevelDB-style log (a 7-byte header, then 32 KiB blocks of records with 7-byte
headers) of protobuf `Record`s; wandb ships the protobuf classes but no public reader.
"""

import struct

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path):
    data = open(path, "rb").read()
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def summary(path) -> dict:
    values = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                if item.key:
                    values[item.key] = item.value_json
    return values


def exit_code(path, wait_s: float = 30.0) -> int | None:
    """The exit code the run was finished with (None: it never finished). W&B's service process
    writes the file after `finish()` returns, so the exit record is awaited a while."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        codes = [r.exit.exit_code for r in records(path) if r.WhichOneof("record_type") == "exit"]
        if codes or time.monotonic() > deadline:
            return codes[-1] if codes else None
        time.sleep(0.2)
