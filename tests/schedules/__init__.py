"""The schedule explorer: what a GPU's streams and a second host thread can do to the engine, shown on
a CPU (the tests marked ``schedules``).

[Note: the schedule explorer]
On a GPU the host only queues kernels; the device runs each stream in its order and orders streams
against one another only where the engine says so (``engine/comm/streams.py``, [Note: the stream
layer]); NCCL's collectives run when every rank's kernel reached them; the host step's worker thread
runs beside backward. A CPU run with gloo runs everything where it is issued, so a missing wait, a
buffer reused too early or a cycle between two ranks' streams passes unseen there. The explorer
shows them in three steps:

1. **A reference run** (``collective_log.py``): the scenario runs on the CPU as usual (gloo), and
   every collective's result is kept.
2. **A recorded run** (``simulated_device.py``): the same scenario again, on a simulated device
   installed through the stream layer. The engine takes NCCL's path (a wait orders streams, never
   blocks the host) and sees streams and events; every kernel (each aten op on device memory), copy,
   stream and event operation, collective, host wait and host-thread handoff is recorded in issue
   order with the bytes it reads and writes (``trace.py``). Collectives do not communicate: each
   takes its result from the reference run, so no rank blocks on another and the values are exact.
   The host step's worker and the training thread run one at a time, switched at the handoff points
   ([Note: handoffs] in ``engine/offload/handoffs.py``) by a seeded scheduler (``host_threads.py``):
   each seed is one interleaving of the two threads.
3. **Replays** (``explorer.py``): the ranks' recordings together, as a device would run them: each
   stream a queue, each host thread a queue, a scheduler running any order the declared waits allow
   (seeded random, or adversarial: the host as far ahead of the device as it can get, the most
   recently ready stream first, one stream starved), collectives matched across ranks and completing
   only once every rank's kernel reached them. A replay reports a deadlock (nothing can run: the cycle
   of waits), a read of a buffer before the write that precedes it in issue order ran, and a buffer
   written before an earlier reader or writer of it ran; and the most bytes that the host dropped while
   a stream still held them (``keep_alive``).

What it cannot see (left to ``scripts/gpu_check.sh``): real kernels and timing, the caching
allocator's reuse of memory the host freed (buffers are told apart by allocation), contexts created
on another GPU, and copies the engine makes outside the stream layer.
"""
