"""How fast SGLang 0.5.23's file storage backend moves KV pages on a tmpfs, one thread per rank.

The backend writes one file per page per rank (numpy ``tofile`` to a temporary name, then
``os.replace``: mem_cache/hicache_storage.py:883-927) and reads it back with one ``readinto`` into
the host pool's buffer (hicache_storage.py:846-868). This does the same with plain Python on one
thread: ``PAGES`` pages of ``PAGE_BYTES`` (64 tokens x 12,288 B, one rank's page of
Qwen3.5-122B-A10B at TP 4; 13,312 B a token with the MTP draft layer packed in), and prints
GB/s each way.

    python3 lab/scripts/hicache_file_probe.py [DIR] [PAGES]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid

PAGE_BYTES = 64 * 12_288


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "/dev/shm"
    pages = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    page = os.urandom(PAGE_BYTES)
    buf = bytearray(PAGE_BYTES)
    with tempfile.TemporaryDirectory(dir=root) as where:
        names = [os.path.join(where, f"{i:08x}_model_0_4.bin") for i in range(pages)]
        t0 = time.perf_counter()
        for name in names:
            tmp = os.path.join(where, f".{uuid.uuid4().hex}.tmp")
            with open(tmp, "wb") as f:
                f.write(page)
            os.replace(tmp, name)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for name in names:
            with open(name, "rb", buffering=0) as f:
                if f.readinto(buf) != PAGE_BYTES:
                    raise OSError("short read")
        read_s = time.perf_counter() - t0
    total = pages * PAGE_BYTES
    print(f"{pages} pages of {PAGE_BYTES} B in {root}: write {total / write_s / 1e9:.2f} GB/s, "
          f"read {total / read_s / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
