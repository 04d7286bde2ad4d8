"""Reference problems with known answers, shared by the tests and the benchmarks."""

from .problems import (
    EIGHT_SCHOOLS_SIGMA,
    EIGHT_SCHOOLS_Y,
    MeanFieldProblem,
    TinyNet,
    eight_schools,
    linear_regression,
    logistic_regression,
    minimize_mean_field,
    small_network,
)

__all__ = [
    "EIGHT_SCHOOLS_SIGMA",
    "EIGHT_SCHOOLS_Y",
    "MeanFieldProblem",
    "TinyNet",
    "eight_schools",
    "linear_regression",
    "logistic_regression",
    "minimize_mean_field",
    "small_network",
]
