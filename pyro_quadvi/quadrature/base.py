"""The interface every quadrature rule implements.

A rule integrates against a standard normal mean field ``N(0, I_dim)``. For a Gaussian mean field
``N(mu, diag(sigma^2))`` the node ``k`` is ``mu + sigma * X[k]``, and

    E_q[f] ~= sum_k w[k] f(mu + sigma * X[k])            (rasp paper, eq. 9 and 13)

A rule maps ``(dim, step, generator state)`` to a `NodeSet`: the compact state of one
quadrature (a small integer per coordinate for RASP, nothing at all for the Hadamard sequence) from
which any single node is produced in O(dim) time and memory, without the ``(K, dim)`` matrix.
That is how models with 10^7 parameters use the rules:

    nodes = rule.draw(dim, step=t)
    for k in range(len(nodes)):
        x_k = nodes.node(k)          # (dim,) offsets of node k
        ...                          # evaluate at mu + sigma * x_k, weight nodes.weights[k]

`QuadratureRule.nodes` returns the whole matrix for small problems.

Two checks keep a rule usable:

* **curvature** (`QuadratureRule.min_curvature_points`,
  `QuadratureRule.check_sees_curvature`): a variational fit learns the scales from the
  curvature the nodes see along each coordinate, ``sum_k w_k grad L(z_k) x_k``. With a single node,
  or with every node at ``x = 0`` along a coordinate (Gauss-Hermite with one point), that sum is
  blind and the scales stay where they started: such a rule integrates, but cannot fit.
* **memory** (``max_bytes``, `DEFAULT_MAX_BYTES`): a rule refuses, before allocating, any
  array larger than ``max_bytes``: its own tables at construction (RASP keeps ``3 r K`` float64
  entries, so ``K = 20000`` would need 9.6 GB; Gauss-Hermite an ``m x m`` Jacobi matrix), its
  ``num_points`` weights at construction (counted in float64, the widest dtype a draw gives), the
  ``K`` weights of every draw (``K * itemsize``; ``K = m^dim`` for Gauss-Hermite) and the
  ``(K, dim)`` node matrix of `NodeSet.matrix` (``K * dim * itemsize`` bytes). The
  node-at-a-time path (`NodeSet.node`) needs ``dim * itemsize`` bytes per node beyond the
  weights, and its nodes are not limited.

Every `QuadratureRule.draw` starts with `QuadratureRule.check_draw`, the one check of
its arguments: ``dim`` and ``step`` integers (``dim >= 1``, ``step >= 0``), ``generator`` a
``torch.Generator`` or ``None``, ``dtype`` a floating dtype or ``None`` (an integer dtype would
round the weights ``1 / K`` to 0). float16 and bfloat16 are accepted: the nodes and weights are
computed in float64 and rounded to the dtype, so the exactness of a rule holds to its rounding
(second moments off by up to ``1.0e-3`` in float16 and ``8.1e-3`` in bfloat16 for ``vrmc2`` with
3 nodes on 1e5 coordinates, ``5.4e-4`` in float16 for ``rasp_simplex`` with 7).
"""

from __future__ import annotations

import abc
import contextlib
import operator
from collections.abc import Iterator

import torch

__all__ = ["DEFAULT_MAX_BYTES", "NodeSet", "QuadratureRule", "check_dim", "check_num_points"]

DEFAULT_MAX_BYTES = 2**30
"""The default ``max_bytes`` of every rule: 1 GiB for any one array a rule allocates (its tables,
or the ``(K, dim)`` node matrix). Pass ``max_bytes`` to the rule (``make_rule(name, K,
max_bytes=...)``) to allow more."""


def format_bytes(num_bytes: int) -> str:
    """``num_bytes`` exactly, and in GiB: ``"6400000000 bytes (5.96 GiB)"``."""
    return f"{num_bytes} bytes ({num_bytes / 2**30:.3g} GiB)"


def check_max_bytes(max_bytes: int) -> int:
    """Validate a ``max_bytes`` argument and return it."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be an integer >= 1, got {max_bytes!r}")
    return max_bytes


WEIGHT_ITEMSIZE = torch.float64.itemsize
"""Bytes per weight counted at construction, before the dtype of a draw is known: float64's, the
widest dtype a draw accepts."""


def as_index(value: object) -> int | None:
    """``value`` as a Python ``int`` if it is an integer (numpy's, a 0-d integer tensor), else
    ``None`` (a bool is not one)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_num_points(num_points: object) -> int:
    """``num_points`` as an ``int``, refused with a ``ValueError`` unless it is an integer
    (numpy's or a 0-d integer tensor too, not a bool); each rule then checks its own range. Every
    rule's constructor runs it first: a float, NaN or ``None`` failed later, or deep in torch."""
    index = as_index(num_points)
    if index is None:
        raise ValueError(
            f"num_points must be an int, got {num_points!r} ({type(num_points).__name__})"
        )
    return index


def check_dtype(owner: str, dtype: object, why: str = "") -> torch.dtype:
    """``dtype``, refused naming ``owner`` unless it is a floating ``torch.dtype`` (``why``
    follows the refusal): an int was taken for a device by ``Tensor.to`` ("Cannot access
    accelerator device when none is available"), a string named neither."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"{owner}: dtype must be a floating torch.dtype (torch.float32, torch.float64, ...), "
            f"got {dtype!r}{why}"
        )
    return dtype


def check_device(owner: str, device: object) -> None:
    """Refuse a ``device`` that torch cannot read as one (``None``, a ``torch.device``, a string
    such as ``"cuda:0"`` or a CUDA index are taken), naming ``owner`` and torch's reason: its
    own message ("Expected one of cpu, cuda, ...", "Cannot access accelerator device") named no
    argument."""
    if device is None or isinstance(device, torch.device):
        return
    try:
        torch.device(device)
    except (RuntimeError, TypeError) as error:
        reason = str(error).splitlines()[0]
        raise ValueError(
            f"{owner}: device must be a torch.device, a device string ('cpu', 'cuda:0') or "
            f"None, got {device!r}: {reason}"
        ) from error


def check_dim(dim: int) -> int:
    """Validate a dimension argument and return it as an ``int``."""
    index = as_index(dim)
    if index is None or index < 1:
        raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
    return index


class NodeSet(abc.ABC):
    """One quadrature of a rule at a fixed ``(dim, step)``: weights and nodes on demand.

    Subclasses implement `node` (one node, O(dim)) and may implement `_matrix` (all
    nodes at once, the vectorized path); both must agree exactly.

    Args:
        dim: the number of coordinates.
        weights: the ``K`` weights.
        name: the rule's name, for error messages.
        max_bytes: the largest node matrix `matrix` builds.
    """

    def __init__(
        self,
        dim: int,
        weights: torch.Tensor,
        name: str = "quadrature",
        max_bytes: int = DEFAULT_MAX_BYTES,
    ):
        self.dim = dim
        self.weights = weights
        self.name = name
        self.max_bytes = max_bytes

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
        """The standardized offsets of node ``k``, shape ``(dim,)``.

        Raises:
            ValueError: for a ``k`` that is not an integer; ``IndexError`` out of ``[0, K)``.
        """

    def matrix_bytes(self) -> int:
        """Bytes of the ``(K, dim)`` node matrix: ``K * dim * itemsize``."""
        return len(self) * self.dim * self.dtype.itemsize

    def matrix(self) -> torch.Tensor:
        """All nodes stacked, shape ``(K, dim)``.

        Raises:
            ValueError: before allocating, when the matrix would exceed ``max_bytes``.
        """
        needed = self.matrix_bytes()
        if needed > self.max_bytes:
            raise ValueError(
                f"the {len(self)} x {self.dim} node matrix of {self.name} needs "
                f"K * dim * itemsize = {len(self)} * {self.dim} * {self.dtype.itemsize} = "
                f"{format_bytes(needed)}, more than max_bytes={format_bytes(self.max_bytes)}; "
                "use fewer nodes, produce them one at a time with draw(...).node(k), "
                "or pass a larger max_bytes to the rule"
            )
        return self._matrix()

    def _matrix(self) -> torch.Tensor:
        """All nodes stacked, without the memory check; subclasses override it when faster."""
        return torch.stack([self.node(k) for k in range(len(self))])

    def _check_index(self, k: int) -> int:
        """``k`` as an ``int`` (numpy's integers and 0-d integer tensors too), refused with a
        ``ValueError`` naming ``k`` unless it is an integer (each rule failed its own way on
        ``1.0``, and ``mc``/``vrmc*`` on ``np.int64(1)``), an ``IndexError`` out of range."""
        index = as_index(k)
        if index is None:
            raise ValueError(
                f"{self.name}: node index k must be an int, got {k!r} ({type(k).__name__})"
            )
        k = index
        if not 0 <= k < len(self):
            raise IndexError(f"node index {k} out of range for a rule with {len(self)} nodes")
        return k


class QuadratureRule(abc.ABC):
    """A quadrature rule for the standard normal mean field.

    Attributes:
        name: the registered name (see `pyro_quadvi.quadrature.make_rule`).
        num_points: the rule's size parameter (the number of nodes ``K``; for ``gauss_hermite`` the
            number of points per dimension).
        is_random: whether `draw` consumes random numbers from the generator.
        exact_coordinate_quadratics: whether every quadrature the rule draws integrates ``1``,
            ``x_j`` and ``x_j^2`` exactly along each coordinate (``sum_k w_k = 1``,
            ``sum_k w_k x_kj = 0``, ``sum_k w_k x_kj^2 = 1``): then the expectation of a Gaussian
            prior's log density at the nodes equals its closed form, which
            `QuadratureELBO` uses instead (``False`` unless a rule
            says so).
        min_curvature_points: the fewest ``num_points`` with which every coordinate has a node off
            the mean, so that a fit can learn the scales (`check_sees_curvature`).
        max_bytes: the largest array the rule allocates (its tables, the node matrix).

    Args:
        num_points: the rule's size parameter.
        max_bytes: see above; `DEFAULT_MAX_BYTES` by default.

    Raises:
        ValueError: when the rule's own tables (`table_bytes`) would exceed ``max_bytes``.
    """

    name: str = ""
    is_random: bool = False
    exact_coordinate_quadratics: bool = False
    min_curvature_points: int = 2

    def __init__(self, num_points: int, max_bytes: int = DEFAULT_MAX_BYTES):
        num_points = self.num_points = check_num_points(num_points)
        self.max_bytes = check_max_bytes(max_bytes)
        weights = f"{num_points} float64 weights: {num_points} * {WEIGHT_ITEMSIZE}"
        for description, needed in (
            (self._table_description(), self.table_bytes()),
            (weights, num_points * WEIGHT_ITEMSIZE),
        ):
            if needed > self.max_bytes:
                raise ValueError(
                    f"{self.name} with num_points={num_points} needs {description} "
                    f"= {format_bytes(needed)} at construction, more than "
                    f"max_bytes={format_bytes(self.max_bytes)}; use fewer points, "
                    "or pass a larger max_bytes"
                )

    def table_bytes(self) -> int:
        """Bytes of the tables the rule builds at construction (none unless overridden)."""
        return 0

    def _table_description(self) -> str:
        """What `table_bytes` counts, for the error message."""
        return "tables"

    def check_sees_curvature(self, nodes: torch.Tensor | None = None) -> None:
        """Refuse a rule that cannot fit the scales of a mean field.

        A fit learns ``sigma`` from ``sum_k w_k grad L(z_k) x_k`` (Stein's identity): with fewer
        than two nodes, or with ``x = 0`` at every node along a coordinate, the scales see no
        curvature and stay at their initial value. ``QuadratureELBO`` calls this once.

        Args:
            nodes: optionally, one quadrature's ``(K, dim)`` offsets, checked coordinate by
                coordinate (for rules whose ``num_points`` alone does not tell).

        Raises:
            ValueError: naming the minimum ``num_points`` (or the blind coordinate), or for
                ``nodes`` that are not a floating ``(K, dim)`` tensor (a 1-D one passed unchecked,
                a list failed with an AttributeError).
        """
        if self.num_points < self.min_curvature_points:
            raise ValueError(
                f"{self.name} with num_points={self.num_points} cannot fit the scales of a mean "
                f"field: it needs num_points >= {self.min_curvature_points} (with fewer, every "
                "node sits at the mean along some coordinate, or there is only one node, so the "
                "scales see no curvature and stay at their initial value)"
            )
        if nodes is None:
            return
        if not (isinstance(nodes, torch.Tensor) and nodes.dim() == 2 and nodes.is_floating_point()):
            got = (
                f"a tensor of shape {tuple(nodes.shape)} and dtype {nodes.dtype}"
                if isinstance(nodes, torch.Tensor)
                else f"a {type(nodes).__name__}"
            )
            raise ValueError(
                f"{self.name}: check_sees_curvature needs nodes as a floating (K, dim) tensor "
                f"(rule.nodes(dim)[0]), got {got}"
            )
        if nodes.shape[0] < 2:
            raise ValueError(
                f"{self.name} has {nodes.shape[0]} node(s): a fit needs at least 2 to see curvature"
            )
        blind = (nodes == 0).all(dim=0).nonzero()
        if blind.numel():
            raise ValueError(
                f"{self.name}: every node has x = 0 along coordinate {int(blind[0])} "
                f"({blind.numel()} such coordinates), so its scale sees no curvature and would "
                "stay at its initial value"
            )

    def num_nodes(self, dim: int) -> int:
        """The number of nodes ``K`` of one quadrature in ``dim`` dimensions."""
        return self.num_points

    def check_draw(
        self,
        dim: int,
        step: int,
        generator: torch.Generator | None,
        dtype: torch.dtype | None,
        device: object = None,
    ) -> tuple[int, int, torch.dtype]:
        """Validate the arguments of `draw`; every rule's ``draw`` calls it first.

        Returns:
            ``(dim, step, dtype)``, with ``dtype`` resolved to torch's default when ``None``.

        Raises:
            ValueError: naming the argument, for a ``dim`` that is not an integer >= 1, a
                ``step`` that is not an integer >= 0, a ``generator`` that is not a
                ``torch.Generator`` (nor ``None``), a ``dtype`` that is not a floating dtype
                (integer weights would round ``1 / K`` to 0), a ``device`` that is none
                (`check_device`), or ``K`` weights of more than ``max_bytes``.
        """
        dim = check_dim(dim)
        index = as_index(step)
        if index is None or index < 0:
            raise ValueError(f"{self.name}: step must be >= 0 (an integer), got {step!r}")
        step = index
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(
                f"{self.name}: generator must be a torch.Generator or None, got {generator!r} "
                f"({type(generator).__name__}); pass torch.Generator().manual_seed(seed), or "
                "None for torch's global generator"
            )
        if dtype is None:
            dtype = torch.get_default_dtype()
        why = ": the weights 1 / K and the nodes are not integers"
        dtype = check_dtype(self.name, dtype, why)
        check_device(self.name, device)
        num = self.num_nodes(dim)
        needed = num * dtype.itemsize
        if needed > self.max_bytes:
            raise ValueError(
                f"the {num} weights of {self.name} in {dim} dimensions need K * itemsize = "
                f"{num} * {dtype.itemsize} = {format_bytes(needed)}, more than "
                f"max_bytes={format_bytes(self.max_bytes)}; use fewer nodes, or pass a larger "
                "max_bytes to the rule"
            )
        return dim, step, dtype

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

        Implementations start with `check_draw`. Random rules draw fresh random numbers
        from ``generator`` (torch's global generator when ``None``, so that
        ``pyro.set_rng_seed`` makes runs reproducible); deterministic rules ignore it (after
        checking it). The result is a deterministic function of ``(dim, step, generator state)``;
        for the built-in rules ``dtype`` only rounds it.
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


def draw_device(generator: torch.Generator | None, device) -> torch.device | str | None:
    """Where to draw random numbers from ``generator``: on its own device (torch refuses a CPU
    generator for a CUDA tensor), else, for torch's global generators, on ``device``. The caller
    moves the draw to ``device``: a CPU generator then serves a rule on any device, and its draws
    are the same numbers whatever the device."""
    return generator.device if generator is not None else device


@contextlib.contextmanager
def generator_kept(generator: torch.Generator | None) -> Iterator[None]:
    """Put ``generator`` back to its state on entry where the block raises (an error, a Ctrl-C):
    a step that did not happen has drawn nothing, and the next one draws the nodes the
    interrupted one drew, as a run without it would. torch's global generator (``None``) is left
    as it is: other code draws from it too (Pyro's, the user's), and its state is theirs."""
    state = None if generator is None else generator.get_state()
    try:
        yield
    except BaseException:
        if state is not None:
            generator.set_state(state)
        raise
