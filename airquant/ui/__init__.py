"""The web UI (``airquant ui STORE`` or ``airquant serve --ui``): a Gradio app at ``/ui`` of the server.

``UiMount`` is what the CLI hands to ``airquant.serve.server.serve``: the server does not import the
UI, the UI is mounted into it (one process, one loaded model). Gradio is optional
(``requirements-ui.txt``); ``require_ui`` names the install when it is missing.
"""

from __future__ import annotations

from airquant.errors import DependencyError

INSTALL = "pip install -r requirements-ui.txt  (gradio)"


def require_ui() -> None:
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise DependencyError(f"airquant ui needs gradio, which is not installed: {INSTALL}") from None


def __getattr__(name: str):
    if name == "UiMount":
        require_ui()
        from airquant.ui.mount import UiMount

        return UiMount
    raise AttributeError(f"module 'airquant.ui' has no attribute {name!r}")
