"""OpenAI-compatible HTTP server over a ``Provider`` (FastAPI + uvicorn, the ``serve`` extra).

``create_app(provider)`` builds the app; ``serve(stores, ...)`` runs ``airquant serve``;
``BackgroundServer`` runs an app on loopback in a thread (tests, notebooks).
"""

from __future__ import annotations

from airquant.errors import DependencyError

INSTALL = "pip install 'airquant[serve]'  (or: pip install fastapi uvicorn prometheus_client)"


def require_serve() -> None:
    """Raise DependencyError with the pip command when fastapi, uvicorn or prometheus_client is missing."""
    missing = []
    for name in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise DependencyError(f"airquant serve needs {', '.join(missing)}, which are not installed: {INSTALL}")


def __getattr__(name: str):
    if name == "create_app":
        require_serve()
        from airquant.serve.app import create_app

        return create_app
    if name in ("serve", "BackgroundServer"):
        require_serve()
        from airquant.serve import server

        return getattr(server, name)
    raise AttributeError(f"module 'airquant.serve' has no attribute {name!r}")
