"""Rollouts: the Sample that travels to the trainer, prompt data, rewards, generation."""

from .data import ArithmeticTask, Prompt, load_prompts
from .generate import generate_samples
from .rewards import load_reward, math_reward
from .sample import Sample, SampleError, validate_sample

__all__ = [
    "ArithmeticTask",
    "Prompt",
    "Sample",
    "SampleError",
    "generate_samples",
    "load_prompts",
    "load_reward",
    "math_reward",
    "validate_sample",
]
