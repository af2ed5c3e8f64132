"""Derive ``ids.txt`` from the tarball: the tests of Lightning's ``tests_pytorch`` that start ranks on the
CPU with a DDP strategy the swap reaches, and pass under DDP here.

usage: python derive_ids.py [--tarball PATH] [--workdir DIR] [--jobs 1] [--out ids.txt] [--report derive.json]
1. sieve: collect every test, keep those not skipped by a mark here that name DDP (``collect_candidates.py``);
2. probe: run the sieved tests under ``ddp`` with LZ_PROBE=1, which stops each at its first launch of ranks
   and records it (the harness conftest): kept are the tests that launch two or more ranks with the
   ``CPUAccelerator`` and a strategy the swap reaches (a DDP name or a plain ``DDPStrategy``);
3. run each kept test under ``ddp`` for real; those that pass, and launched as probed, make the list.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_suite import run, run_one  # noqa: E402
from suite_dir import HERE, SRC, default_tarball, lay_out  # noqa: E402


def sieve(root: Path) -> tuple[list[str], str]:
    """The ids ``collect_candidates.py`` keeps, and pytest's closing lines (collection errors show there)."""
    listing = root.parent / "candidates.txt"
    env = dict(os.environ, LZ_CANDIDATES=str(listing), PYTHONPATH=f"{root}:{HERE}:{SRC}", OMP_NUM_THREADS="1",
               PL_RUN_STANDALONE_TESTS="1")  # `RunIf(standalone=True)` reads it at collection, as in run_one
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "collect_candidates",
           "-W", "ignore", "--rootdir", str(root), "tests_pytorch"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    return listing.read_text().split(), "\n".join(done.stdout.splitlines()[-15:])


def launches_on_cpu(launches: list[dict], min_ranks: int) -> bool:
    """Whether a test's launches include ``min_ranks`` or more ranks started on the CPU with a strategy the
    swap reaches."""
    return any(l["reached"] and l["accelerator"] == "CPUAccelerator" and l["ranks"] >= min_ranks for l in launches)


def probe(root: Path, candidates: list[str], timeout: float, min_ranks: int) -> tuple[list[str], list[dict]]:
    """The candidates that launch CPU ranks with a reached strategy (in collection order), and each file's run."""
    by_file: dict[str, list[str]] = defaultdict(list)
    for node in candidates:
        by_file[node.split("::")[0]].append(node)
    launching, runs = set(), []
    for i, (path, nodes) in enumerate(by_file.items()):
        r = run_one(root, "ddp", nodes, root.parent / "probe" / f"{i:03d}", timeout, probe=True)
        runs.append({"file": path, "candidates": len(nodes), "rc": r["rc"], "seconds": r["seconds"],
                     "launches": r["launches"], "tail": r["tail"] if not r["items"] else ""})
        launching |= {l["id"] for l in r["launches"] if launches_on_cpu([l], min_ranks)}
        print(f"probe {r['seconds']:6.1f}s {len(nodes):3d} sieved {sum(n in launching for n in nodes):3d} launch  {path}", flush=True)
    return [n for n in candidates if n in launching], runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tarball", type=Path, default=None)
    p.add_argument("--workdir", type=Path, default=None, help="unpack and run here, and keep it")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--out", type=Path, default=HERE / "ids.txt")
    p.add_argument("--report", type=Path, default=None, help="every stage's findings as JSON")
    p.add_argument("--min-ranks", type=int, default=2,
                   help="fewest ranks a launch starts to count (1 adds the 20 tests that launch one rank)")
    a = p.parse_args()
    tarball = a.tarball or default_tarball()
    root = lay_out(tarball, a.workdir)
    try:
        candidates, collected = sieve(root)
        print(f"sieve: {len(candidates)} candidates\n{collected}", flush=True)
        launching, probes = probe(root, candidates, 900, a.min_ranks)
        print(f"probe: {len(launching)} launch CPU ranks with a reached DDP strategy", flush=True)
        results = run(root, ["ddp"], launching, a.jobs, a.timeout, None, root.parent / "runs")
    finally:
        if a.workdir is None:
            shutil.rmtree(root.parent, ignore_errors=True)
    ok = {r["node"] for r in results
          if r["items"] and all(it["outcome"] == "passed" for it in r["items"]) and launches_on_cpu(r["launches"], a.min_ranks)}
    kept = [n for n in launching if n in ok]
    header = [
        f"# Lightning 2.6.5's tests_pytorch ({tarball.name}) that start ranks on the CPU with a DDP strategy the",
        f"# swap reaches and pass under DDP here: {len(kept)} of {len(launching)} probed to launch ({len(candidates)} sieved).",
        "# Written by derive_ids.py (see README.md); do not edit by hand.",
    ]
    a.out.write_text("\n".join(header + kept) + "\n")
    if a.report is not None:
        a.report.write_text(json.dumps({"candidates": candidates, "launching": launching, "kept": kept,
                                        "probes": probes, "runs": results}, indent=1))
    for r in results:
        if r["node"] not in ok:
            states = [it["outcome"] for it in r["items"]] or [f"rc={r['rc']}"]
            print(f"left out (not passing under ddp): {r['node']} {','.join(states)}")
    print(f"{a.out}: {len(kept)} ids")
    return 0


if __name__ == "__main__":
    sys.exit(main())
