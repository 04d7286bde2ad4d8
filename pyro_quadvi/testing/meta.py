"""Run the package on PyTorch's ``meta`` device, as a stand-in for a GPU that is not there.

A meta tensor has a shape, a dtype and a device, and no values: every operation computes the
shape of its result and nothing else. Two things then behave as on CUDA:

* mixing devices fails: an operation between a meta tensor and a CPU tensor that is not a 0-dim
  scalar raises torch's "Expected all tensors to be on the same device", as it would between a
  CUDA tensor and a CPU one;
* reading a value back to the host (``.item()``, ``bool(t)``, ``.tolist()``, ``nonzero``, a copy
  to the CPU) is impossible: on meta it raises, on CUDA it is a *host sync* (the CPU waits for
  the GPU's queue to drain).

`FakeSync` intercepts those reads on meta tensors, answers them with a made-up value (so
that the run goes on) and counts them, by operation and by the line of ``pyro_quadvi`` that made
them. A run under it therefore surfaces every device-mixing error that a run on CUDA would meet,
and its count is the number of host syncs a step makes on CUDA. The made-up answers: reductions
by ``any`` read as ``False`` (no bad entry found), every other boolean as ``True`` (a check
passes), numbers as ``0``, ``nonzero`` as no index, a copy to the CPU as zeros. They make a
run take its "all is well" branch; its values mean nothing, only devices, shapes and counts do.
"""

from __future__ import annotations

import collections
import traceback
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FakeSync"]

_READS = frozenset({"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "allclose"})


class FakeSync(TorchDispatchMode):
    """A dispatch mode that fakes and counts host syncs on ``meta`` tensors (see the module).

    Use it as a context manager around code that runs on ``meta``:

        with FakeSync() as syncs:
            svi.step(x, y)
        syncs.total  # host syncs of the step on a GPU

    Attributes:
        counts: ``(operation, place) -> number``; ``place`` is ``"file.py:line"`` of the innermost
            frame in ``pyro_quadvi`` (``"outside"`` when the read comes from Pyro or torch alone)
            and the operation is aten's (``_local_scalar_dense`` for ``.item()`` and ``bool``,
            ``_to_copy`` for a copy to the CPU).
        copies: ``place -> number`` of copies of CPU tensors to ``meta`` (``.to(device)``; on
            CUDA a host-to-device transfer each). ``torch.tensor(data, device=...)`` builds its
            tensor before any dispatch mode sees it: it is not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.copies: collections.Counter[str] = collections.Counter()
        self._from_any: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )

    @property
    def total(self) -> int:
        """All host syncs counted."""
        return sum(self.counts.values())

    def by_file(self) -> collections.Counter[str]:
        """Host syncs per file of ``pyro_quadvi`` (line numbers dropped)."""
        files: collections.Counter[str] = collections.Counter()
        for (_, place), number in self.counts.items():
            files[place.rsplit(":", 1)[0]] += number
        return files

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is None:
            return func(*args, **kwargs)
        target = torch.device(kwargs.get("device") or first.device)
        if first.device.type != "meta":
            if name == "_to_copy" and target.type == "meta":
                self.copies[_place()] += 1
            return func(*args, **kwargs)
        if name == "any":
            out = func(*args, **kwargs)
            self._from_any[id(out)] = out
            return out
        to_host = name == "_to_copy" and target.type == "cpu"
        if name not in _READS and not to_host:
            return func(*args, **kwargs)
        self.counts[(name, _place())] += 1
        if to_host:
            return torch.zeros(first.shape, dtype=kwargs.get("dtype") or first.dtype)
        if name == "nonzero":
            return torch.zeros(0, first.dim(), dtype=torch.long, device="meta")
        if name in ("equal", "allclose"):
            return True
        if first.dtype == torch.bool:
            return self._from_any.get(id(first)) is not first
        return 0.0 if first.is_floating_point() else 0


def _place() -> str:
    """``file.py:line`` of the innermost ``pyro_quadvi`` frame of the current stack."""
    for frame in reversed(traceback.extract_stack()):
        parts = frame.filename.replace("\\", "/").split("/pyro_quadvi/")
        if len(parts) > 1 and not parts[-1].startswith("testing/meta.py"):
            return f"{parts[-1]}:{frame.lineno}"
    return "outside"
