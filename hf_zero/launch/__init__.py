"""``hf-zero launch``: DeepSpeed's launcher on one node (torchrun) and across nodes (pdsh/ssh, Slurm).

``flags.py`` is the subcommand's flag table (DeepSpeed's, with Accelerate's beside them) and ``local.py`` one node's
translation of those flags into torchrun, which the process then becomes.

``hostfile.py`` reads DeepSpeed's hostfile and its filters, ``remote.py`` writes each node's shell line (the
forwarded environment, ``hf-zero launch --node_rank R``) and checks the hosts, ``job.py`` turns the flags into the
commands to run, and ``supervise.py`` runs them from the head node and ends them all on a failure or a signal.
``cli.py`` calls :func:`job.plan` first; a launch of one node goes on through ``local.plan_launch``.
"""
