"""``hf-zero launch`` across nodes: DeepSpeed's hostfile launch (pdsh/ssh, Slurm), each node running torchrun.

``hostfile.py`` reads DeepSpeed's hostfile and its filters, ``remote.py`` writes each node's shell line (the
forwarded environment, ``hf-zero launch --node_rank R``) and checks the hosts, ``job.py`` turns the flags into the
commands to run, and ``supervise.py`` runs them from the head node and ends them all on a failure or a signal.
``cli.py`` calls :func:`job.plan` first; a launch of one node goes on through ``cli.plan_launch`` as before.
"""
