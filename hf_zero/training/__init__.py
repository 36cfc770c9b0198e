"""What one training step needs around ZeRO: the step policy (``step.py``), placing the user's module
(``module_setup.py``), compiling and recomputing blocks (``compile.py``, ``recompute.py``), batches
(``data.py``), the step's wall-clock breakdown (``timers.py``) and a preemption's signals (``preemption.py``).

The modules sit on two layers (ARCHITECTURE.md lists each): ``data``, ``timers`` and ``preemption`` below ZeRO,
the rest above it.
"""
