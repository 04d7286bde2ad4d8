"""The interface every quadrature rule implements.

A rule integrates against a standard normal mean field ``N(0, I_dim)``. For a Gaussian mean field
``N(mu, diag(sigma^2))`` the node ``k`` is ``mu + sigma * X[k]``, and

    E_q[f] ~= sum_k w[k] f(mu + sigma * X[k])            (rasp paper, eq. 9 and 13)

A rule maps ``(dim, step, generator state)`` to a :class:`NodeSet`: the compact state of one
quadrature (a small integer per coordinate for RASP, nothing at all for the Hadamard sequence) from
which any single node is produced in O(dim) time and memory, without the ``(K, dim)`` matrix.
That is how models with 10^7 parameters use the rules::

    nodes = rule.draw(dim, step=t)
    for k in range(len(nodes)):
        x_k = nodes.node(k)          # (dim,) offsets of node k
        ...                          # evaluate at mu + sigma * x_k, weight nodes.weights[k]

:meth:`QuadratureRule.nodes` returns the whole matrix for small problems.
"""

from __future__ import annotations

import abc

import torch

__all__ = ["NodeSet", "QuadratureRule", "check_dim"]


def check_dim(dim: int) -> int:
    """Validate a dimension argument and return it as an ``int``."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
    return dim


class NodeSet(abc.ABC):
    """One quadrature of a rule at a fixed ``(dim, step)``: weights and nodes on demand.

    Subclasses implement :meth:`node` (one node, O(dim)) and :meth:`matrix` (all nodes at once, the
    vectorized path); both must agree exactly.
    """

    def __init__(self, dim: int, weights: torch.Tensor):
        self.dim = dim
        self.weights = weights

    def __len__(self) -> int:
        return self.weights.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @abc.abstractmethod
    def node(self, k: int) -> torch.Tensor:
        """The standardized offsets of node ``k``, shape ``(dim,)``."""

    def matrix(self) -> torch.Tensor:
        """All nodes stacked, shape ``(K, dim)``."""
        return torch.stack([self.node(k) for k in range(len(self))])

    def _check_index(self, k: int) -> int:
        if not 0 <= k < len(self):
            raise IndexError(f"node index {k} out of range for a rule with {len(self)} nodes")
        return k


class QuadratureRule(abc.ABC):
    """A quadrature rule for the standard normal mean field.

    Attributes:
        name: the registered name (see :func:`pyro_quadvi.quadrature.make_rule`).
        num_points: the rule's size parameter (the number of nodes ``K``; for ``gauss_hermite`` the
            number of points per dimension).
        is_random: whether :meth:`draw` consumes random numbers from the generator.
    """

    name: str = ""
    is_random: bool = False

    def __init__(self, num_points: int):
        self.num_points = num_points

    def num_nodes(self, dim: int) -> int:
        """The number of nodes ``K`` of one quadrature in ``dim`` dimensions."""
        return self.num_points

    @abc.abstractmethod
    def draw(
        self,
        dim: int,
        step: int = 0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> NodeSet:
        """The quadrature at position ``step`` of the rule's sequence.

        Random rules draw fresh random numbers from ``generator`` (torch's global generator when
        ``None``, so that ``pyro.set_rng_seed`` makes runs reproducible); deterministic rules ignore
        it. The result is a deterministic function of ``(dim, step, generator state)``.
        """

    def nodes(
        self,
        dim: int,
        step: int = 0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Offsets ``X`` of shape ``(K, dim)`` and weights ``w`` of shape ``(K,)``, summing to 1."""
        node_set = self.draw(dim, step=step, generator=generator, dtype=dtype, device=device)
        return node_set.matrix(), node_set.weights

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_points={self.num_points})"


def equal_weights(num: int, dtype: torch.dtype | None, device) -> torch.Tensor:
    """``num`` weights of ``1 / num``."""
    return torch.full((num,), 1.0 / num, dtype=dtype or torch.get_default_dtype(), device=device)
