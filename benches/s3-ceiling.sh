#!/usr/bin/env bash
# The S3 server's own ceiling: PUT then GET of N objects of 64 MiB (random bytes), P at a
# time, signed requests from boto3 (the moto venv has it). Prints one line, "PUT_MiB/s
# GET_MiB/s", of the bytes moved. backup-bench.sh runs it to tell the server's limit from
# the store's. (Plain curl PUTs hang on moto's development server: it never answers them.)
#
#   benches/s3-ceiling.sh ENDPOINT BUCKET [N=8] [P=4]
#   env: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION (any values for moto)
set -euo pipefail
cd "$(dirname "$0")/.."
moto_server=$(bash backupstore/scripts/moto-venv.sh)
exec "$(dirname "$moto_server")/python3" - "$@" <<'PY'
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
