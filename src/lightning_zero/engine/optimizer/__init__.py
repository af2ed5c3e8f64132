"""The user's optimizer on this rank's chunks.

``sharded_optimizer`` rebinds its param groups to the shards and converts full optimizer state
dicts; ``host_step`` switches offloaded optimizers to torch's fused CPU kernel;
``averaged_shards`` keeps a weight average (EMA, SWA) as chunks beside the optimizer's;
``instance_step`` is how the offload tiers take over an optimizer's ``step`` on its instance.

May import ``comm``, ``shards`` and ``engine.config``.
"""
