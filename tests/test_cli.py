"""The command line's errors: what dejavu's own checks refuse (a profile, a model, an option,
the machine) is one line and exit status 2, read before the model loads where it can be;
anything else keeps its traceback."""

from pathlib import Path

import pytest
import torch

from dejavu_compile import cli, models
from dejavu_compile.profile import ProfileError

SHIPPED = Path(__file__).parents[1] / "profiles" / "smollm2-135m.yaml"


def _no_model(name, *args, **kwargs):
    raise AssertionError("the model was loaded before the profile was read")


@pytest.mark.parametrize("command", ["eval", "export", "retrieval"])
def test_a_malformed_profile_stops_before_the_model_loads(command, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nlayers: [1, 2\n")
    monkeypatch.setattr(models, "load_model", _no_model)
    out = ["--out", str(tmp_path / "graphs")] if command == "export" else []
    assert cli.main([command, "m", "--profile", str(bad), *out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dejavu {command}: error: profile {bad}: not valid YAML")
    assert "Traceback" not in err
    assert cli.main([command, "m", "--profile", str(tmp_path / "none.yaml"), *out]) == 2
    assert "error: profile not found: " in capsys.readouterr().err


def test_a_profile_for_another_model_is_one_line(tiny, tmp_path, monkeypatch, capsys):
    """The model's config is checked before anything is traced. Without that check (a model
    without a Hugging Face config) the sparsify pass checks, inside torch.compile, which wraps
    what the backend raises in its own error: the command reports the profile's."""
    from dejavu_compile import backend

    model = tiny("llama")
    monkeypatch.setattr(models, "load_model", lambda name: models.LoadedModel(name, model, None))
    args = ["export", "m", "--profile", str(SHIPPED), "--out", str(tmp_path), "--no-onnx"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("dejavu export: error: profile for 'smollm2-135m' does not fit this "
                          "model: its config has num_layers=2, the profile says 30\n")
    monkeypatch.setattr(backend, "_refuse_other_shapes", lambda model, profile: None)
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("dejavu export: error: profile for 'smollm2-135m' does not fit")
    assert "Traceback" not in err and "BackendCompilerFailed" not in err
    monkeypatch.setenv("DEJAVU_TRACEBACK", "1")
    with pytest.raises(Exception) as info:
        cli.main(args)
    assert isinstance(info.value.inner_exception, ProfileError)


def test_a_text_file_that_is_missing_or_not_text_is_one_line(tmp_path, monkeypatch, capsys):
    """``--text``: read as UTF-8; a file that is not names itself (the decoder's message alone
    did not)."""
    loaded = models.LoadedModel("m", None, None)
    monkeypatch.setattr(models, "load_model", lambda name: loaded)
    binary = tmp_path / "text.bin"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    out = ["--out", str(tmp_path / "p.yaml")]
    assert cli.main(["calibrate", "m", "--text", str(binary), *out]) == 2
    assert capsys.readouterr().err.startswith(
        f"dejavu calibrate: error: --text {binary}: not UTF-8 text (")
    assert cli.main(["calibrate", "m", "--text", str(tmp_path / "none.txt"), *out]) == 2
    assert "error: [Errno 2] No such file or directory: " in capsys.readouterr().err


def test_bad_options_and_a_missing_gpu_are_one_line(monkeypatch, capsys):
    assert cli.main(["plan", "llama-3.1-8b", "--context", "2048", "--kv-keep", "0"]) == 2
    assert capsys.readouterr().err.startswith("dejavu plan: error: kv_keep must be in (0, 1]")
    assert cli.main(["plan", "llama-3-8", "--context", "2048"]) == 2  # plan takes shape names
    assert capsys.readouterr().err.startswith(
        "dejavu plan: error: model 'llama-3-8' is neither a shape name ('opt-13b', ")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--no-e2e"]) == 2
    assert capsys.readouterr().err.startswith("dejavu bench: error: dejavu bench needs a CUDA GPU")


def test_an_error_raised_outside_dejavu_keeps_its_traceback(monkeypatch):
    from dejavu_compile import plan

    def table(*args, **kwargs):
        raise ValueError("raised by a test, standing for a bug")

    monkeypatch.setattr(plan, "table", table)
    with pytest.raises(ValueError, match="standing for a bug"):
        cli.main(["plan", "llama-3.1-8b", "--context", "2048"])


def test_evaluation_text_gives_at_least_one_window():
    """``dejavu eval --windows 0`` failed inside torch.stack."""
    from dejavu_compile.evaluate import windows

    ids = torch.arange(300)[None]
    assert [w.shape[1] for w in windows(ids, 128, 4)] == [128, 128]
    with pytest.raises(ValueError, match="number of windows must be >= 1, got 0"):
        windows(ids, 128, 0)
    with pytest.raises(ValueError, match="100 tokens of text are fewer than one window of 128"):
        windows(ids[:, :100], 128, 4)


class _Words:
    """Stands for a loaded model in the retrieval trials' text: a token a word."""

    bos = False

    def encode(self, text: str) -> torch.Tensor:
        return torch.zeros(1, len(text.split()), dtype=torch.long)


def test_a_retrieval_context_shorter_than_its_text_is_refused():
    """``dejavu retrieval --context 0`` ran trials of about 70 tokens reported as context 0."""
    from dejavu_compile import retrieval

    trial = retrieval.passkey(_Words(), 200, 0.5)
    assert 150 < trial.ids.shape[1] <= 200
    with pytest.raises(ValueError, match="a context of 0 tokens is shorter than the trial's"):
        retrieval.passkey(_Words(), 0, 0.5)
    with pytest.raises(ValueError, match="a context of 40 tokens"):
        retrieval.multikey(_Words(), 40, 0.5)


def test_every_option_says_what_it_does():
    """``dejavu COMMAND --help`` describes every argument of every command."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(commands) == {"calibrate", "eval", "export", "plan", "retrieval", "bench"}
    bare = [f"{name} {action.option_strings or action.dest}"
            for name, sub in commands.items() for action in sub._actions
            if action.dest != "help" and not action.help]
    assert bare == []
