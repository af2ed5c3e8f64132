"""Gradients from backward to the optimizer step.

``grad_sync`` decides when buckets are reduce-scattered (after backward at stage 1, during it at
stages 2-3); ``sharded_grad`` and ``grad_window`` are what ``param.grad`` shows between backward
and the step; ``norms`` computes norms over shards (clipping), ``grad_scaler`` the loss scaling
whose skip decision all ranks share.

May import ``buckets``, ``offload``, ``optimizer``, ``comm``, ``shards`` and ``engine.config``;
not ``parameters``.
"""
