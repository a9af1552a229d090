#!/usr/bin/env python3
# Usage: benches/two-syncs.py DIR [N]  (DIR on the disk to measure; writes 256 MiB there)
# Does a second fdatasync in parallel (a 4-byte sum write in another file) cost more than one?
import os, random, threading, time, sys
d = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
size = 256 << 20
a = os.open(f"{d}/data", os.O_RDWR | os.O_CREAT); b = os.open(f"{d}/sums", os.O_RDWR | os.O_CREAT)
os.ftruncate(a, size)
blk = os.urandom(4096)
# allocate everything first (steady state: overwrites)
for off in range(0, size, 1 << 20): os.pwrite(a, os.urandom(1 << 20), off)
os.pwrite(b, b"\1" * (size // 4096 * 4), 0); os.fsync(a); os.fsync(b)
def one():
    t = time.perf_counter()
    for _ in range(n):
        o = random.randrange(size // 4096) * 4096
        os.pwrite(a, blk, o); os.fdatasync(a)
    return n / (time.perf_counter() - t)
def two():
    t = time.perf_counter()
    for _ in range(n):
        o = random.randrange(size // 4096) * 4096
        os.pwrite(a, blk, o); os.pwrite(b, b"abcd", o // 1024)
        th = threading.Thread(target=os.fdatasync, args=(b,)); th.start(); os.fdatasync(a); th.join()
    return n / (time.perf_counter() - t)
def seq():
    t = time.perf_counter()
    for _ in range(n):
        o = random.randrange(size // 4096) * 4096
        os.pwrite(a, blk, o); os.pwrite(b, b"abcd", o // 1024); os.fdatasync(b); os.fdatasync(a)
    return n / (time.perf_counter() - t)
for r in range(3):
    print(f"round {r}: one {one():.0f}/s  two-parallel {two():.0f}/s  two-serial {seq():.0f}/s", flush=True)
