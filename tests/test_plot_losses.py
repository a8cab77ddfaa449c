"""``scripts/plot_losses.py``: training runs' loss curves as one PNG."""

import importlib.util
import json

import pytest

from .helpers import ROOT

pytest.importorskip("matplotlib")


def _script():
    spec = importlib.util.spec_from_file_location("plot_losses", ROOT / "scripts" / "plot_losses.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_losses_draws_each_run_and_says_its_mean(tmp_path, capsys):
    plot_losses = _script()
    runs = []
    for name, losses in (("loop", [0.3, 0.2, 0.1]), ("trl", [0.5, 0.3])):
        run = tmp_path / name
        run.mkdir()
        (run / "training.json").write_text(json.dumps({"config": {"log_every": 5}, "result": {"losses": losses}}))
        runs.append(str(run))
    assert plot_losses.curve(tmp_path / "trl") == ([5, 10], [0.5, 0.3])
    png = tmp_path / "img" / "losses.png"
    assert plot_losses.main([*runs, "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "loop: 3 figures, mean 0.2000" in out and "trl: 2 figures, mean 0.4000" in out
    with pytest.raises(SystemExit):  # a folder without a training.json
        plot_losses.main([runs[0], str(tmp_path / "nothing"), "--out", str(png)])
