"""paraspec: lossless speculative decoding that keeps several devices busy at once."""
from paraspec.engine import Engine, EngineBusy, EngineClosed, GenerationResult
from paraspec.sampling import SamplingParams
from paraspec.stats import GenerationStats

__all__ = ["Engine", "EngineBusy", "EngineClosed", "GenerationResult", "GenerationStats", "SamplingParams"]
__version__ = "0.1.0"
