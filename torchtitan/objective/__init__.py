"""The training objective (objective.py): the language model's cross entropy, whole or a chunk at a time
(chunked_cross_entropy.py), and the terms added to it: a mixture of experts' balance losses
(load_balance.py) and multi-token prediction's (mtp.py). docs/objectives.md gives each term's formula."""

from torchtitan.objective.objective import Objective

__all__ = ["Objective"]
