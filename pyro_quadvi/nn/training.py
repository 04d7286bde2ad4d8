"""``fit``: the plain SVI loop of the tutorials, with a progress bar and a history.

Nothing here is needed to train: ``for step in range(n): svi.step(x, y)`` does the same. ``fit``
only adds what a tutorial wants to show: a tqdm bar with the current loss, minibatches drawn from
any iterable (a ``DataLoader``, re-iterated when it runs out), and a history of the loss and of
metrics evaluated every so many steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from pyro.infer import SVI
from tqdm.auto import tqdm

__all__ = ["History", "fit"]


@dataclass
class History:
    """What :func:`fit` recorded.

    Attributes:
        loss: the loss ``svi.step`` returned at every step.
        metrics: name -> ``[(step, value), ...]``, evaluated after the steps ``every``,
            ``2 every``, ... and after the last step.
    """

    loss: list[float] = field(default_factory=list)
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def _batches(data: tuple | Iterable) -> Iterator[tuple]:
    if isinstance(data, tuple):
        while True:
            yield data
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch if isinstance(batch, tuple | list) else (batch,)
        if empty:
            raise ValueError("fit: the data iterable yielded no batch")


def fit(
    svi: SVI,
    data: tuple | Iterable,
    num_steps: int,
    *,
    metrics: dict[str, Callable[[], float]] | None = None,
    every: int = 100,
    progress: bool = True,
    desc: str = "SVI",
) -> History:
    """Run ``num_steps`` of ``svi.step`` and record the loss and ``metrics``.

    Args:
        svi: a ``pyro.infer.SVI`` (any guide, optimizer and ELBO).
        data: the arguments of every step (a tuple, e.g. ``(x, y)``: the full batch), or an
            iterable of such tuples (minibatches, e.g. a ``DataLoader``), cycled.
        num_steps: how many steps.
        metrics: name -> a function of nothing returning a number (e.g. a test NLL), evaluated
            every ``every`` steps and after the last one.
        every: the spacing of the metric evaluations, in steps.
        progress: show a tqdm bar with the latest loss.
        desc: the bar's label.

    Raises:
        ValueError: for ``num_steps < 0``, ``every < 1``, or an empty iterable.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"fit: num_steps must be an integer >= 0, got {num_steps!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"fit: every must be an integer >= 1, got {every!r}")
    history = History(metrics={name: [] for name in metrics or {}})
    batches = _batches(data)
    bar = tqdm(range(num_steps), disable=not progress, desc=desc)
    for step in bar:
        history.loss.append(svi.step(*next(batches)))
        bar.set_postfix(loss=f"{history.loss[-1]:.4g}", refresh=False)
        done = step + 1
        if metrics and (done % every == 0 or done == num_steps):
            for name, metric in metrics.items():
                history.metrics[name].append((done, float(metric())))
    return history
