"""Run Lightning test ids one pytest process each, per variant (ddp | zero1 | zero2 | zero3).

usage: python run_suite.py --variants ddp,zero3 --ids ids.txt [--jobs 2] [--timeout 240] --out results.json
Each id (a file::test node, parametrized ids allowed) runs as `python -m pytest ID` in this folder with
LZ_SWAP=<variant>; ranks started by the popen launcher re-run the same command and share LZ_RUN_DIR.
"""
import argparse
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parent
PY = sys.executable
SRC = Path(__file__).resolve().parents[2] / "src"


def run_one(variant: str, node: str, index: int, timeout: float, tag: str = "") -> dict:
    run_dir = ROOT / "runs" / variant / f"{tag}{index:04d}"
    subprocess.run(["rm", "-rf", str(run_dir)])
    run_dir.mkdir(parents=True)
    env = dict(os.environ, LZ_SWAP=variant, LZ_RUN_DIR=str(run_dir), PL_RUN_STANDALONE_TESTS="1",
               PYTHONPATH=f"{ROOT}:{SRC}", OMP_NUM_THREADS="1")
    for k in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT", "MASTER_ADDR", "RANK"):
        env.pop(k, None)
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "--rootdir", str(ROOT), node]
    start = time.time()
    with open(run_dir / "out.txt", "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = "timeout"
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # ranks the test left behind (its own session, see above)
    except ProcessLookupError:
        pass
    results = run_dir / "results.jsonl"
    items = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    children = []
    for f in run_dir.glob("child-*.jsonl"):
        children += [json.loads(line) for line in f.read_text().splitlines()]
    tail = (run_dir / "out.txt").read_text()[-4000:]
    return {"variant": variant, "node": node, "rc": rc, "seconds": round(time.time() - start, 1),
            "items": items, "children": children, "tail": tail if not items or rc != 0 else ""}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="ddp,zero1,zero2,zero3")
    p.add_argument("--ids", required=True)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--out", default=str(ROOT / "results.json"))
    a = p.parse_args()
    nodes = [l.strip() for l in Path(a.ids).read_text().splitlines() if l.strip() and not l.startswith("#")]
    jobs = [(v, n, i) for v in a.variants.split(",") for i, n in enumerate(nodes)]
    out = []
    with cf.ThreadPoolExecutor(a.jobs) as pool:
        futures = [pool.submit(run_one, v, n, i, a.timeout, Path(a.out).stem + "-") for v, n, i in jobs]
        for fut in cf.as_completed(futures):
            r = fut.result()
            out.append(r)
            states = [it["outcome"] for it in r["items"]] or [f"rc={r['rc']}"]
            print(f"{r['variant']:6s} {r['seconds']:6.1f}s {','.join(states):30s} {r['node']}", flush=True)
            Path(a.out).write_text(json.dumps(out, indent=1))
    for v in a.variants.split(","):
        items = [it for r in out if r["variant"] == v for it in r["items"]]
        passed = sum(it["outcome"] == "passed" for it in items)
        print(f"{v}: {passed} passed of {len(items)} items ({len([r for r in out if r['variant'] == v])} ids)")


if __name__ == "__main__":
    main()
