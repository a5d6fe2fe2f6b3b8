"""paraspec: lossless speculative decoding that keeps several devices busy at once."""
from paraspec.engine import Engine, GenerationResult
from paraspec.sampling import SamplingParams
from paraspec.stats import GenerationStats

__all__ = ["Engine", "GenerationResult", "GenerationStats", "SamplingParams"]
__version__ = "0.1.0"
