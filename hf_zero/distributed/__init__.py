"""Processes and devices: the process groups, backend and rank helpers (``dist.py``) and the device calls
DeepSpeed scripts make (``device.py``, behind DeepSpeed's ``deepspeed.accelerator`` path).
"""
