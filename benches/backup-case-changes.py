#!/usr/bin/env python3
"""Issue 16's changes between the full and the incremental backup, one definition for
backup-bench.sh and restore-ab.sh: REGION (a file of random bytes) written at OFFSET, then
2,000 random 4 KiB writes anywhere in SIZE bytes (seeded, so every run makes the same ones).
Applies them to IMAGE (the expected content) and writes them as qemu-io commands into CMDS
(to replay through the volume). Prints the number of 1 MiB chunks they touch.

    backup-case-changes.py IMAGE REGION OFFSET SIZE CMDS REGION_LEN
"""
import random
import sys

img, region, off, size, cmds, rlen = (
    sys.argv[1],
    sys.argv[2],
    int(sys.argv[3]),
    int(sys.argv[4]),
    sys.argv[5],
    int(sys.argv[6]),
)
cs = 1 << 20
rnd = random.Random(16)
chunks = set(range(off // cs, (off + rlen) // cs))
with open(img, "r+b") as f, open(cmds, "w") as c:
    f.seek(off)
    f.write(open(region, "rb").read())
    c.write(f"write -q -s {region} {off} {rlen}\n")
    for i in range(2000):
        at = rnd.randrange(size // 4096) * 4096
        pat = i % 250 + 1
        f.seek(at)
        f.write(bytes([pat]) * 4096)
        c.write(f"write -q -P {pat} {at} 4096\n")
        chunks.add(at // cs)
print(len(chunks))
