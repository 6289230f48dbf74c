"""AirQuant: run LLMs larger than GPU memory by streaming one layer at a time."""

__version__ = "0.1.0"

__all__ = ["Provider", "ProviderConfig", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `import airquant` does not import torch and transformers.
    if name in ("Provider", "ProviderConfig"):
        from airquant.jobs import provider

        return getattr(provider, name)
    raise AttributeError(f"module 'airquant' has no attribute {name!r}")
