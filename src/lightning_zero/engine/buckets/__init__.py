"""Buckets: parameters that communicate together, one collective per direction.

``bucket`` holds a bucket and its two collectives as start/finish pairs (the gradient
reduce-scatter with its used flags, the parameter all-gather); ``assignment`` decides which
parameters share a bucket; ``pipelining`` finishes bucket collectives with a few in flight.

May import ``offload``, ``optimizer``, ``comm``, ``shards`` and ``engine.config``.
"""
