"""Run Lightning test ids one pytest process each, per variant (ddp | zero1 | zero2 | zero3).

usage: python run_suite.py --variants ddp,zero3 --ids ids.txt [--jobs 1] [--timeout 240] [--out results.json]
                           [--tarball PATH] [--workdir DIR] [--together]
Lightning's tests are unpacked from the tarball into a temporary folder (``suite_dir.py``; removed at the
end unless ``--workdir`` names one). Each id (a file::test node, parametrized ids allowed) runs as
``python -m pytest ID`` there with LZ_SWAP=<variant>; ranks started by the popen launcher re-run the same
command and share LZ_RUN_DIR. The exit status is 0 when every item that ran passed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite_dir import SRC, default_tarball, lay_out  # noqa: E402

RANK_VARIABLES = ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT", "MASTER_ADDR", "RANK", "GROUP_RANK")


def read_ids(path: Path) -> list[str]:
    """The ids of a list file: one a line; blank lines and ``#`` comments skipped."""
    lines = (line.split(" #")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def run_one(root: Path, variant: str, nodes: list[str], run_dir: Path, timeout: float, probe: bool = False) -> dict:
    """Run ``nodes`` in one pytest process under ``variant``; its ranks and records go in ``run_dir``.
    ``probe``: stop every test at its first launch of ranks, recording it (see the harness conftest)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    path = os.pathsep.join(p for p in (str(root), str(SRC), os.environ.get("PYTHONPATH")) if p)  # ours first
    env = dict(os.environ, LZ_SWAP=variant, LZ_RUN_DIR=str(run_dir), PL_RUN_STANDALONE_TESTS="1",
               PYTHONPATH=path, OMP_NUM_THREADS="1", LZ_PROBE="1" if probe else "")
    for k in RANK_VARIABLES:
        env.pop(k, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
           "--rootdir", str(root), *nodes]
    start = time.time()
    with open(run_dir / "out.txt", "w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = "timeout"
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # ranks the test left behind (its own session, see above)
    except ProcessLookupError:
        pass
    items = _jsonl(run_dir / "results.jsonl")
    children = [r for f in sorted(run_dir.glob("child-*.jsonl")) for r in _jsonl(f)]
    tail = (run_dir / "out.txt").read_text(errors="replace")[-4000:]
    passed = bool(items) and rc == 0
    return {"variant": variant, "node": nodes[0] if len(nodes) == 1 else nodes, "rc": rc,
            "seconds": round(time.time() - start, 1), "items": items, "children": children,
            "launches": _jsonl(run_dir / "launches.jsonl"), "tail": "" if passed else tail}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run(root: Path, variants: list[str], nodes: list[str], jobs: int, timeout: float, out: Optional[Path],
        runs: Path, together: bool = False) -> list[dict]:
    """Each of ``nodes`` under each of ``variants``, ``jobs`` at a time; ``out`` rewritten as results come.
    ``together``: all ``nodes`` in one pytest process per variant (one result each all the same)."""
    results: list[dict] = []
    groups = [nodes] if together else [[n] for n in nodes]
    with cf.ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(run_one, root, v, group, runs / v / f"{i:04d}", timeout * len(group))
                   for v in variants for i, group in enumerate(groups)]
        for fut in cf.as_completed(futures):
            r = fut.result()
            results += _per_node(r) if together else [r]
            states = [it["outcome"] for it in r["items"]] or [f"rc={r['rc']}"]
            print(f"{r['variant']:6s} {r['seconds']:6.1f}s {','.join(states):20s} {r['node']}", flush=True)
            if out is not None:
                out.write_text(json.dumps(results, indent=1))
    return results


def _per_node(r: dict) -> list[dict]:
    """A run of several ids as one result each: its items, launches and children by id."""
    return [dict(r, node=node, items=[it for it in r["items"] if it["id"] == node],
                 launches=[l for l in r["launches"] if l["id"] == node],
                 children=[c for c in r["children"] if c["id"] == node])
            for node in (r["node"] if isinstance(r["node"], list) else [r["node"]])]


def summary(results: list[dict], variants: list[str]) -> list[str]:
    lines = []
    for v in variants:
        mine = [r for r in results if r["variant"] == v]
        items = [it for r in mine for it in r["items"]]
        passed = sum(it["outcome"] == "passed" for it in items)
        failed = [r["node"] for r in mine if not r["items"] or any(it["outcome"] != "passed" for it in r["items"])]
        lines.append(f"{v}: {passed} passed of {len(mine)} ids" + (f"; not passed: {' '.join(failed)}" if failed else ""))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="ddp,zero1,zero2,zero3")
    p.add_argument("--ids", required=True, type=Path)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--out", type=Path, default=None, help="results as JSON (one object per id and variant)")
    p.add_argument("--tarball", type=Path, default=None, help="Lightning's tests (default: shared/lightning-tests/)")
    p.add_argument("--workdir", type=Path, default=None, help="unpack and run here, and keep it (default: a temporary folder)")
    p.add_argument("--together", action="store_true",
                   help="all ids in one pytest process per variant: only for tests whose ranks are spawned (a popen"
                        " launch's ranks re-run the whole command, so they would run every id)")
    a = p.parse_args()
    variants = a.variants.split(",")
    nodes = read_ids(a.ids)
    workdir = a.workdir
    root = lay_out(a.tarball or default_tarball(), workdir)
    try:
        results = run(root, variants, nodes, a.jobs, a.timeout, a.out, root.parent / "runs", a.together)
    finally:
        if workdir is None:
            shutil.rmtree(root.parent, ignore_errors=True)
    for line in summary(results, variants):
        print(line)
    ok = all(r["items"] and all(it["outcome"] == "passed" for it in r["items"]) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
