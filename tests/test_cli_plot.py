"""`delta-sync plot`, and what `keygen` and `inspect` tell a user who got something wrong."""

from __future__ import annotations

import sys

from delta_sync.cli import main

from helpers import cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_draws_the_versions_a_bucket_holds(run, tmp_path):
    run.publisher.flush()
    out = tmp_path / "run.png"
    result = cli("plot", str(run.root), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)
    deltas = sorted(p.name for p in (run.root / "deltas").iterdir() if p.suffix == ".safetensors")
    anchors = sorted(p.name for p in (run.root / "anchors").iterdir() if p.suffix == ".safetensors")
    assert f"{len(deltas)} deltas" in result.stdout
    anchor_versions = ", ".join(f"v{int(name[5:13])}" for name in anchors)
    assert f"anchors at {anchor_versions}" in result.stdout


def test_plot_without_matplotlib_names_the_extra(run, tmp_path, monkeypatch, capsys):
    run.publisher.flush()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    assert main(["plot", str(run.root), "-o", str(tmp_path / "x.png")]) == 2
    assert "pip install 'delta-weight-sync[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_plot_of_an_empty_directory_fails_clearly(tmp_path, capsys):
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert "no anchors or deltas to plot" in capsys.readouterr().err


def test_keygen_keeps_keys_out_of_git_and_refuses_to_overwrite(tmp_path, capsys):
    keys = tmp_path / "keys"
    assert main(["keygen", str(keys)]) == 0
    assert "never commit" in capsys.readouterr().out
    assert (keys / ".gitignore").read_text().splitlines()[-1] == "*"
    private = (keys / "delta-sync.key").read_bytes()
    assert main(["keygen", str(keys)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "FileExistsError" not in err
    assert "exists already" in err and f"delta-sync keygen {keys}-new" in err
    assert (keys / "delta-sync.key").read_bytes() == private


def test_inspect_of_a_missing_file_says_what_the_bucket_holds(run):
    run.publisher.flush()
    missing = cli("inspect", str(run.root / "deltas" / "step_00000099.safetensors"))
    assert missing.returncode == 2
    newest = max(p.name for p in (run.root / "deltas").iterdir() if p.suffix == ".safetensors")
    assert f"deltas/{newest}" in missing.stderr
    # The bucket's own folder named as if it were the bucket: say where its files are.
    wrong_level = cli("inspect", "deltas/step_00000002.safetensors", cwd=run.root.parent)
    assert wrong_level.returncode == 2
    assert "deltas/deltas/step_00000002.safetensors" in wrong_level.stderr
