"""Where examples/serve.py makes the host wait for the GPU, plainly and under `kvscope run`: each
run under torch's sync debug mode ("warn"), every warning counted by the code site that caused
it (the last four frames of kvscope's and the example's own code), the sites printed by count
(docs/BENCHMARKS.md, "Probes on a CUDA pool").

    python bench/bench_serve_syncs.py --requests 64 --cuda-graphs      # on a CUDA machine

A wait the plain run has too is the server's own (reading the sampled tokens back); one only
`kvscope run` has is a probe's, and costs the overlap of the host's work with the GPU's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve  # noqa: E402

# Run as `bench_serve_syncs.py --counted serve.py ...`: serve.py with the waits counted, the
# sites printed to stderr at exit.
_COUNTED = "--counted"


def _counted_serve(argv: list[str]) -> None:
    import atexit
    import collections
    import runpy
    import traceback
    import warnings

    import torch

    sites: collections.Counter[str] = collections.Counter()
    ours = ("/allocator/", "/kernels/", "/examples/", "/kvscope/")

    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if any(d in f.filename for d in ours)]
        where = " <- ".join(
            f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in stack[-4:][::-1]
        )
        sites[where or "(outside kvscope)"] += 1

    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    atexit.register(
        lambda: [print(f"SYNC {n:6d}  {site}", file=sys.stderr) for site, n in sites.most_common()]
    )
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--cuda-graphs", action="store_true", help="serve.py --cuda-graphs")
    args = ap.parse_args(argv)
    me = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory() as tmp:
        bench_serve.write_model(tmp, False)
        extra = ["--cuda-graphs"] if args.cuda_graphs else []
        cmd = bench_serve.serve_command(tmp, "cuda", extra, False, str(args.requests))
        runs = {
            "plain": [sys.executable, me, _COUNTED, *cmd[1:]],
            "kvscope run": [sys.executable, "-m", "kvscope", "run", "--dump-dir", tmp, me,
                            _COUNTED, *cmd[1:]],
        }  # fmt: skip
        for name, c in runs.items():
            done = subprocess.run(c, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{name}: exit {done.returncode}\n{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            lines = [ln[5:] for ln in done.stderr.splitlines() if ln.startswith("SYNC ")]
            print(f"{name}: {sum(int(ln.split()[0]) for ln in lines)} waits", *lines, sep="\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == _COUNTED:
        _counted_serve(sys.argv[2:])
    else:
        sys.exit(main())
