"""Cost of one SVI step on a Bayesian network (issue 11, "Speed and memory").

    OMP_NUM_THREADS=1 python benchmarks/bench_bnn_speed.py [--repeats 7] [--steps 10] [--profile]
        [--no-compile] [--update-only] [--nets 1-50-1 784-200-10 784-400-400-10 table2-cnn
        1024-1800-1800-10]
        [--clock wall|cpu] [--batch 1024] [--floor] [--memory-split] [--memory-trace] [--guide-run]
        [--device cuda] [--rule hadamard]

For four networks (1-50-1 with a Gaussian likelihood at batch 128; 784-200-10, 784-400-400-10 and
the convolutional network of the sequence paper's Table 2 with a categorical likelihood at batch
128, 256 and 64), on generated float32 inputs, one step of

- **plain**: K = 4 forward+backward passes of the same ``nn.Module`` (``loss.backward()`` on an
  MSE or a cross-entropy, no optimizer), the unit of the ratios;
- **QNVB**: ``SVI(BayesianModule(net, priors.Normal(1.0), likelihood, qnvb_settings={}),
  AutoMeanFieldNormal, QNVB(), QuadratureELBO("hadamard", num_points=4))``: QNVB's own settings,
  as in every recorded row;
- **QNVB declared**: the same on ``BayesianModule(net, priors.Normal(1.0), likelihood)``, whose
  weights declare the network settings (``NETWORK_QNVB_SETTINGS``: a trust region and the
  significance test add work to the update);
- **QNVB compiled**: the same with ``QNVB(compile=True)`` (the update through ``torch.compile``);
- **Trace**: the same model and guide with ``pyro.optim.Adam({"lr": 1e-3})`` and
  ``Trace_ELBO(num_particles=4, vectorize_particles=True)``;
- **opt loop**: the plain-torch ``QNVBOptimizer`` (Hadamard, K = 4) with a closure evaluated at
  each node in turn;
- **opt pass**: the same optimizer with ``step(loss_fn=module_loss(net, criterion), batch=(x,
  y))``: all nodes in one ``vmap`` pass, one backward; **opt pass compiled** with
  ``compile=True``.

The Table 2 network is ``table2_cnn`` of ``bench_bnn_quality.py`` (ReLU after grouped 1x1
convolutions in place of the paper's ternary units; 28 x 28 inputs, padded to 32 x 32 inside the
net). ``--nets`` keeps the networks named (by default all four; 1024-1800-1800-10, a 5 M-weight
MLP with a categorical likelihood at batch 128, runs only when named); ``--batch`` runs every one
of them at that batch size instead.

Blocks of ``--steps`` steps are timed alternately (each variant in turn) ``--repeats`` times; the
table shows the median time per step and the ratios of the medians. ``--clock wall`` (the
default) times them with ``time.perf_counter``; ``--clock cpu`` with ``time.process_time``, the
CPU time of this (single-threaded) process, which leaves out the time spent waiting for a core
on a machine that other jobs load. An update's share is the
time spent in the optimizer's update (``QNVB.__call__``, Adam's ``__call__``,
``QNVBOptimizer._update``; subclasses time them) over the time of the same blocks, median over the
blocks. Compilation happens in the warm-up steps, outside the timed blocks.

Peak memory: one step (after the warm-up) under ``torch.profiler.profile(profile_memory=True)``
on the CPU (the least of 3 profiled steps); the peak is the maximum of the running sum of the
CPU allocations and frees in the profiler's event tree, in time order: the most bytes the step
held beyond what was allocated before it (parameters, guide and optimizer state). The bound is K
times the activations of one plain pass (the bytes of every distinct storage that a module's
forward returns, from forward hooks on every module: a view such as ``Flatten``'s, or a
container's output, is counted once) plus the parameters' bytes.

``--memory-split`` prints only where the QNVB step's peak is (the forward and backward at the
nodes, the update), against K times the activations and K times one plain pass's own peak (a
plain backward holds gradients beside the saved activations). ``--memory-trace`` prints only what
one plain pass and the step's forward and backward hold at their peaks, by allocating operator.

``--profile`` adds, on 784-400-400-10 (on each network of ``--nets`` where given), a cProfile of
the QNVB step and of the one-pass ``QNVBOptimizer`` step (cumulative times of their stages; eager
updates) and the top operators of ``torch.profiler`` by self CPU time.

``--guide-run`` prints only the time of the guide's traced run as ``QuadratureELBO`` makes it
(every auxiliary draw given its mean) against the same run drawing every coordinate.

``--floor`` first times one elementwise pass, ``torch.add(a, b, out=c)``, over ``K x P`` and over
``P`` floats (``P`` the network's parameter count; median of ``repeats x steps`` blocks of 10
passes, same clock): the unit of a bandwidth floor for the step's work on ``K x P`` entries (the
node points, the sums over the nodes) and the update's on ``P``.

``--profile`` on ``--device cuda`` adds, per step, the kernels' GPU time, the launches, the
host's waits for the GPU and the copies between host and GPU, with the Python lines of the waits
and copies. ``--validation off`` turns Pyro's validation off for the whole run.

``--device cuda`` runs the networks, their data and every optimizer on the GPU: the clock then
waits for the GPU's queue to drain before each reading (``torch.cuda.synchronize``, in the update
shares too), and a peak is ``torch.cuda.max_memory_allocated`` during the step above what was
allocated before it (least of 3).

Pyro's validation is on by default (Pyro's own default) for both SVI steps.

``--rule NAME`` gives the SVI steps' ``QuadratureELBO`` that rule: ``hadamard`` (the default)
with K = 4 nodes as above, any other with its own default number of nodes (``blocked_simplex``:
``QuadratureELBO()``'s default rule, 3 nodes). The plain passes, the optimizer rows and their
quadrature stay as they are.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import math
import pstats
import statistics
import time
from functools import partial

import pyro
import torch
import torch.nn.functional as F
from bench_bnn_quality import table2_cnn
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.optim import PyroOptim
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from pyro_quadvi import QNVB, AutoMeanFieldNormal, QuadratureELBO
from pyro_quadvi.guides.interface import trace_for_description
from pyro_quadvi.nn import BayesianModule, likelihoods, priors
from pyro_quadvi.optim import QNVBOptimizer, module_loss
from pyro_quadvi.optim.qnvb_functional import (
    QNVBHyperparameters,
    init_qnvb_state,
    qnvb_update,
    qnvb_update_many,
)
from pyro_quadvi.quadrature import RULES

K = 4
DATASET_SIZE = 10_000
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]  # set by --clock (and by --device cuda)
DEVICE = torch.device("cpu")  # set by --device
RULE = "hadamard"  # set by --rule


def quadrature_elbo() -> QuadratureELBO:
    """The SVI steps' ELBO: Hadamard with K nodes, or ``--rule`` with its default nodes."""
    if RULE == "hadamard":
        return QuadratureELBO("hadamard", num_points=K)
    return QuadratureELBO(RULE)


def synced_clock() -> float:
    """``time.perf_counter`` after the GPU's queue has drained (the clock of ``--device cuda``)."""
    torch.cuda.synchronize()
    return time.perf_counter()


class TimedQNVB(QNVB):
    """QNVB that adds the time of each update to ``self.elapsed``."""

    elapsed = 0.0

    def __call__(self, params, *args, **kwargs):
        start = clock()
        super().__call__(params, *args, **kwargs)
        self.elapsed += clock() - start


class RecordingQNVB(QNVB):
    """QNVB keeping the parameters ``SVI`` handed its last update (to run the update alone)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params: list[torch.Tensor] = []

    def __call__(self, params, *args, **kwargs):
        self.params = list(params)
        super().__call__(self.params, *args, **kwargs)


class TimedQNVBOptimizer(QNVBOptimizer):
    """QNVBOptimizer that adds the time of each update (after the loss and gradients) to
    ``self.elapsed``."""

    elapsed = 0.0

    def _update(self, params, moments, weight, settings):
        start = clock()
        super()._update(params, moments, weight, settings)
        self.elapsed += clock() - start


class TimedAdam(PyroOptim):
    """Pyro's Adam (``pyro.optim.Adam``) that adds the time of each update to ``self.elapsed``."""

    elapsed = 0.0

    def __init__(self, args: dict):
        super().__init__(torch.optim.Adam, args)

    def __call__(self, params, *args, **kwargs):
        start = clock()
        super().__call__(params, *args, **kwargs)
        self.elapsed += clock() - start


def make_net(widths: list[int], activation: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        if i > 0:
            layers.append(activation())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def make_case(make, in_shape, batch, kind, seed=0):
    """The network ``make()`` (seeded), ``batch`` inputs of ``in_shape``, targets, likelihood and
    the plain loss; a categorical network's output size is the number of classes."""
    torch.manual_seed(seed)
    net = make().to(DEVICE)
    x = torch.randn(batch, *in_shape, device=DEVICE)
    if kind == "gaussian":
        y = torch.randn(batch, device=DEVICE)
        likelihood = likelihoods.Gaussian(DATASET_SIZE, scale=0.1)

        def criterion(out, target):
            return F.mse_loss(out.squeeze(-1), target)
    else:
        with torch.no_grad():
            num_classes = net(x[:1]).shape[-1]
        y = torch.randint(0, num_classes, (batch,), device=DEVICE)
        likelihood = likelihoods.Categorical(DATASET_SIZE)

        criterion = F.cross_entropy

    return net, x, y, likelihood, criterion


def activation_bytes(net: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages of every module's output in one plain forward pass (a view,
    or a container returning its last layer's output, counts once; so does a module calling a
    function such as ``torch.relu`` in its own forward)."""
    storages = {}  # data pointer -> storage, held so that no address is reused during the pass

    def hook(module, inputs, output):
        storage = output.untyped_storage()
        storages[storage.data_ptr()] = storage

    handles = [m.register_forward_hook(hook) for m in net.modules()]
    with torch.no_grad():
        net(x)
    for h in handles:
        h.remove()
    return sum(storage.nbytes() for storage in storages.values())


def cpu_allocations(fn) -> list[tuple[int, int, int, str]]:
    """Every CPU allocation and free made while ``fn()`` runs, in time order: (time in ns, address,
    bytes, negative for a free, and the operator that made it as ``"caller > operator"``), from
    ``torch.profiler``'s event tree with ``profile_memory=True``."""
    events = []

    def walk(node) -> None:
        if node.tag != _EventType.Allocation:
            for child in node.children:
                walk(child)
        elif node.extra_fields.device.type == "cpu":
            op = node.parent
            callers = [op.parent, op] if op is not None else []
            made_by = " > ".join(n.name for n in callers if n is not None) or "(no operator)"
            events.append(
                (node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size, made_by)
            )

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return sorted(events)


def live_at_peak(fn) -> tuple[int, dict[str, int]]:
    """The peak of the running sum of the CPU allocations made while ``fn()`` runs, and the bytes
    still held at that peak grouped by the operator that allocated them.

    Frees of tensors allocated before the profile began are not seen (the profiler warns once),
    so a step that replaces such a tensor counts the new one in full: an upper bound.
    """
    live: dict[int, tuple[int, str]] = {}
    running = peak = 0
    held: dict[int, tuple[int, str]] = {}
    for _, address, nbytes, made_by in cpu_allocations(fn):
        if nbytes > 0:
            live[address] = (nbytes, made_by)
        elif address in live:
            del live[address]
        else:
            continue
        running += nbytes
        if running > peak:
            peak, held = running, dict(live)
    by_operator: dict[str, int] = {}
    for nbytes, made_by in held.values():
        by_operator[made_by] = by_operator.get(made_by, 0) + nbytes
    return peak, by_operator


def cuda_peak(fn) -> int:
    """The most bytes of CUDA memory held while ``fn()`` runs beyond what was held before it
    (``torch.cuda.max_memory_allocated``: the caching allocator's peak of allocated blocks)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def peak_bytes(fn, tries: int = 3) -> int:
    """The least over ``tries`` of the step's peak: :func:`live_at_peak`'s on the CPU,
    :func:`cuda_peak`'s on CUDA."""
    if DEVICE.type == "cuda":
        return min(cuda_peak(fn) for _ in range(tries))
    return min(live_at_peak(fn)[0] for _ in range(tries))


def build(make, in_shape, batch, kind, compile: bool = True):
    net, x, y, likelihood, criterion = make_case(make, in_shape, batch, kind)

    def plain_step():
        net.zero_grad(set_to_none=True)
        for _ in range(K):
            criterion(net(x), y).backward()

    bnn = BayesianModule(net, priors.Normal(1.0), likelihood, qnvb_settings={})
    declared = BayesianModule(net, priors.Normal(1.0), likelihood)  # the network settings
    guides = {}
    fns, optims = {"plain": plain_step}, {}

    def svi_step(label, optim, loss, model=bnn):
        guides[label] = AutoMeanFieldNormal(model)  # module_local_params keeps the guides apart
        svi = SVI(model, guides[label], optim, loss)
        optims[label] = optim
        fns[label] = lambda: svi.step(x, y)

    quadrature = quadrature_elbo()
    svi_step("qnvb", TimedQNVB(), quadrature)
    svi_step("qnvb declared", TimedQNVB(), quadrature, model=declared)
    if compile:
        svi_step("qnvb compiled", TimedQNVB(compile=True), quadrature)
    trace = Trace_ELBO(num_particles=K, vectorize_particles=True, max_plate_nesting=1)
    svi_step("trace", TimedAdam({"lr": 1e-3}), trace)

    def optimizer_step(label, one_pass, compile_update=False):
        copy = make_case(make, in_shape, batch, kind)[0]
        optimizer = TimedQNVBOptimizer(
            copy.named_parameters(),
            likelihood_weight=DATASET_SIZE,
            prior_precision=1.0,
            quadrature="hadamard",
            num_eval=K,
            compile=compile_update,
        )
        optims[label] = optimizer
        if one_pass:
            loss_fn = module_loss(copy, criterion)
            fns[label] = lambda: optimizer.step(loss_fn=loss_fn, batch=(x, y), vectorize=True)
        else:

            def closure():
                loss = criterion(copy(x), y)
                loss.backward()
                return loss

            fns[label] = lambda: optimizer.step(closure)

    optimizer_step("opt loop", one_pass=False)
    optimizer_step("opt pass", one_pass=True)
    if compile:
        optimizer_step("opt pass compiled", one_pass=True, compile_update=True)
    for fn in fns.values():  # set up guides, optimizer states, compiled updates
        fn()
        fn()
    return net, x, optims, fns


def time_block(fn, steps: int) -> float:
    start = clock()
    for _ in range(steps):
        fn()
    return (clock() - start) / steps


def mlp(widths: list[int], activation: type[nn.Module]):
    return lambda: make_net(widths, activation)


#: key -> (network name, network factory, input shape, default batch, likelihood)
CASES = {
    "1-50-1": ("1-50-1", mlp([1, 50, 1], nn.Tanh), (1,), 128, "gaussian"),
    "784-200-10": ("784-200-10", mlp([784, 200, 10], nn.ReLU), (784,), 128, "categorical"),
    "784-400-400-10": (
        "784-400-400-10",
        mlp([784, 400, 400, 10], nn.ReLU),
        (784,),
        256,
        "categorical",
    ),
    "table2-cnn": ("Table 2 CNN (ReLU)", table2_cnn, (1, 28, 28), 64, "categorical"),
    "1024-1800-1800-10": (
        "1024-1800-1800-10",
        mlp([1024, 1800, 1800, 10], nn.ReLU),
        (1024,),
        128,
        "categorical",
    ),
}
#: the networks run without ``--nets`` (the 5 M-weight MLP only when named)
DEFAULT_NETS = ("1-50-1", "784-200-10", "784-400-400-10", "table2-cnn")


def row_name(case) -> str:
    """The table row of a case: network, batch, likelihood."""
    name, _, _, batch, kind = case
    return f"{name}, B={batch}, {kind.capitalize()}"


def measure(case, repeats: int, steps: int, compile: bool) -> tuple[str, str, list[str]]:
    _, make, in_shape, batch, kind = case
    name = row_name(case)
    net, x, optims, fns = build(make, in_shape, batch, kind, compile)
    times = {label: [] for label in fns}
    update = {label: [] for label in optims}
    for _ in range(repeats):
        for label, fn in fns.items():
            before = optims[label].elapsed if label in optims else 0.0
            times[label].append(time_block(fn, steps))
            if label in optims:
                update[label].append((optims[label].elapsed - before) / steps)
    median = {label: statistics.median(t) for label, t in times.items()}
    plain = median["plain"]
    cells = [f"{plain * 1e3:.2f}"]
    for label in fns:
        if label == "plain":
            continue
        t = median[label]
        u = statistics.median(update[label])
        cells.append(f"{t * 1e3:.2f} ({t / plain:.2f}x) [{u / t:.0%}]")
    speed = f"| {name} | " + " | ".join(cells) + " |"
    act = activation_bytes(net, x)
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    bound = K * act + params
    peaks = {label: peak_bytes(fns[label]) for label in ("plain", "qnvb", "trace", "opt pass")}
    mib = 2.0**20
    memory = (
        f"| {name} | {act / mib:.2f} | {params / mib:.2f} | {bound / mib:.2f} | "
        + " | ".join(f"{peaks[label] / mib:.2f}" for label in peaks)
        + f" | {peaks['qnvb'] / bound:.2f} | {peaks['opt pass'] / bound:.2f} |"
    )
    return speed, memory, list(fns)


# (file name ending, function name) -> stage; cumulative times, so stages may nest
STAGES = {
    "qnvb": [
        (("svi.py", "step"), "SVI.step (the whole step)"),
        (("quadrature_elbo.py", "loss_and_grads"), "QuadratureELBO.loss_and_grads"),
        (("trace_messenger.py", "get_trace"), "  traced runs (guide run + model trace)"),
        (("mean_field.py", "forward"), "    guide forward (AutoMeanFieldNormal draws a sample)"),
        (("log_joint.py", "_vectorized"), "  model at the K nodes (LogJoint, one pass)"),
        (("module.py", "_evaluate"), "    net under vmap (functional_call)"),
        (("trace_struct.py", "compute_log_prob"), "    log densities (likelihood)"),
        (("base.py", "matrix"), "  the rule's node matrix (K x D)"),
        (("quadrature_elbo.py", "forward"), "  nodes z = loc + sigma x (_NodePoints)"),
        (("quadrature_elbo.py", "expected_log_prior"), "  priors in closed form (the loss's term)"),
        (("", "<method 'run_backward' of 'torch._C._EngineBase' objects>"), "  backward"),
        (("quadrature_elbo.py", "backward"), "    node sums, priors' parts, moments (_NodePoints)"),
        (("qnvb.py", "__call__"), "QNVB.__call__ (the update)"),
        (("qnvb.py", "find_blocks"), "  QNVB.find_blocks (pairing)"),
        (("qnvb.py", "_prepare_block"), "  QNVB._prepare_block (scales, moments)"),
        (("qnvb_functional.py", "qnvb_update_many"), "  qnvb_update_many (the rules)"),
        (("qnvb.py", "_finish_block"), "  QNVB._finish_block (inverse softplus, writes)"),
        (("qnvb.py", "_finish_together"), "  QNVB._finish_together (the same, all blocks at once)"),
        (("constraints.py", "check"), "Pyro validation: constraint checks"),
    ],
    "opt pass": [
        (("torch_qnvb.py", "step"), "QNVBOptimizer.step (the whole step)"),
        (("torch_qnvb.py", "_one_pass_moments"), "  loss and moments at the K nodes"),
        (("torch_qnvb.py", "batched"), "    loss_fn under vmap (forward)"),
        (("", "<method 'run_backward' of 'torch._C._EngineBase' objects>"), "    backward"),
        (("base.py", "matrix"), "    hadamard node matrix (K x D signs)"),
        (("torch_qnvb.py", "_update"), "  QNVBOptimizer._update"),
        (("qnvb_functional.py", "qnvb_update_many"), "    qnvb_update_many (the rules)"),
    ],
}


def run_profile(case, steps: int) -> None:
    _, make, in_shape, batch, kind = case
    name = row_name(case)
    _, _, _, fns = build(make, in_shape, batch, kind, compile=False)
    for label, stages in STAGES.items():
        step = fns[label]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
        stats = pstats.Stats(profiler).stats
        cumulative = {}
        for (file, _, func), (_, _, _, cum, _) in stats.items():
            for (ending, wanted), stage in stages:
                if func == wanted and file.endswith(ending):
                    cumulative[stage] = cumulative.get(stage, 0.0) + cum
        total = cumulative[stages[0][1]]
        print(f"\ncProfile of {steps} '{label}' steps on {name} (cumulative ms per step, share):\n")
        print("| stage | ms/step | share |")
        print("|---|---:|---:|")
        for _, stage in stages:
            if stage in cumulative:
                t = cumulative[stage]
                print(f"| {stage} | {t / steps * 1e3:.2f} | {t / total:.0%} |")
    for label in STAGES:
        print(f"\nTop operators of '{label}' by self CPU time (torch.profiler, 5 steps):")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                fns[label]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


#: the CUDA runtime's calls that make the host wait for the GPU, and its copies (any direction:
#: a ``copy_`` between two GPU tensors is one too)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPIES = ("cudaMemcpyAsync", "cudaMemcpy")
#: the GPU's own copy events by direction (their names begin so)
DIRECTIONS = {"host to GPU": "Memcpy HtoD", "GPU to host": "Memcpy DtoH"}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def python_caller(node) -> str:
    """The innermost Python frames of Pyro and of ``pyro_quadvi`` above an event of
    ``torch.profiler``'s tree (``with_stack=True``), as ``"file.py(line): function"`` (the line
    where the function begins), the package's first; ``"(torch)"`` if there is neither."""
    found: dict[str, str] = {}
    while node is not None:
        if node.tag == _EventType.PyCall:
            for package in ("pyro_quadvi/", "pyro/"):
                if package in node.name and package not in found:
                    found[package] = node.name.split("site-packages/")[-1]
                    break
        node = node.parent
    return " < ".join(found[p] for p in ("pyro_quadvi/", "pyro/") if p in found) or "(torch)"


def cuda_profile(case, steps: int) -> None:
    """Where a step's time goes on the GPU: for the plain K passes, the QNVB step and the one-pass
    ``QNVBOptimizer`` step, per step, the wall time, the GPU time of its kernels and copies (busy
    share; annotations such as ``Optimizer.step`` left out), kernel launches, the host's waits for
    the GPU, copies (any direction; those from host to GPU and back apart), and the Python lines
    of the waits and copies (``torch.profiler`` with CPU and CUDA activities)."""
    _, make, in_shape, batch, kind = case
    _, _, _, fns = build(make, in_shape, batch, kind, compile=False)
    print(
        f"\nOn the GPU, per step, {row_name(case)} ({steps} steps under torch.profiler):\n\n"
        "| variant | wall ms | GPU ms | GPU busy | launches | waits | copies | host to GPU | "
        "GPU to host |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    origins = {}
    for label in ("plain", "qnvb", "opt pass"):
        torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities, with_stack=True) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                fns[label]()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / steps
        on_gpu = [
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
        ]
        gpu = sum(e.device_time for e in on_gpu)
        directions = {
            way: sum(e.name.startswith(prefix) for e in on_gpu) / steps
            for way, prefix in DIRECTIONS.items()
        }
        counts = {"launches": 0, "waits": 0, "copies": 0}
        where: dict[str, int] = {}

        def walk(node, counts=counts, where=where) -> None:
            for kind_, names in (("launches", LAUNCHES), ("waits", WAITS), ("copies", COPIES)):
                if node.name in names:
                    counts[kind_] += 1
                    if kind_ != "launches":
                        key = f"{'wait' if kind_ == 'waits' else 'copy'}: {python_caller(node)}"
                        where[key] = where.get(key, 0) + 1
            for child in node.children:
                walk(child)

        for root in prof.profiler.kineto_results.experimental_event_tree():
            walk(root)
        origins[label] = where
        print(
            f"| {label} | {wall * 1e3:.2f} | {gpu / 1e3 / steps:.2f} | "
            f"{gpu / 1e6 / steps / wall:.0%} | "
            + " | ".join(f"{counts[k] / steps:.1f}" for k in counts)
            + " | "
            + " | ".join(f"{n:.1f}" for n in directions.values())
            + " |",
            flush=True,
        )
    for label, where in origins.items():
        print(f"\nWaits and copies of '{label}' per step, by Python line:")
        for key, n in sorted(where.items(), key=lambda kv: -kv[1]):
            print(f"- {n / steps:.1f} {key}")


def floor_table(cases, repeats: int) -> None:
    """One elementwise pass (``torch.add(a, b, out=c)``: two reads, one write) over ``K x P`` and
    over ``P`` floats, ``P`` each network's parameter count; median of ``repeats`` blocks of 10."""
    print(
        f"\nOne elementwise pass, torch.add(a, b, out=c) (ms, median of {repeats} blocks of 10):"
        f"\n\n| network | parameters P | pass over {K} x P | pass over P |\n|---|---:|---:|---:|"
    )
    for name, make, _, _, _ in cases:
        count = sum(p.numel() for p in make().parameters())
        cells = []
        for n in (K * count, count):
            a, b, c = (torch.rand(n, device=DEVICE) for _ in range(3))
            times = []
            for _ in range(repeats + 1):  # one warm-up block
                start = clock()
                for _ in range(10):
                    torch.add(a, b, out=c)
                times.append((clock() - start) / 10)
            cells.append(f"{statistics.median(times[1:]) * 1e3:.3f}")
        print(f"| {name} | {count:,} | " + " | ".join(cells) + " |", flush=True)


def guide_run_table(cases, repeats: int) -> None:
    """The guide's run as ``QuadratureELBO`` makes it (``trace_for_description``: each auxiliary
    draw given its mean) against the same traced run drawing every coordinate, interleaved;
    median of ``repeats`` blocks of 10 runs each, Pyro's validation on and off."""
    print(
        f"\nThe guide's traced run (ms, median of {repeats} blocks of 10, interleaved):\n\n"
        "| network | validation | drawing | as the ELBO runs it (means) | saved |\n"
        "|---|---|---:|---:|---:|"
    )
    for name, make, shape, batch, kind in cases:
        net, x, y, likelihood, _ = make_case(make, shape, batch, kind)
        bnn = BayesianModule(net, priors.Normal(1.0), likelihood, qnvb_settings={})
        guide = AutoMeanFieldNormal(bnn)
        guide(x, y)
        runs = {
            "drawing": partial(poutine.trace(guide).get_trace, x, y),
            "means": partial(trace_for_description, guide, x, y),
        }
        for validation in (True, False):
            times: dict[str, list[float]] = {label: [] for label in runs}
            with pyro.validation_enabled(validation):
                for _ in range(repeats + 1):  # one warm-up block
                    for label, run in runs.items():
                        start = clock()
                        for _ in range(10):
                            run()
                        times[label].append((clock() - start) / 10)
            drawing, means = (statistics.median(times[label][1:]) * 1e3 for label in runs)
            print(
                f"| {name}, B={batch} | {'on' if validation else 'off'} | {drawing:.2f} | "
                f"{means:.2f} | {drawing - means:.2f} |",
                flush=True,
            )


def memory_split_table(cases) -> None:
    """Where the QNVB step's peak is: the peak of ``loss_and_grads`` (the K nodes' forward and
    backward) and of the update alone (``QNVB.__call__`` on the step's parameters, gradients
    in place), and the step's peak written as ``K x activations + c x parameters`` and as
    ``K x (one plain pass's peak) + c' x parameters`` (a plain forward and backward holds, at its
    peak, the gradients being made beside the activations still saved)."""
    print(
        "\nWhere the QNVB step's peak memory is (MiB; QNVB's own settings):\n\n| network | "
        f"parameters P | {K} x activations | {K} x plain pass peak | loss_and_grads peak | "
        f"update peak | step peak | c = (step peak - {K} x act) / P | "
        f"c' = (step peak - {K} x plain peak) / P |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for case in cases:
        print(memory_split_row(case), flush=True)


def plain_pass(case):
    """One forward and backward pass of the case's plain network (gradients dropped after)."""
    _, make, in_shape, batch, kind = case
    net, x, y, _, criterion = make_case(make, in_shape, batch, kind)

    def run() -> None:
        criterion(net(x), y).backward()
        net.zero_grad(set_to_none=True)

    return run


def qnvb_case(case):
    """The case's network as a ``BayesianModule`` (QNVB's own settings), with its guide, ELBO,
    recording optimizer and SVI after 3 warm-up steps."""
    _, make, in_shape, batch, kind = case
    net, x, y, likelihood, _ = make_case(make, in_shape, batch, kind)
    bnn = BayesianModule(net, priors.Normal(1.0), likelihood, qnvb_settings={})
    guide = AutoMeanFieldNormal(bnn)
    elbo = quadrature_elbo()
    optim = RecordingQNVB()
    svi = SVI(bnn, guide, optim, elbo)
    for _ in range(3):
        svi.step(x, y)
    return net, x, y, bnn, guide, elbo, optim, svi


def memory_split_row(case) -> str:
    """One row of :func:`memory_split_table`."""
    plain = plain_pass(case)
    plain()
    plain_peak = K * peak_bytes(plain)
    net, x, y, bnn, guide, elbo, optim, svi = qnvb_case(case)
    step = peak_bytes(lambda: svi.step(x, y))
    grads = peak_bytes(lambda: elbo.loss_and_grads(bnn, guide, x, y))
    update = peak_bytes(lambda: optim(optim.params))
    act = K * activation_bytes(net, x)
    size = sum(p.numel() * p.element_size() for p in net.parameters())
    mib = 2.0**20
    return (
        f"| {row_name(case)} | {size / mib:.2f} | {act / mib:.2f} | {plain_peak / mib:.2f} | "
        f"{grads / mib:.2f} | {update / mib:.2f} | {step / mib:.2f} | {(step - act) / size:.1f} | "
        f"{(step - plain_peak) / size:.1f} |"
    )


def memory_trace_table(case) -> None:
    """What is held at the peak of one plain pass and at the peak of the QNVB step's forward and
    backward at the K nodes (``loss_and_grads``), grouped by the operator that allocated it."""
    plain = plain_pass(case)
    plain()
    plain_peak, plain_held = live_at_peak(plain)
    _, x, y, bnn, guide, elbo, *_ = qnvb_case(case)
    peak, held = live_at_peak(lambda: elbo.loss_and_grads(bnn, guide, x, y))
    mib = 2.0**20
    print(
        f"\nHeld at the peak, by allocating operator, on {row_name(case)} (MiB):\n\n"
        f"| allocated by | one plain pass | {K} x that | loss_and_grads |\n|---|---:|---:|---:|"
    )
    for made_by in sorted(set(plain_held) | set(held), key=lambda m: -held.get(m, 0)):
        one, qnvb = plain_held.get(made_by, 0), held.get(made_by, 0)
        if max(one * K, qnvb) >= 0.01 * peak:
            print(f"| {made_by} | {one / mib:.2f} | {K * one / mib:.2f} | {qnvb / mib:.2f} |")
    print(f"| **peak** | {plain_peak / mib:.2f} | {K * plain_peak / mib:.2f} | {peak / mib:.2f} |")


def update_table(cases, repeats: int, compile: bool) -> None:
    """The update alone on each network's parameter shapes: the reference ``qnvb_update`` tensor
    by tensor, ``qnvb_update_many`` (eager, flat) and with ``compile=True``; median of
    ``repeats``, each update fed the previous one's results (as in training)."""
    print(
        "\nThe QNVB update alone (weight 1e4, prior precision 1; ms, median of "
        f"{repeats}):\n\n| network | parameters | reference, per tensor | flat (default) | "
        "compiled | reference / flat | reference / compiled |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    hp = QNVBHyperparameters()
    for name, make, _, _, _ in cases:
        torch.manual_seed(0)
        params = [p.detach() for p in make().to(DEVICE).parameters()]
        gs = [torch.randn_like(p) for p in params]
        hs = [torch.rand_like(p) * 1e-3 for p in params]

        def run(variant, repeats=repeats, params=params, gs=gs, hs=hs):
            mus = list(params)
            sigmas = [torch.full_like(p, 1e-2) for p in params]
            states = [init_qnvb_state(p) for p in params]
            times = []
            for _ in range(repeats + 2):  # two warm-up updates (and the compile)
                start = clock()
                if variant == "reference":
                    results = [
                        qnvb_update(*args, hp, 1e4, 1.0)
                        for args in zip(mus, sigmas, gs, hs, states)
                    ]
                else:
                    results = qnvb_update_many(
                        mus, sigmas, gs, hs, states, hp, 1e4, 1.0, compile=variant == "compiled"
                    )
                times.append(clock() - start)
                mus = [r.mu for r in results]
                sigmas = [r.sigma for r in results]
                states = [r.state for r in results]
            return statistics.median(times[2:])

        ref, flat = run("reference"), run("flat")
        comp = run("compiled") if compile else math.nan
        count = sum(p.numel() for p in params)
        print(
            f"| {name} | {count:,} | {ref * 1e3:.2f} | {flat * 1e3:.2f} | {comp * 1e3:.2f} | "
            f"{ref / flat:.2f} | {ref / comp:.2f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--no-compile", action="store_true", help="leave out the torch.compile variants"
    )
    parser.add_argument(
        "--update-only", action="store_true", help="only the table of the update alone"
    )
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall: time.perf_counter; cpu: time.process_time (this process's CPU time)",
    )
    parser.add_argument(
        "--nets",
        nargs="+",
        choices=list(CASES),
        help="only these networks (default: all but 1024-1800-1800-10; --profile then profiles "
        "them, not 784-400-400-10)",
    )
    parser.add_argument(
        "--batch", type=int, help="batch size of every network run (default: each network's own)"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time one elementwise pass over K x P and over P floats (a bandwidth floor)",
    )
    parser.add_argument(
        "--memory-split",
        action="store_true",
        help="only the table of where the QNVB step's peak memory is (forward-backward, update)",
    )
    parser.add_argument(
        "--guide-run",
        action="store_true",
        help="only the table of the guide's run with and without its draws",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="run the networks there (cuda: the clock then synchronizes before each reading, and "
        "peaks are torch.cuda.max_memory_allocated's)",
    )
    parser.add_argument(
        "--validation",
        choices=["on", "off"],
        default="on",
        help="Pyro's validation during the SVI steps (default on, Pyro's own default)",
    )
    parser.add_argument(
        "--memory-trace",
        action="store_true",
        help="only the tables of what the plain pass and the QNVB step hold at their peaks",
    )
    parser.add_argument(
        "--rule",
        default="hadamard",
        choices=list(RULES),
        help="the SVI steps' quadrature rule (hadamard: K = 4 nodes; others: their default)",
    )
    args = parser.parse_args()
    global clock, DEVICE, RULE
    RULE = args.rule
    clock = CLOCKS[args.clock]
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda":
        if args.clock != "wall" or args.memory_split or args.memory_trace:
            parser.error("--device cuda times with the wall clock and has no --memory-split/trace")
        clock = synced_clock
    cases = [CASES[key] for key in args.nets or DEFAULT_NETS]
    if args.batch is not None:
        if args.batch < 1:
            parser.error(f"--batch must be a positive integer, got {args.batch}")
        cases = [(name, make, shape, args.batch, kind) for name, make, shape, _, kind in cases]
    torch.set_num_threads(1)
    pyro.enable_validation(args.validation == "on")
    pyro.settings.set(module_local_params=True)  # each guide holds its own parameters
    torch.set_default_dtype(torch.float32)
    on = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, pyro {pyro.__version__}, threads {torch.get_num_threads()}, "
        f"clock {args.clock}, device {on}, Pyro validation {args.validation}, rule {RULE}"
    )
    if args.guide_run:
        guide_run_table(cases, args.repeats * args.steps)
        return
    if args.floor:
        floor_table(cases, args.repeats * args.steps)
    if args.memory_split:
        memory_split_table(cases)
    if args.memory_trace:
        for case in cases:
            memory_trace_table(case)
    if args.memory_split or args.memory_trace:
        return
    update_table(cases, args.repeats * args.steps, not args.no_compile)
    if args.update_only:
        return
    speed_rows, memory_rows = [], []
    labels = []
    for case in cases:
        speed, memory, labels = measure(case, args.repeats, args.steps, not args.no_compile)
        print(speed, flush=True)
        speed_rows.append(speed)
        memory_rows.append(memory)
    others = [label for label in labels if label != "plain"]
    print(
        f"\nms per step (x plain {K} passes) [update share]\n\n| network | plain {K} passes | "
        + " | ".join(others)
        + " |"
    )
    print("|---|" + "---:|" * len(labels))
    print("\n".join(speed_rows))
    print(
        "\n| network | activations of one pass MiB | parameters MiB | bound "
        f"{K} x act + params MiB | plain {K} passes peak MiB | QNVB step peak MiB | "
        "Trace step peak MiB | opt pass peak MiB | QNVB peak / bound | opt pass peak / bound |"
    )
    print("|---|" + "---:|" * 9)
    print("\n".join(memory_rows))
    if args.profile:
        profiled = cases if args.nets else [CASES["784-400-400-10"]]
        if args.batch is not None:
            profiled = [(n, make, shape, args.batch, kind) for n, make, shape, _, kind in profiled]
        for case in profiled:
            run_profile(case, args.steps * 2)
            if DEVICE.type == "cuda":
                cuda_profile(case, args.steps)


if __name__ == "__main__":
    main()
