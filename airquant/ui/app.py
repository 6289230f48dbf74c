"""The Gradio app: tabs Chat, Plan, Batch job and Results over one running server.

Chat is an OpenAI streaming client of the server (``client.stream_chat``); Plan calls the router
(``plan_view``); Batch job runs the CLI's resumable job through the provider (``jobs``); Results renders
``RESULTS.md`` with its plots. Element ids (``elem_id``) are what the browser test looks for.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from airquant.config import GenerateConfig
from airquant.errors import AirQuantError
from airquant.ui.client import ChatStreamError, history_messages, stream_chat
from airquant.ui.jobs import JobRunner
from airquant.ui.plan_view import PlanQuery, plan_report


@dataclass(frozen=True)
class UiContext:
    provider: object  # airquant.jobs.provider.Provider
    stores: tuple[str, ...]
    base_url: str  # where the UI's chat requests go (the same server, on loopback)
    api_key: str | None
    results: Path
    runner: JobRunner
    prefix: str = "/ui"


def serving_text(provider) -> str:
    d = provider.describe()
    return (f"Serving **{d['model']}**: {d['scheme']} from `{Path(d['store']).name}`, **{d['mode']}**, KV cache "
            f"{'TurboQuant K4/V2' if d['kv'] == 'tq' else 'plain'}, {d['resident_layers']} layers resident, "
            f"max batch {d['max_batch']}, device {d['device']}")


def results_markdown(results: Path, prefix: str) -> str:
    """RESULTS.md with its relative image links pointed at Gradio's file route (the folder is allowed)."""
    path = results / "RESULTS.md"
    if not path.is_file():
        return f"No `{path}` yet: `make run` (or `airquant pipeline`) writes it."
    folder = results.resolve()

    def link(match: re.Match) -> str:
        alt, target = match.group(1), match.group(2)
        if re.match(r"^[a-z]+://", target) or target.startswith("/"):
            return match.group(0)
        return f"![{alt}]({prefix}/gradio_api/file={folder / target})"

    return re.sub(r"!\[([^\]]*)\]\(([^)\s]+)\)", link, path.read_text(encoding="utf-8"))


def progress_html(status) -> str:
    if status is None:
        return "<div id='job-status-text'>No batch job yet: upload a JSONL and press Start.</div>"
    pct = 100.0 * status.done / status.total if status.total else 100.0
    return (f"<progress max='100' value='{pct:.1f}' style='width:100%'></progress>"
            f"<div id='job-status-text'>{html.escape(status.describe())}</div>")


def _chat_tab(ctx: UiContext) -> None:
    gr.Markdown(serving_text(ctx.provider), elem_id="chat-plan")
    stats = gr.Markdown("", elem_id="chat-stats")
    sampling = [gr.Slider(1, 1024, value=64, step=1, label="Max new tokens", render=False),
                gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)", render=False),
                gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p", render=False)]

    async def respond(message, history, max_tokens, temperature, top_p):
        settings = {"max_tokens": int(max_tokens), "temperature": float(temperature), "top_p": float(top_p)}
        try:
            async for p in stream_chat(ctx.base_url, ctx.api_key, history_messages(message, history), settings):
                yield p.text, (f"{p.completion_tokens} tokens, {p.tokens_per_s:.1f} tok/s"
                               + (" (done)" if p.done else ""))
        except ChatStreamError as exc:
            raise gr.Error(str(exc)) from exc

    gr.ChatInterface(respond, additional_inputs=sampling, additional_outputs=[stats], concurrency_limit=None,
                     textbox=gr.Textbox(placeholder="Ask something", elem_id="chat-input", submit_btn=True,
                                        render=False),
                     chatbot=gr.Chatbot(elem_id="chat-log", height=360, render=False), fill_height=False)


def _plan_tab(ctx: UiContext) -> None:
    gr.Markdown("The router's choice for the budgets below (the same arithmetic as `airquant plan`). "
                "VRAM 0 plans for no GPU; RAM 0 takes 70 % of the available RAM; context 0 the model's (≤ 2048).")
    with gr.Row():
        vram = gr.Number(0, label="VRAM (GiB)", minimum=0)
        ram = gr.Number(0, label="RAM (GiB)", minimum=0)
        batch = gr.Number(1, label="Batch", minimum=1, precision=0)
        context = gr.Number(0, label="Context (tokens)", minimum=0, precision=0)
        kv = gr.Dropdown(["auto", "none", "tq"], value="auto", label="KV cache")
        interactive = gr.Checkbox(False, label="Interactive (never stream layers)")
    button = gr.Button("Plan", elem_id="plan-button", variant="primary")
    headline = gr.Markdown(elem_id="plan-choice")
    detail = gr.Code(label="Arithmetic, best quality first", elem_id="plan-detail", language=None)

    def plan(vram_gb, ram_gb, batch_n, context_n, kv_choice, interactive_only):
        query = PlanQuery(vram_gb=vram_gb or None, ram_gb=ram_gb or None, batch=int(batch_n or 1),
                          context=int(context_n) if context_n else None, kv=kv_choice, interactive=interactive_only)
        return plan_report(ctx.stores, query)

    button.click(plan, [vram, ram, batch, context, kv, interactive], [headline, detail])


def _batch_tab(ctx: UiContext) -> None:
    gr.Markdown('Upload a JSONL of `{"id": ..., "prompt": ...}` lines. The job is `airquant batch`\'s: the output '
                "is written record by record, and starting the same file again resumes it.")
    with gr.Row():
        upload = gr.File(label="Prompts (JSONL)", file_types=[".jsonl"], type="filepath", elem_id="job-input")
        with gr.Column():
            max_new = gr.Number(64, label="Max new tokens", minimum=1, precision=0, elem_id="job-max-new")
            chat = gr.Checkbox(True, label="Chat template")
            start = gr.Button("Start", elem_id="job-start", variant="primary")
    status = gr.HTML(progress_html(None), elem_id="job-status")
    output = gr.File(label="Output (JSONL)", elem_id="job-output", interactive=False)

    def refresh():
        current = ctx.runner.status()
        ready = current is not None and current.output.exists() and current.state != "running"
        return progress_html(current), str(current.output) if ready else None

    def begin(path, max_tokens, use_chat):
        if not path:
            raise gr.Error("upload a JSONL file first.")
        try:  # the path comes from the browser: the runner takes only a file of Gradio's upload folder
            ctx.runner.start(path, GenerateConfig(max_new_tokens=int(max_tokens), chat=bool(use_chat)))
        except AirQuantError as exc:
            raise gr.Error(ctx.runner.public(str(exc))) from exc
        except OSError as exc:  # its text would name the server's folders
            raise gr.Error(f"the job could not be staged ({type(exc).__name__}, errno {exc.errno}).") from exc
        return refresh()

    start.click(begin, [upload, max_new, chat], [status, output])
    gr.Timer(1.0).tick(refresh, None, [status, output], show_progress="hidden")  # live, and after a reload


def build_blocks(ctx: UiContext) -> gr.Blocks:
    with gr.Blocks(title="AirQuant") as demo:
        gr.Markdown("# AirQuant")
        with gr.Tabs():
            with gr.Tab("Chat", id="chat"):
                _chat_tab(ctx)
            with gr.Tab("Plan", id="plan"):
                _plan_tab(ctx)
            with gr.Tab("Batch job", id="batch"):
                _batch_tab(ctx)
            with gr.Tab("Results", id="results"):
                results = gr.Markdown(results_markdown(ctx.results, ctx.prefix), elem_id="results-md")
                gr.Button("Reload").click(lambda: results_markdown(ctx.results, ctx.prefix), None, results)
    return demo
