"""Re-measure single pairs interleaved (wrapper, C-typed, peer) to see the spread on a shared host."""
import gc, os, sys, uuid
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench as B
from nativepool import NativePool
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
gc.disable()
p = NativePool(uuid.uuid4().hex[:8], B.NB)
pc = NativePool(uuid.uuid4().hex[:8], B.NB, c_api=True)
rows = {"wrapper": [], "C-typed": [], "peer": []}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 9):
    rows["wrapper"].append(B.single_wrapper(p, 200_000))
    rows["C-typed"].append(B.single_wrapper(pc, 200_000))
    rows["peer"].append(B.single_peer(B.BlockManager(B.NB, B.BS), 200_000))
for k, v in rows.items():
    print(f"{k:8s} in run order:", " ".join(f"{x/1e3:,.0f}k" for x in v))
    v.sort()
    print(f"single pairs/s {k:8s}: min {v[0]:,.0f}  median {v[len(v)//2]:,.0f}  max {v[-1]:,.0f}")
p.close(); pc.close()
