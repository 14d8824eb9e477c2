"""zmoe: Mixture-of-Experts.

This package will own MoE layers and gating (top-1/top-2 with capacity
factors and load-balancing loss), expert parallelism over zcore's process
groups (all-to-all dispatch and combine), Pyramid-Residual MoE (PR-MoE), and
MoE inference.

Nothing is implemented yet; importing it gives only this docstring and the
version.
"""

__version__ = "0.1.0"
