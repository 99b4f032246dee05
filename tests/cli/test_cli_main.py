"""``mixprec.cli.main``: warnings read as sentences while a command runs, and only then."""

from __future__ import annotations

import warnings

import pytest

import mixprec.cli.env
from mixprec.cli import main


def _warns_and_raises_if(fail: bool):
    def run(args):
        warnings.warn("the disk is nearly full", UserWarning, stacklevel=2)
        if fail:
            raise RuntimeError("the command failed")
        return 0
    return run


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_a_command_shows_warnings_as_one_line_and_gives_the_process_its_showwarning_back(monkeypatch, capsys, fail):
    monkeypatch.setattr(mixprec.cli.env, "run", _warns_and_raises_if(fail))
    mine = []
    monkeypatch.setattr(warnings, "showwarning", lambda *a, **k: mine.append(a[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        if fail:
            with pytest.raises(RuntimeError):
                main(["env"])
        else:
            assert main(["env"]) == 0
        assert capsys.readouterr().err == "mixprec: warning: the disk is nearly full\n" and mine == []
        warnings.warn("after the command", UserWarning, stacklevel=1)
    assert [str(m) for m in mine] == ["after the command"]  # the program's own handler again
