"""HTTP contract between senders (SDK, node agent) and the collector: paths, media type, headers.

Constants only, so the agent and the collector agree without importing each other.
"""

from __future__ import annotations

# POST a frame from vigil.codec.encode_batch here; 200 means committed (idempotent by batch id).
INGEST_PATH = "/api/v1/ingest"
# The media type of a codec frame (msgpack, optionally zstd-compressed inside the frame).
BATCH_MEDIA_TYPE = "application/x-vigil-batch"
# Carries the batch id too, so a collector can answer a retried batch before decoding it.
BATCH_ID_HEADER = "X-Vigil-Batch-Id"
API_PREFIX = "/api/v1"
# POST several frames at once here (a node agent relaying its ranks' batches): the body is
# `vigil.codec.encode_frames`; the answer is 200 with one result per frame, in order, each with
# the status a lone POST of that frame to INGEST_PATH would have had (`FramesPublic`).
INGEST_FRAMES_PATH = "/api/v1/ingest/frames"
FRAMES_MEDIA_TYPE = "application/x-vigil-frames"
