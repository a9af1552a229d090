#!/usr/bin/env bash
# The S3 server's own ceiling: PUT then GET of N objects of 64 MiB (random bytes), P at a
# time, measured by two clients:
#   - boto3 (signed requests; the moto venv has it). Its PUTs are bound by Python itself on
#     this machine kind (about 60 MiB/s whatever the server), so it understates fast servers;
#   - the backup store's own client, object_store, as a backup uses it (unsigned payloads,
#     multipart uploads of 8 MiB parts, streamed ranged GETs): backupstore's example
#     `s3_ceiling`, when S3_CEILING names it (default: target/release/examples/s3_ceiling if
#     present). This one bounds what a backup or restore can reach.
# Prints one line, "PUT_MiB/s GET_MiB/s" of boto3, then (if the example exists) "RUST_PUT
# RUST_GET" on the same line. backup-bench.sh runs it to tell the server's limit from the
# store's. (Plain curl PUTs hang on moto's development server: it never answers them.)
#
#   benches/s3-ceiling.sh ENDPOINT BUCKET [N=8] [P=4]
#   env: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION (any values for moto),
#        S3_CEILING (the example's program)
set -euo pipefail
cd "$(dirname "$0")/.."
rust="${S3_CEILING:-target/release/examples/s3_ceiling}"
moto_server=$(bash backupstore/scripts/moto-venv.sh)
boto=$("$(dirname "$moto_server")/python3" - "$@" <<'PY'
import os, sys, time
from concurrent.futures import ThreadPoolExecutor
import boto3
from botocore.config import Config

ep, bucket = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 8
p = int(sys.argv[4]) if len(sys.argv) > 4 else 4
s3 = boto3.client("s3", endpoint_url=ep, region_name=os.environ.get("AWS_REGION", "us-east-1"),
                  config=Config(max_pool_connections=p, retries={"max_attempts": 1},
                                read_timeout=300, connect_timeout=10))
body = os.urandom(64 << 20)
keys = [f"ceiling/{i}" for i in range(n)]
t0 = time.monotonic()
with ThreadPoolExecutor(p) as ex:
    list(ex.map(lambda k: s3.put_object(Bucket=bucket, Key=k, Body=body), keys))
t1 = time.monotonic()
def get(k):
    r = s3.get_object(Bucket=bucket, Key=k)["Body"]
    got = 0
    while True:
        b = r.read(8 << 20)
        if not b:
            break
        got += len(b)
    assert got == len(body), (k, got)
with ThreadPoolExecutor(p) as ex:
    list(ex.map(get, keys))
t2 = time.monotonic()
with ThreadPoolExecutor(p) as ex:
    list(ex.map(lambda k: s3.delete_object(Bucket=bucket, Key=k), keys))
print(f"{n * 64 / (t1 - t0):.1f} {n * 64 / (t2 - t1):.1f}")
PY
)
if [ -x "$rust" ]; then
  echo "$boto $("$rust" "$1" "$2" --count "${3:-8}" --parallel "${4:-4}")"
else
  echo "$boto"
fi
