"""``sur-lab data fetch`` and ``sur-lab data status`` against a local mirror built from tiny fixtures (no network):
the fetched folder has the loaders' layout, every file is pinned, dev/test/corpus are disjoint and reproducible, a
damaged release is refused, the copy beside the project is still found first, and the missing-data error names the
command that fixes it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from data_mirror import build_mirror
from sur_lab.data import fetch as fetch_mod
from sur_lab.data.fetch import FetchError, Release, SampleSizes, draw, fetch, status, status_text
from sur_lab.data.layout import CHECKSUM_FILE, CORPUS_FILE, DATA_FILES, HELD_OUT_FILES, read_checksums, sha256_file
from sur_lab.runtime import cli

SIZES = SampleSizes(dev=3, test=5, corpus_questions=4, musique_dev=4, train=2, iirc_train=3)


def quiet(_line: str) -> None:
    pass


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> Path:
    return build_mirror(tmp_path_factory.mktemp("mirror"), n=24)


@pytest.fixture
def fetched(mirror, tmp_path) -> Path:
    fetch(tmp_path / "qa", mirror=mirror, sizes=SIZES, log=quiet)
    return tmp_path / "qa"


def test_fetch_writes_the_loaders_layout_pinned(fetched, monkeypatch):
    from sur_lab.data.qa import is_held_out, load_corpus, load_qa

    pins = read_checksums(fetched / CHECKSUM_FILE)
    expected = {rel for files in DATA_FILES.values() for split, rel in files.items() if split != "train" or
                not rel.startswith("hotpotqa/")} | {CORPUS_FILE}
    assert set(pins) == expected  # HotpotQA's train sample needs train=True
    assert all(sha256_file(fetched / rel) == digest for rel, digest in pins.items())
    monkeypatch.setenv("SUR_LAB_DATA_DIR", str(fetched))
    sizes = {"hotpotqa": (3, 5), "2wikimultihopqa": (3, 5), "musique": (4, 4), "iirc": (24, 24)}
    for dataset, (n_dev, n_test) in sizes.items():
        dev, test = load_qa(dataset), load_qa(dataset, split="test")
        assert (len(dev), len(test)) == (n_dev, n_test), dataset
        assert all(ex.dataset == dataset and ex.supporting and ex.answers for ex in dev + test)
        if dataset in ("hotpotqa", "2wikimultihopqa"):
            assert not {ex.id for ex in dev} & {ex.id for ex in test}, "dev and held-out test share a question"
    assert len(load_qa("musique", split="train")) == 2 and len(load_qa("iirc", split="train")) == 3
    # IIRC: one record per question; the release's answer types become the loaders' (span/value/binary/none)
    iirc = load_qa("iirc")
    assert {ex.answer_type for ex in iirc} == {"spans", "number", "binary", "none"}
    number = next(ex for ex in iirc if ex.answer_type == "number")
    assert number.answers == ("42",) and number.supporting[0].title == "" and number.supporting[1].title == "university"
    # the corpus: the paragraphs of further 2Wiki dev questions, none of them a dev or test question's
    corpus = load_corpus()
    titles = {p.title for p in corpus}
    asked = {ex.supporting[0].title for ex in load_qa("2wikimultihopqa") + load_qa("2wikimultihopqa", split="test")}
    assert corpus and not titles & asked
    assert len({(p.title, p.text) for p in corpus}) == len(corpus)
    for rel in HELD_OUT_FILES:
        assert is_held_out(fetched / rel)
    readme = (fetched / "README.md").read_text()
    assert "held out" in readme and "seed 0" in readme


def test_fetch_is_reproducible_and_keeps_other_datasets_pinned(fetched, mirror, tmp_path):
    again = tmp_path / "again"
    fetch(again, mirror=mirror, sizes=SIZES, log=quiet)
    assert read_checksums(again / CHECKSUM_FILE) == read_checksums(fetched / CHECKSUM_FILE)
    before = read_checksums(fetched / CHECKSUM_FILE)
    result = fetch(fetched, datasets=["iirc"], mirror=mirror, sizes=SIZES, log=quiet)
    assert set(result.files) == {rel for rel in before if rel.startswith("iirc/")}
    assert read_checksums(fetched / CHECKSUM_FILE) == before  # the other datasets' pins are kept
    sources = json.loads((fetched / "SOURCES.json").read_text())
    assert set(sources["releases"]) == {"hotpot_dev_distractor_v1.json", "data_ids_april7.zip", "musique_v1.0.zip",
                                        "iirc_train_dev.tgz", "iirc_test.json"}
    assert not (fetched / ".downloads").exists(), "releases are removed after a fetch unless kept"


def test_a_damaged_release_is_refused_and_nothing_is_pinned(mirror, tmp_path):
    bad = tmp_path / "mirror"
    shutil.copytree(mirror, bad)
    path = bad / "iirc" / "iirc_test.json"
    path.write_bytes(path.read_bytes()[:-10])  # truncated, SHA256SUMS unchanged
    dest = tmp_path / "qa"
    with pytest.raises(FetchError, match="iirc_test.json: SHA-256 .* differs"):
        fetch(dest, mirror=bad, sizes=SIZES, log=quiet)
    assert not (dest / CHECKSUM_FILE).exists()
    assert not list(dest.rglob("iirc_test.json")), "a download that fails its checksum is not kept"


def test_the_official_pin_is_checked(mirror, tmp_path):
    # without a mirror's own SHA256SUMS, a release is checked against the official digest
    wrong = dataclasses.replace(fetch_mod.RELEASES[0], url=(mirror / "hotpotqa/hotpot_dev_distractor_v1.json").as_uri(),
                                sha256="0" * 64)
    with pytest.raises(FetchError, match="differs from the expected 0000"):
        fetch(tmp_path / "qa", datasets=["hotpotqa"], releases=[wrong], sizes=SIZES, log=quiet)
    right = dataclasses.replace(wrong, sha256=sha256_file(mirror / "hotpotqa/hotpot_dev_distractor_v1.json"))
    result = fetch(tmp_path / "qa", datasets=["hotpotqa"], releases=[right], sizes=SIZES, log=quiet)
    assert result.sources["hotpot_dev_distractor_v1.json"]["official"] is True


def test_a_release_of_another_shape_is_refused(mirror, tmp_path):
    bad = tmp_path / "mirror"
    shutil.copytree(mirror, bad)
    (bad / "iirc" / "iirc_test.json").write_text(json.dumps([{"id": 1, "question": "q"}]))
    (bad / CHECKSUM_FILE).unlink()  # IIRC has no official pin: the converter is what refuses it
    with pytest.raises(FetchError, match=r"iirc_test.json: record 0 lacks \['text', 'questions'\]"):
        fetch(tmp_path / "qa", datasets=["iirc"], mirror=bad, sizes=SIZES, log=quiet)
    (bad / "hotpotqa" / "hotpot_dev_distractor_v1.json").write_text("[]")
    with pytest.raises(FetchError, match="differs from the expected 4e9ecb5c"):  # the official pin, mirror or not
        fetch(tmp_path / "qa", datasets=["hotpotqa"], mirror=bad, sizes=SIZES, log=quiet)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="datasets=.*hotpot"):
        fetch(tmp_path, datasets=["hotpot"], log=quiet)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="dest=.*existing file"):
        fetch(tmp_path / "file", log=quiet)
    with pytest.raises(FetchError, match="download failed.*--mirror"):
        fetch(tmp_path / "qa", datasets=["iirc"], mirror=tmp_path / "no-mirror", log=quiet)


def test_draw_is_disjoint_nested_and_scales_down():
    records = [{"id": f"r{i}"} for i in range(50)]
    dev, test = draw(records, "id", [5, 10], seed=3)
    assert len(dev) == 5 and len(test) == 10 and not {r["id"] for r in dev} & {r["id"] for r in test}
    assert draw(list(reversed(records)), "id", [5, 10], seed=3) == [dev, test], "independent of file order"
    small = draw(records[:6], "id", [100, 500], seed=0)
    assert [len(s) for s in small] == [1, 5]
    with pytest.raises(ValueError, match="duplicate"):
        draw(records + records[:1], "id", [1])


def test_status_reports_pins_and_held_out_files(fetched):
    st = status(fetched)
    assert st.ok and st.root == fetched
    states = {f.rel: f.state for f in st.files}
    assert states[DATA_FILES["hotpotqa"]["train"]] == "not fetched"
    assert {f.rel for f in st.files if f.held_out} == set(HELD_OUT_FILES)
    (fetched / DATA_FILES["iirc"]["dev"]).write_text("{}\n")
    st = status(fetched)
    assert not st.ok and {f.rel: f.state for f in st.files}[DATA_FILES["iirc"]["dev"]] == "mismatch"
    text = status_text(st)
    assert "mismatch" in text and "held out: final evaluation only" in text and "sur-lab data fetch" in text


def test_missing_data_names_the_fetch_command_and_the_shared_copy_is_found_first(fetched, tmp_path, monkeypatch):
    from sur_lab import paths

    monkeypatch.delenv("SUR_LAB_DATA_DIR", raising=False)
    monkeypatch.setenv("SUR_LAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path / "clone")  # a clone with no ../shared beside it
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="sur-lab data fetch"):
        paths.default_data_dir()
    (tmp_path / "cache" / "data" / "qa").mkdir(parents=True)  # an unfinished fetch (no SHA256SUMS) does not count
    with pytest.raises(FileNotFoundError, match="sur-lab data fetch"):
        paths.default_data_dir()
    shutil.rmtree(tmp_path / "cache" / "data" / "qa")
    shutil.copytree(fetched, tmp_path / "cache" / "data" / "qa")
    assert paths.default_data_dir() == tmp_path / "cache" / "data" / "qa"
    # a copy beside the project is found before the fetched one
    (tmp_path / "shared" / "data" / "qa").mkdir(parents=True)
    assert paths.default_data_dir() == tmp_path / "shared" / "data" / "qa"


def test_cli_fetch_and_status(mirror, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SUR_LAB_DATA_DIR", str(tmp_path / "qa"))
    assert cli.main(["data", "status"]) == 1
    assert "sur-lab data fetch" in capsys.readouterr().out
    assert cli.main(["data", "fetch", "--mirror", mirror.as_uri(), "--datasets", "hotpotqa", "musique"]) == 0
    out = capsys.readouterr().out
    assert "hotpotqa/hotpotqa__v2_test_random_500.jsonl" in out and "held out" in out
    assert cli.main(["data", "status"]) == 1  # 2Wiki and IIRC not fetched yet
    assert cli.main(["data", "fetch", "--mirror", str(mirror)]) == 0
    capsys.readouterr()
    assert cli.main(["data", "status"]) == 0
    assert "all files as pinned" in capsys.readouterr().out
    assert cli.main(["data", "fetch", "--datasets", "hotpot"]) == 2  # argparse names the choice
    assert cli.main(["data", "fetch", "--mirror", str(tmp_path / "nowhere"), "--datasets", "iirc"]) == 1
    assert "download failed" in capsys.readouterr().err


@pytest.mark.slow
def test_notebook_00_runs_on_fetched_data(fetched, tmp_path, monkeypatch):
    """A clone with no data beside it: fetch from the mirror, then notebook 00 at smoke reads it."""
    from sur_lab.runtime.run_notebooks import NOTEBOOK_DIR, run_notebook, smoke_parameters

    monkeypatch.setenv("SUR_LAB_DATA_DIR", str(fetched))
    path = NOTEBOOK_DIR / "00_quickstart.ipynb"
    executed = run_notebook(path, smoke_parameters(path), outputs=tmp_path / "out", progress=False)
    text = executed.read_text()
    assert "Person hp" in text  # the fetched question, not the shared one
