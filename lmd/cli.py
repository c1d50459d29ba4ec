"""The `lmd` command line. Heavy libraries are imported inside commands so `lmd --help` stays instant."""

from __future__ import annotations

import os
import sys

import click
import typer

from lmd.errors import LmdError

app = typer.Typer(
    name="lmd",
    help="Quantize a Hugging Face LLM (AWQ int4, KV-cache int8) and serve it fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
eval_app = typer.Typer(help="Evaluate a model or workspace.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")

# Each feature module defines its command functions (heavy imports inside them); register them here, one line each.
from lmd.bench.command import bench_app  # noqa: E402
from lmd.chat.cli_chat import chat_command  # noqa: E402
from lmd.chat.cli_gradio import gradio_command  # noqa: E402
from lmd.deploy.command import deploy_command  # noqa: E402
from lmd.eval.cli import ppl_command  # noqa: E402
from lmd.eval.tasks.command import tasks_command  # noqa: E402
from lmd.lite.cli_awq import awq_command  # noqa: E402
from lmd.lite.cli_calibrate import calibrate_command  # noqa: E402
from lmd.lite.cli_kv_qparams import kv_qparams_command  # noqa: E402
from lmd.lite.cli_smooth_quant import smooth_quant_command  # noqa: E402
from lmd.serve.command import serve_command  # noqa: E402

eval_app.command("ppl")(ppl_command)
eval_app.command("tasks")(tasks_command)
app.command("calibrate")(calibrate_command)
app.command("awq")(awq_command)
app.command("smooth-quant")(smooth_quant_command)
app.command("deploy")(deploy_command)
app.command("kv-qparams")(kv_qparams_command)
app.add_typer(bench_app, name="bench")
app.command("chat")(chat_command)
app.command("gradio")(gradio_command)
app.command("serve")(serve_command)


def main() -> None:
    debug = os.environ.get("LMD_DEBUG", "") not in ("", "0")
    try:
        app(standalone_mode=False)
    except LmdError as exc:
        if debug:
            raise
        print(f"lmd: {exc}", file=sys.stderr)
        sys.exit(1)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        print("lmd: aborted", file=sys.stderr)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("lmd: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - last resort: one line, never a traceback
        if debug:
            raise
        print(f"lmd: unexpected error: {type(exc).__name__}: {exc} (set LMD_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
