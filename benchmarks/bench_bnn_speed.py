"""Cost of one SVI step on a Bayesian network (issue 11, "Speed and memory").

    OMP_NUM_THREADS=1 python benchmarks/bench_bnn_speed.py [--repeats 7] [--steps 10] [--profile]

For three networks (1-50-1 with a Gaussian likelihood at batch 128, 784-200-10 and 784-400-400-10
with a categorical likelihood at batch 128 and 256), on generated float32 inputs, one step of

- **plain**: K = 4 forward+backward passes of the same ``nn.Module`` (``loss.backward()`` on an
  MSE or a cross-entropy, no optimizer), the unit of the ratios;
- **QNVB**: ``SVI(BayesianModule(net, priors.Normal(1.0), likelihood), AutoMeanFieldNormal,
  QNVB(), QuadratureELBO("hadamard", num_points=4))``;
- **Trace**: the same model and guide with ``pyro.optim.Adam({"lr": 1e-3})`` and
  ``Trace_ELBO(num_particles=4, vectorize_particles=True)``.

Blocks of ``--steps`` steps are timed alternately (plain, QNVB, Trace) ``--repeats`` times; the
table shows the median time per step and the ratios of the medians. The QNVB update's share is
the time spent in ``QNVB.__call__`` (a subclass times it) over the time of the QNVB blocks,
median over the blocks.

Peak memory: one step (after the warm-up) under ``torch.profiler.profile(profile_memory=True)``
on the CPU (the least of 3 profiled steps); the peak is the maximum of the running sum of the
allocator's ``[memory]`` events, in time order: the most bytes the step held beyond what was
allocated before it (parameters, guide and optimizer state). The bound is K times the activations
of one plain pass (the bytes of every leaf module's output, from forward hooks) plus the
parameters' bytes.

``--profile`` adds a cProfile of the QNVB step on 784-400-400-10 (cumulative times of the step's
stages) and the top operators of ``torch.profiler`` by self CPU time.

Pyro's validation is left as it is by default (on) for both SVI steps.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import time

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from pyro.optim import PyroOptim
from torch import nn
from torch.profiler import ProfilerActivity, profile

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.nn import BayesianModule, likelihoods, priors

K = 4
DATASET_SIZE = 10_000


class TimedQNVB(QNVB):
    """QNVB that adds the time of each update to ``self.elapsed``."""

    elapsed = 0.0

    def __call__(self, params, *args, **kwargs):
        start = time.perf_counter()
        super().__call__(params, *args, **kwargs)
        self.elapsed += time.perf_counter() - start


class TimedAdam(PyroOptim):
    """Pyro's Adam (``pyro.optim.Adam``) that adds the time of each update to ``self.elapsed``."""

    elapsed = 0.0

    def __init__(self, args: dict):
        super().__init__(torch.optim.Adam, args)

    def __call__(self, params, *args, **kwargs):
        start = time.perf_counter()
        super().__call__(params, *args, **kwargs)
        self.elapsed += time.perf_counter() - start


def make_net(widths: list[int], activation: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        if i > 0:
            layers.append(activation())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def make_case(widths, activation, batch, kind, seed=0):
    torch.manual_seed(seed)
    net = make_net(widths, activation)
    x = torch.randn(batch, widths[0])
    if kind == "gaussian":
        y = torch.randn(batch)
        likelihood = likelihoods.Gaussian(DATASET_SIZE, scale=0.1)

        def plain_loss(out):
            return F.mse_loss(out.squeeze(-1), y)
    else:
        y = torch.randint(0, widths[-1], (batch,))
        likelihood = likelihoods.Categorical(DATASET_SIZE)

        def plain_loss(out):
            return F.cross_entropy(out, y)

    return net, x, y, likelihood, plain_loss


def activation_bytes(net: nn.Module, x: torch.Tensor) -> int:
    """Bytes of every leaf module's output in one plain forward pass."""
    total = 0

    def hook(module, inputs, output):
        nonlocal total
        total += output.numel() * output.element_size()

    handles = [m.register_forward_hook(hook) for m in net.modules() if not list(m.children())]
    with torch.no_grad():
        net(x)
    for h in handles:
        h.remove()
    return total


def peak_bytes(fn, tries: int = 3) -> int:
    """The peak of the running sum of CPU allocations made while ``fn()`` runs (min of tries).

    Frees of tensors allocated before the profile began are not seen (the profiler warns once),
    so a step that replaces such a tensor counts the new one in full: an upper bound.
    """
    peaks = []
    for _ in range(tries):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
        )
        running = peak = 0
        for _, nbytes in events:
            running += nbytes
            peak = max(peak, running)
        peaks.append(peak)
    return min(peaks)


def build(widths, activation, batch, kind):
    net, x, y, likelihood, plain_loss = make_case(widths, activation, batch, kind)

    def plain_step():
        net.zero_grad(set_to_none=True)
        for _ in range(K):
            plain_loss(net(x)).backward()

    bnn = BayesianModule(net, priors.Normal(1.0), likelihood)
    guide_q = AutoMeanFieldNormal(bnn)  # two guides: module_local_params keeps them apart
    guide_t = AutoMeanFieldNormal(bnn)
    optim_q = TimedQNVB()
    svi_q = SVI(bnn, guide_q, optim_q, QuadratureELBO("hadamard", num_points=K))
    optim_t = TimedAdam({"lr": 1e-3})
    svi_t = SVI(
        bnn,
        guide_t,
        optim_t,
        Trace_ELBO(num_particles=K, vectorize_particles=True, max_plate_nesting=1),
    )

    def qnvb_step():
        svi_q.step(x, y)

    def trace_step():
        svi_t.step(x, y)

    for fn in (plain_step, qnvb_step, trace_step):  # set up guides, optimizer states
        fn()
        fn()
    optims = {"qnvb": optim_q, "trace": optim_t}
    return net, x, optims, {"plain": plain_step, "qnvb": qnvb_step, "trace": trace_step}


def time_block(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


CASES = [
    ("1-50-1, B=128, Gaussian", [1, 50, 1], nn.Tanh, 128, "gaussian"),
    ("784-200-10, B=128, Categorical", [784, 200, 10], nn.ReLU, 128, "categorical"),
    ("784-400-400-10, B=256, Categorical", [784, 400, 400, 10], nn.ReLU, 256, "categorical"),
]


def measure(case, repeats: int, steps: int) -> tuple[str, str]:
    name, widths, activation, batch, kind = case
    net, x, optims, fns = build(widths, activation, batch, kind)
    times = {label: [] for label in fns}
    update = {label: [] for label in optims}
    for _ in range(repeats):
        for label, fn in fns.items():
            before = optims[label].elapsed if label in optims else 0.0
            times[label].append(time_block(fn, steps))
            if label in optims:
                update[label].append((optims[label].elapsed - before) / steps)
    plain, quad, trace = (statistics.median(times[k]) for k in ("plain", "qnvb", "trace"))
    u_quad, u_trace = (statistics.median(update[k]) for k in ("qnvb", "trace"))
    speed = (
        f"| {name} | {plain * 1e3:.2f} | {quad * 1e3:.2f} | {trace * 1e3:.2f} | "
        f"{quad / plain:.2f} | {trace / plain:.2f} | {quad / trace:.2f} | "
        f"{u_quad * 1e3:.2f} ({u_quad / quad:.0%}) | {u_trace * 1e3:.2f} ({u_trace / trace:.0%}) |"
    )
    act = activation_bytes(net, x)
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    bound = K * act + params
    peaks = {label: peak_bytes(fn) for label, fn in fns.items()}
    mib = 2.0**20
    memory = (
        f"| {name} | {act / mib:.2f} | {params / mib:.2f} | {bound / mib:.2f} | "
        f"{peaks['plain'] / mib:.2f} | {peaks['qnvb'] / mib:.2f} | {peaks['trace'] / mib:.2f} | "
        f"{peaks['qnvb'] / bound:.2f} |"
    )
    return speed, memory


# (file name ending, function name) -> stage; cumulative times, so stages may nest
STAGES = [
    (("svi.py", "step"), "SVI.step (the whole step)"),
    (("quadrature_elbo.py", "loss_and_grads"), "QuadratureELBO.loss_and_grads"),
    (("trace_messenger.py", "get_trace"), "  traced runs (guide run + model trace at the nodes)"),
    (("mean_field.py", "forward"), "    guide forward (AutoMeanFieldNormal draws a sample)"),
    (("log_joint.py", "_vectorized"), "  model at the K nodes (LogJoint, one pass)"),
    (("module.py", "_evaluate"), "    net under vmap (functional_call)"),
    (("trace_struct.py", "compute_log_prob"), "    log densities (prior on K x P, likelihood)"),
    (("base.py", "matrix"), "  hadamard node matrix (K x D signs)"),
    (("interface.py", "affine"), "  nodes z = loc + sigma x"),
    (("quadrature_elbo.py", "hook"), "  moment publisher hook (in backward)"),
    (("", "<method 'run_backward' of 'torch._C._EngineBase' objects>"), "  backward"),
    (("qnvb.py", "__call__"), "QNVB.__call__ (the update)"),
    (("qnvb.py", "_find_blocks"), "  QNVB._find_blocks"),
    (("qnvb.py", "_update_block"), "  QNVB._update_block"),
    (("qnvb_functional.py", "qnvb_update"), "    qnvb_update"),
    (("", "<built-in method torch.isfinite>"), "isfinite, all calls in the step"),
    (("", "<built-in method torch.where>"), "where, all calls in the step"),
    (("constraints.py", "check"), "Pyro validation: constraint checks"),
]


def run_profile(steps: int) -> None:
    name, widths, activation, batch, kind = CASES[-1]
    _, _, _, fns = build(widths, activation, batch, kind)
    step = fns["qnvb"]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    cumulative = {}
    for (file, _, func), (_, _, _, cum, _) in stats.items():
        for (ending, wanted), label in STAGES:
            if func == wanted and file.endswith(ending):
                cumulative[label] = cumulative.get(label, 0.0) + cum
    total = cumulative[STAGES[0][1]]
    print(f"\ncProfile of {steps} QNVB steps on {name} (cumulative time per step, share):\n")
    print("| stage | ms/step | share |")
    print("|---|---:|---:|")
    for _, label in STAGES:
        if label in cumulative:
            t = cumulative[label]
            print(f"| {label} | {t / steps * 1e3:.2f} | {t / total:.0%} |")
    print("\nTop operators by self CPU time (torch.profiler, 5 steps):")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pyro.settings.set(module_local_params=True)  # each guide holds its own parameters
    torch.set_default_dtype(torch.float32)
    print(f"torch {torch.__version__}, pyro {pyro.__version__}, threads {torch.get_num_threads()}")
    speed_rows, memory_rows = [], []
    for case in CASES:
        speed, memory = measure(case, args.repeats, args.steps)
        print(speed, flush=True)
        speed_rows.append(speed)
        memory_rows.append(memory)
    print(
        f"\n| network | plain {K} passes ms | QNVB step ms | Trace step ms | QNVB / plain | "
        "Trace / plain | QNVB / Trace | QNVB update ms (share) | Adam update ms (share) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(speed_rows))
    print(
        "\n| network | activations of one pass MiB | parameters MiB | bound "
        f"{K} x act + params MiB | plain {K} passes peak MiB | QNVB step peak MiB | "
        "Trace step peak MiB | QNVB peak / bound |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(memory_rows))
    if args.profile:
        run_profile(args.steps * 2)


if __name__ == "__main__":
    main()
