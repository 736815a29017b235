"""fcntl lock round trips per operation in steady state (local_cap 4 and 32)."""
import sys, uuid, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nativepool import NativePool
for cap in (4, 32):
    p = NativePool(uuid.uuid4().hex[:8], 65536, local_cap=cap)
    c = p.core
    def rt(): return c.stats()["lock_roundtrips"]
    for name, fn, n in [
        ("single pair", lambda n: c.bench_pairs(n, 3), 100000),
        ("64-block pair", lambda n: c.bench_pairs(n, 1024), 10000),
        ("append", lambda n: c.bench_append(n), 1000000),
    ]:
        fn(1000); a = rt(); fn(n); b = rt()
        print(f"local_cap {cap}: {name}: {(b - a) / n:.4f} lock round trips per op")
    p.close()
