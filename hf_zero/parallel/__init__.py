"""The run's parallel grid (:mod:`hf_zero.parallel.grid`): one object, built once, that every parallelism is an axis of."""

from hf_zero.parallel.grid import AXES, DATA_AXES, ZERO_AXES, GridShape, ParallelGrid, alone, grid_for

__all__ = ["AXES", "DATA_AXES", "ZERO_AXES", "GridShape", "ParallelGrid", "alone", "grid_for"]
