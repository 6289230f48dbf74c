"""The one metric table: the CLI and the suite name the same metrics and give each only settings it takes."""

from __future__ import annotations

import re

import pytest

from airquant.cli import build_parser
from airquant.cli.eval_cmds import cmd_eval
from airquant.errors import EvalConfigError
from airquant.eval.metrics import METRICS, metric_spec
from airquant.pipeline import sizes as stages
from airquant.pipeline import suite


def test_cli_suite_and_stages_list_the_registry_metrics(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if re.match(r"    \w", line)]  # one per subcommand
    assert listed == list(METRICS)
    assert tuple(METRICS) == suite.METRICS and set(METRICS) == set(stages.Metric.__args__)


@pytest.mark.parametrize("name", list(METRICS))
def test_every_cli_flag_set_reaches_the_run_function(name):
    args = build_parser().parse_args(["eval", name, "STORE"])
    assert args.func is cmd_eval
    flag_of = {"batch_size": "batch", "vram_budget_gb": "vram_budget"}
    missing = [p for p in METRICS[name].params if not hasattr(args, flag_of.get(p, p))]
    assert missing == []


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("name", list(METRICS))
def test_suite_sizes_set_only_settings_the_metric_takes(name, quick):
    kw, fields = suite.settings(name, stages.Sizes.preset(quick))
    assert set(kw) <= set(METRICS[name].params)
    assert kw and fields


def test_an_unknown_metric_names_the_known_ones():
    with pytest.raises(EvalConfigError, match="'ppl', 'rouge'"):
        metric_spec("bleu")
