"""Layers and models as pure functions over parameter pytrees.

Every layer multiplies through `linear`, which dispatches on the weight's node type.
"""

from entrenar.nn.linear import linear, weight_matmul

__all__ = ["linear", "weight_matmul"]
