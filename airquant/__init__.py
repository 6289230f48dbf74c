"""AirQuant: run LLMs larger than GPU memory by streaming one layer at a time."""

__version__ = "0.1.0"
