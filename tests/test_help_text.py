"""``--help`` keeps every bracketed example: rich markup would eat ``[p, q]`` unescaped."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from spconv_train.cli import app


@pytest.mark.parametrize("command", ["run", "verify", "predict", "show-config", "make-data"])
def test_help_renders_without_losing_bracketed_text(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert '"parallel.sp="' not in result.output  # an example emptied by the markup
    if command == "predict":
        assert '--set "parallel.sp=[p, q]"' in result.output
