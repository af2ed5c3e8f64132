"""What a rank holds of each parameter: the chunk layout (``partition``), the per-parameter state
(``sharded_param``), a bucket's full parameters at stages 1-2 (``full_targets``), and a stage-3
parameter between uses (``at_rest``).

Imports nothing else of the engine.
"""
