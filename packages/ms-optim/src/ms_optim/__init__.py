"""LAMB: paper-exact, multi-tensor, ZeRO-shard aware.

- :class:`Lamb`: a ``torch.optim.Optimizer`` implementing Algorithm 2 of
  You et al. (arXiv 1904.00962) with documented variant switches.
- :func:`lamb_param_groups`: param groups that spare biases and norm weights.
- :class:`ShardMap`: tells ``Lamb`` which logical parameter each local ZeRO
  shard belongs to, and how many ranks of the group hold it (data x tensor
  parallel groups).
"""

from ms_optim._groups import lamb_param_groups
from ms_optim._lamb import Lamb
from ms_optim._shards import ShardMap
from ms_optim._version import __version__

__all__ = ["Lamb", "ShardMap", "__version__", "lamb_param_groups"]
