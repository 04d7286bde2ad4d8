"""Linear algebra helpers: the fast Walsh-Hadamard transform.

`fwht` is implemented beside the Hadamard quadrature
(`pyro_quadvi.quadrature.hadamard`), whose sign helper gives its matrix entries; this module
is its public home.
"""

from __future__ import annotations

from .quadrature.hadamard import fwht

__all__ = ["fwht"]
