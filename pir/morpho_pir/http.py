"""The HTTP facts client and server share (docs/PROTOCOL.md sections 5 and 6): media types and
the headers that carry an answer's epoch and served state."""
from __future__ import annotations

from morpho_pir.protocol import KEYS_PER_QUERY, PAGE_BYTES

OCTET_STREAM = "application/octet-stream"  # the binary encoding (section 5.3)
NDJSON = "application/x-ndjson"  # bulk job bodies and results (section 5.5)
EPOCH_HEADER = "X-Morpho-Epoch-Id"  # the epoch all answers of a binary response were computed on
QUERIES_HEADER = "X-Morpho-Queries"  # how many queries a binary response answers
# The served state of an answer, JSON or binary (section 6): rows written over the epoch and their
# digest, which a client compares between the two parties before it XORs.
UPDATES_HEADER = "X-Morpho-State-Updates"
DIGEST_HEADER = "X-Morpho-State-Digest"
# Bulk results may span epochs and states (each chunk is answered within one): all the epochs,
# which queries each answered as `first-last=epoch_id`, and which state each answered as
# `first-last=epoch_id:updates:0xdigest`, comma-separated.
EPOCH_IDS_HEADER = "X-Morpho-Epoch-Ids"
EPOCH_RANGES_HEADER = "X-Morpho-Epoch-Ranges"
STATE_RANGES_HEADER = "X-Morpho-State-Ranges"
# A lookup by key names the records table its keys were made for (section 9.4): its fingerprint.
RECORDS_HEADER = "X-Morpho-Records-Fingerprint"
ANSWER_BYTES = KEYS_PER_QUERY * PAGE_BYTES  # one query's three answers: 12,288 bytes
# The query endpoints (section 5): one query, and up to MAX_BATCH_QUERIES in one request.
QUERY_PATH = "/query/page/gpu"
BATCH_PATH = "/query/page/gpu/batch"
