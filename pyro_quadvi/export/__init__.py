"""Export of a fitted guide and its model: ArviZ ``InferenceData`` (draws, names, conversion)."""

from .inference_data import to_inference_data

__all__ = ["to_inference_data"]
