"""Tensor parallelism (--tensor-parallel-size N): one engine over N ranks joined by torch.distributed.

- sharding.py: which rows / columns of every tensor a rank holds (the rules, applied to the loaded state dict);
- model.py: ShardedModel, a rank's HybridModel with the all-reduces and the logits' all-gather;
- group.py: the rendezvous (torchrun's flags), the two process groups, TensorParallelError;
- worker.py: what every rank runs (load, agree on the pool, execute plans); the entry of other nodes;
- launch.py: rank 0's side, TensorParallel (spawns the node's workers) and ParallelRunner (each step on every
  rank).

docs/parallel.md has the sharding table and the process model.
"""
from .group import TensorParallelError

__all__ = ["TensorParallelError"]
