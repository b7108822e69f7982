"""moe: a Mixture-of-Experts training library in the style of Olmo-core 3 (torch only)."""

__version__ = "0.1.0"
