"""Moving bytes: between ranks and between host and device.

``collectives`` is the only module that calls ``torch.distributed`` (and where torch-version
differences in collective names live); ``streams`` is the only one that touches a device's streams
and events (CUDA, none on the CPU, a simulated device in the tests); ``buffers`` lends the
communication buffers; ``reduce_stream`` runs the gradient reductions on their stream;
``copy_stream`` orders host↔device copies off the compute stream (``copy_memory`` counts the pinned
blocks and device rows they hold); ``chunk_gather`` rebuilds whole
tensors from every rank's chunks a piece at a time. What rides on them: ``host_reads`` (device
verdicts read in one host sync), ``stop_vote`` (preemption requests agreed on by all ranks),
``evaluation_join`` (uneven evaluation at stage 3).

May import ``shards`` and ``engine.config``.
"""
