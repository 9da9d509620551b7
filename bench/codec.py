"""Encode + decode throughput of the vigil codec beside stdlib json, on the same records.

100k records (step records and collective aggregates, half each) go through
  - the vigil codec: encode_batch (msgpack + zstd) and decode_batch (typed, validated), and
  - stdlib json: asdict -> json.dumps, then json.loads -> the same typed records.
Both paths run side by side in one process, best of several rounds. The last line of output is one
JSON object: {"codec_records_per_s", "json_records_per_s", "ratio"}.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import msgspec

from vigil import codec, schema


def make_records(n: int, seed: int = 0) -> list[schema.Record]:
    rng = random.Random(seed)
    records: list[schema.Record] = []
    for i in range(n // 2):
        rank, step = i % 1024, i // 1024
        start = 1.7e9 + step * 0.5 + rng.random() * 1e-3
        records.append(
            schema.StepRecord(
                job_id="bench-job",
                rank=rank,
                step=step,
                start_s=start,
                end_s=start + 0.5 + rng.random() * 0.01,
                data_s=0.01,
                forward_s=0.12,
                backward_s=0.25,
                optimizer_s=0.03,
                comm_wait_s=rng.random() * 0.05,
                tokens=8192,
                model_flops=1.2e15,
                mfu=0.41,
                loss=2.5 + rng.random(),
                peak_memory_bytes=60 << 30,
            )
        )
        records.append(
            schema.CollectiveAggregate(
                job_id="bench-job",
                rank=rank,
                step=step,
                group="dp",
                op="all_reduce",
                count=24,
                bytes=24 << 24,
                total_device_s=0.08 + rng.random() * 1e-3,
                max_device_s=0.005,
                total_wait_s=rng.random() * 0.02,
                last_seq=step * 24 + 23,
            )
        )
    return records


def run_codec(records: list[schema.Record], batch_size: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(records), batch_size):
        frame = codec.encode_batch(records[i : i + batch_size], batch_id=f"b{i}")
        batch = codec.decode_batch(frame)
        assert len(batch.records) == len(records[i : i + batch_size])
    return time.perf_counter() - t0


def run_json(records: list[schema.Record], batch_size: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(records), batch_size):
        chunk = records[i : i + batch_size]
        text = json.dumps([msgspec.structs.asdict(r) | {"type": _tag(r)} for r in chunk])
        decoded = [_from_dict(d) for d in json.loads(text)]
        assert len(decoded) == len(chunk)
    return time.perf_counter() - t0


def _tag(record: schema.Record) -> str:
    return str(type(record).__struct_config__.tag)


def _from_dict(d: dict[str, object]) -> schema.Record:
    cls = schema.RECORD_TAGS[str(d.pop("type"))]
    return cls(**d)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=2_048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    records = make_records(args.records)
    codec_s = min(run_codec(records, args.batch_size) for _ in range(args.rounds))
    json_s = min(run_json(records, args.batch_size) for _ in range(args.rounds))
    codec_rate, json_rate = len(records) / codec_s, len(records) / json_s
    print(f"records: {len(records):,} in batches of {args.batch_size}, best of {args.rounds}")
    print(f"vigil codec (msgpack+zstd, typed): {codec_rate:14,.0f} records/s")
    print(f"stdlib json (dicts -> records):    {json_rate:14,.0f} records/s")
    print(
        json.dumps(
            {
                "codec_records_per_s": round(codec_rate),
                "json_records_per_s": round(json_rate),
                "ratio": round(codec_rate / json_rate, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
