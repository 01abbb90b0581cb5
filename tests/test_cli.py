"""The ``sur-lab`` command line: every subcommand has --help, bad arguments fail with exit code 2 and a message naming
the argument (before any model is loaded), and the sweep subcommand runs a study end to end on a tiny model."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pandas as pd
import pytest

from sur_lab.runtime import cli

REPO = Path(__file__).resolve().parent.parent


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_console_script_is_declared():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["sur-lab"] == "sur_lab.runtime.cli:main"
    assert project["optional-dependencies"]["distributed"] == ["ray>=2.40"]
    for dep in ("jupyterlab", "ipywidgets", "datasets"):
        assert any(d.startswith(dep) for d in project["dependencies"]), dep


@pytest.mark.parametrize("command", [[], ["run"], ["sweep"], ["models"], ["lab"], ["bench"]])
def test_help_everywhere(capsys, command):
    code, out, _ = _run(capsys, *command, "--help")
    assert code == 0
    assert out.startswith("usage: sur-lab" + (" " + command[0] if command else ""))


def test_no_command_is_a_usage_error(capsys):
    code, _, err = _run(capsys)
    assert code == 2 and "COMMAND" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "99_nothing"], "NOTEBOOK '99_nothing' matches no notebook"),
        (["run", "00", "-p", "no_such_parameter", "1"], "-p no_such_parameter: not a parameter of 00_quickstart"),
        (["run", "00", "--preset", "paper"], "--preset paper: 00_quickstart.ipynb has no paper preset"),
        (["run", "00", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["sweep", "everything"], "argument STUDY: invalid choice: 'everything'"),
        (["sweep", "niah", "--bogus"], "unrecognized arguments: --bogus"),
        (["sweep", "niah", "--workers", "0"], "--workers must be an integer >= 1; got '0'"),
        (["sweep", "niah", "--workers", "two"], "--workers must be an integer >= 1; got 'two'"),
        (["sweep", "niah", "--workers", "2", "--address", "nowhere"], "--address: address must be"),
        (["sweep", "niah", "--threads", "-1"], "--threads must be an integer >= 1"),
        (["sweep", "niah", "--budgets", "150"], "budgets must be numbers in [0, 100]"),
        (["sweep", "noprefix", "--workers", "2"], "--workers/--address: the noprefix study"),
        (["sweep", "noprefix", "--preset", "paper"], "--preset 'paper' is not available for noprefix"),
        (["sweep", "niah", "--n-per-dataset", "3"], "--n-per-dataset does not apply to the niah sweep"),
        (["models", "--name", "GPT-9"], "--name 'GPT-9' is not an embedded model"),
        (["models", "--checksum", "--list-only"], "not allowed with argument"),
        (["bench", "--repeats", "many"], "argument --repeats: invalid int value"),
    ],
)
def test_bad_arguments_fail_cleanly(capsys, argv, message):
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert message in err


def test_models_list_only(capsys):
    code, out, _ = _run(capsys, "models", "--list-only")
    assert code == 0 and "SmolLM2-135M-Instruct" in out


def test_lab_command(capsys):
    code, out, _ = _run(capsys, "lab", "--dry-run", "--no-browser")
    assert code == 0
    assert out.split() == [sys.executable, "-m", "jupyterlab", f"--notebook-dir={REPO / 'notebooks'}", "--no-browser"]


def test_preset_parameters_come_from_the_notebook(tmp_path):
    from sur_lab.runtime.run_notebooks import smoke_parameters

    path = REPO / "notebooks" / "00_quickstart.ipynb"
    assert cli.preset_parameters(path, "smoke", {}) == smoke_parameters(path) != {}
    assert cli.preset_parameters(path, "default", {}) == {}
    assert cli.preset_parameters(path, "paper", {"preset": "default"}) == {"preset": "paper"}
    assert [p.name for p in cli.resolve_notebooks(["00", str(path)])] == ["00_quickstart.ipynb"]


def test_sweep_presets():
    paper = cli.sweep_preset("niah", "paper")
    assert paper["num_cases"] == 96 and paper["budgets"] == [2, 5, 10, 20, 40, 80] and len(paper["allocators"]) == 14
    assert cli.sweep_preset("natural-qa", "paper")["n_per_dataset"] == 100


def test_sweep_niah_runs_on_a_tiny_model(capsys, tmp_path, data_dir):
    from conftest import make_tiny_model
    from test_allocators import CHAT_TEMPLATE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # A byte-level tokenizer with no merges (one id per byte): every segment of real corpus text round-trips, as
    # segment edits require, and the tiny model's vocabulary stays at 256.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    model_dir = tmp_path / "tiny"
    make_tiny_model("llama", vocab_size=len(alphabet)).model.save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    out = tmp_path / "sweep"
    code, stdout, err = _run(capsys, "sweep", "niah", "--preset", "smoke", "--model", str(model_dir), "--dtype",
                             "float64", "--context-lens", "400", "--budgets", "5", "--out", str(out), "--no-progress")
    assert code == 0, err
    records = pd.read_parquet(out / "records.parquet")
    assert len(records) == 4 + 6  # four references + six smoke allocators at one budget
    assert set(records["workers"]) == {1}
    assert f"{len(records)} records -> {out / 'records.parquet'}" in stdout


# --- notebook parameter validation (sur_lab.runtime.params) ----------------------------------------------------------


def test_string_for_a_list_is_parsed_as_json_or_yaml(capsys):
    from sur_lab.runtime.params import validate_parameters

    ns = {"__annotations__": {"datasets": list, "budgets": list, "n": int, "tau": float, "name": str, "on": bool},
          "datasets": '["hotpotqa", "iirc"]', "budgets": "[2, 5.5]", "n": 3, "tau": 1, "name": "x", "on": False}
    validate_parameters(ns)
    assert ns["datasets"] == ["hotpotqa", "iirc"] and ns["budgets"] == [2, 5.5]
    assert ns["tau"] == 1.0 and isinstance(ns["tau"], float)
    assert "parsed the string" in capsys.readouterr().out
    yaml_ns = {"__annotations__": {"datasets": list}, "datasets": "[hotpotqa, iirc]"}
    validate_parameters(yaml_ns)
    assert yaml_ns["datasets"] == ["hotpotqa", "iirc"]


def test_a_plain_string_for_a_list_is_refused_with_the_y_spelling():
    from sur_lab.runtime.params import ParameterError, validate_parameters

    ns = {"__annotations__": {"datasets": list, "budgets": list}, "datasets": "hotpotqa", "budgets": "[1, 2]"}
    with pytest.raises(ParameterError) as err:
        validate_parameters(ns)
    message = str(err.value)
    assert "parameter 'datasets' must be a list" in message
    assert "-y 'datasets: [\"a\", \"b\"]'" in message
    assert ns["budgets"] == "[1, 2]"  # a failing call changes nothing


@pytest.mark.parametrize("annotation, value", [(int, True), (int, "3"), (int, 2.5), (float, "0.5"), (str, 3),
                                               (bool, "False"), (list, 7)])
def test_wrong_types_are_refused(annotation, value):
    from sur_lab.runtime.params import ParameterError, check_parameter

    with pytest.raises(ParameterError, match=f"parameter 'x' must be {annotation.__name__}"):
        check_parameter("x", value, annotation)


def test_optional_and_unchecked_annotations():
    from sur_lab.runtime.params import check_parameter

    assert check_parameter("x", None, int | None) is None
    assert check_parameter("x", "[1]", list | None) == [1]
    assert check_parameter("x", object, type) is object  # not a checked annotation: left alone
    assert check_parameter("x", "[1]", "list") == [1] and check_parameter("x", None, "int | None") is None


@pytest.mark.parametrize("name", ["00_quickstart", "01_theory_bound", "04_packed_refresh_benchmark",
                                  "05_kernel_numerical_validation"])
def test_notebooks_validate_right_after_the_parameters_cell(name):
    import nbformat

    from sur_lab.runtime.params import CHECKED_TYPES, validate_parameters

    nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
    i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    assert "validate_parameters(globals())" in nb.cells[i + 1].source and not nb.cells[i + 1].get("outputs")
    namespace: dict = {}
    exec(compile(nb.cells[i].source, name, "exec", dont_inherit=True), namespace)  # no __future__ annotations
    annotations = namespace["__annotations__"]
    assert annotations and all(a in CHECKED_TYPES for a in annotations.values()), annotations
    validate_parameters(namespace)  # the defaults pass their own annotations
    validate_parameters({**namespace, **nb.metadata["sur_lab"]["smoke_parameters"]})  # and so do the smoke values
