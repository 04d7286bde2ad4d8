"""Test-suite settings: one torch thread per process (the suite runs in 2 xdist workers)."""

import torch

torch.set_num_threads(1)
