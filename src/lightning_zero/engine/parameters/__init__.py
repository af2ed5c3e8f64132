"""Where the full parameters live between uses — the one difference between stages 1-2 and 3.

``residency`` is the interface the engine drives; ``replicated_parameters`` keeps full parameters
on every rank (stages 1-2), ``sharded_parameters`` only this rank's chunks (stage 3), built from
``unit_plan`` (which modules are units), ``materialize`` (meta-device models, unit by unit),
``unit`` (a unit's buckets and gather/free lifecycle) and ``gather_schedule`` (the hooks that
gather before use, free after, and prefetch; ``kept_units`` says which all-frozen units stay gathered
until the optimizer step). ``param_guard`` refuses a replaced parameter object.

May import ``buckets``, ``offload``, ``optimizer``, ``comm``, ``shards`` and ``engine.config``;
not ``gradients``.
"""
