"""``hf-zero plan`` and the memory estimates: a model of a layout, computed before any process starts.

``estimate.py`` estimates a ZeRO stage's memory (DeepSpeed's ``estimate_zero*`` numbers, low in the layers),
``facts.py`` reads the engine's units and tensor-parallel plan off a model, ``planner.py`` models the layout
and the pipeline split, and ``report.py`` prints it.
"""
