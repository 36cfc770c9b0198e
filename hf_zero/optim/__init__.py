"""Optimizers and learning-rate schedules: what a config's ``optimizer`` and ``scheduler`` sections build.

``optimizers.py`` builds the optimizer a config names (with DeepSpeed's ``FusedAdam`` arguments), ``schedules.py``
DeepSpeed's learning-rate schedules with DeepSpeed's numbers, and ``cpu_adam.py`` the host Adam update that
ZeRO-Offload runs on the CPU (``DeepSpeedCPUAdam``; DeepSpeed's path for it, ``hf_zero.ops``, re-exports it).
"""
