"""coordexp: rollout-matching SFT for vision-language detectors that emit coordinate tokens."""

__version__ = "0.1.0"
