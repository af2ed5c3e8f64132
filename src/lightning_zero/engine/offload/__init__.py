"""Offload: chunks and optimizer state in host memory and on NVMe.

``host_chunks`` keeps an offloaded bucket's chunks in host memory; the NVMe tier is ``disk_tier``
(one engine's scratch directory and staging), built on ``scratch_files`` (files read and written by
a thread pool), ``masters_on_disk`` (stage-3 parameter chunks in files between uses),
``state_on_disk`` with ``state_layout`` and ``staging`` (an optimizer's state stepped bucket by
bucket through a few host buffers). ``step_ahead`` steps each offloaded bucket on a host thread during
backward, bitwise as after it (``rollback`` keeps what undoes a step), and ``host_threads`` gives each
rank its share of the node's cores for that step.

May import ``optimizer``, ``comm``, ``shards`` and ``engine.config``.
"""
