"""Expert parallelism (DeepSpeed's AutoEP section, ``"expert_parallel": {"enabled": true, "autoep_size": N}``).

Ranks ``k*N .. k*N+N-1`` form EP group ``k``; each MoE layer's experts are split over it, rank ``r`` of the group
holding experts ``[r*E/N, (r+1)*E/N)``. The ranks at the same position of their EP groups hold the same experts and
form an expert-data-parallel group, over which ZeRO shards those experts; everything else is sharded over all ranks.

- ``groups.py``: the two kinds of process groups, made once per process;
- ``dispatch.py``: the all-to-all that sends each (token, expert) pair to the rank owning the expert and brings the
  result back, differentiable, with every rank joining every collective whatever it routes;
- ``setup.py``: finds transformers' fused experts modules (their classes unchanged), keeps this rank's experts and
  runs them through ``dispatch.py``, and marks their parameters for ZeRO (``hf_zero/zero/group.py`` ``SubGroup``).
"""
