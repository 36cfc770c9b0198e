"""Ulysses sequence parallelism and the long-sequence memory savers (DeepSpeed's ALST, for hf_zero).

- :mod:`.groups`: ``world = dp x sp``; which ranks share a sample, and why ZeRO spans them all.
- :mod:`.comm`: the all-to-all and the sum over the group, as autograd functions.
- :mod:`.attention`: Ulysses attention through transformers' attention and mask interfaces.
- :mod:`.batch`: a batch cut along the sequence (labels shifted first, global positions, padding).
- :mod:`.loss`: the LM head and cross-entropy in tiles; the mean over the group's targets.
- :mod:`.tiling`: the MLP in tiles; checkpointed block inputs in host memory.
- :mod:`.model`: all of it switched on for a transformers causal LM.
- :mod:`.config`: ``sequence_parallel_size`` and the ``sequence_parallel`` section.
"""

from hf_zero.sequence.batch import SequenceParallelLoader, shard_batch, shift_labels_of
from hf_zero.sequence.groups import SequenceParallelError, SequenceParallelGroups, make_groups
from hf_zero.sequence.loss import fused_linear_cross_entropy, sequence_parallel_mean
from hf_zero.sequence.model import LongSequenceOptions, prepare_model
from hf_zero.sequence.tiling import checkpoint_offloaded, tile_mlps

__all__ = [
    "LongSequenceOptions", "SequenceParallelError", "SequenceParallelGroups", "SequenceParallelLoader",
    "checkpoint_offloaded", "fused_linear_cross_entropy", "make_groups", "prepare_model", "sequence_parallel_mean",
    "shard_batch", "shift_labels_of", "tile_mlps",
]
