"""What the checksums cost a sharded save, and checking them a load (2 gloo ranks, CPU): times
``write_directory`` with the real CRC-32s against a stub, then the load-time check against DCP's read.

    PYTHONPATH=src python scripts/checkpoint_checksum_overhead.py [total_MB=300] [repeats=5] [folder]
"""
import os, statistics, sys, tempfile, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, world, port, total_mb, repeats, folder, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning_zero.checkpoint import sharded, storage
    from lightning_zero.checkpoint.manifest import Manifest
    group = storage.CheckpointGroup()
    numel = total_mb * 2**20 // 4 // 8          # 8 parameters
    tensors = {f"model/p{i}": sharded._flat_dtensor(torch.randn(numel // world), numel, group.mesh) for i in range(8)}
    real = storage.checksum_files
    times = {"with": [], "without": [], "verify_on_load": [], "dcp_load": []}
    for r in range(repeats):
        for mode in ("with", "without"):
            storage.checksum_files = real if mode == "with" else (lambda d, names: {n: 0 for n in names})
            d = os.path.join(folder, f"{mode}{r}")
            dist.barrier(); t = time.perf_counter()
            storage.write_directory(d, tensors, {"step": r}, Manifest(stage=2, world_size=world, params={}), group)
            dist.barrier(); times[mode].append(time.perf_counter() - t)
        d = os.path.join(folder, f"with{r}")
        dist.barrier(); t = time.perf_counter()
        storage.verify_on_ranks(d, group)
        dist.barrier(); times["verify_on_load"].append(time.perf_counter() - t)
        targets = {k: sharded._flat_dtensor(torch.empty(numel // world), numel, group.mesh) for k in tensors}
        dist.barrier(); t = time.perf_counter()
        storage.read_tensors(targets, d, group)
        dist.barrier(); times["dcp_load"].append(time.perf_counter() - t)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()

if __name__ == "__main__":
    total_mb = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    folder = sys.argv[3] if len(sys.argv) > 3 else tempfile.mkdtemp(dir="/tmp")
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ps = [ctx.Process(target=rank_main, args=(r, 2, port, total_mb, repeats, folder, q)) for r in range(2)]
    [p.start() for p in ps]; times = q.get(); [p.join() for p in ps]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{total_mb} MB checkpoint, 2 ranks, {repeats} repeats, folder {folder}")
    for k, v in times.items():
        print(f"  {k:15s} median {med[k]:.3f}s  all {[round(x, 3) for x in v]}")
    print(f"  checksum overhead on save: {med['with'] - med['without']:+.3f}s ({(med['with'] / med['without'] - 1) * 100:+.1f}%)")
    print(f"  verification on load: {med['verify_on_load']:.3f}s vs DCP read {med['dcp_load']:.3f}s")
