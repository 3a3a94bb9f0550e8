"""patches/, vllm_overlay/ and the build/vllm checkout stay one change."""

import re
import subprocess

import pytest
from conftest import ROOT, run_script

import _lib
import check_sync


def git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_overlay_and_patches_agree():
    r = run_script(ROOT, "check_sync.py")
    assert r.returncode == 0, r.stderr
    assert "agree" in r.stdout


def test_drift_between_overlay_and_patches_fails(tmp_path, monkeypatch):
    overlay = tmp_path / "overlay"
    import shutil

    shutil.copytree(ROOT / "vllm_overlay", overlay)
    spec = overlay / "vllm/v1/kv_offload/tiering/spec.py"
    spec.write_text(spec.read_text() + "\n# drift\n")
    (overlay / "vllm/extra.py").write_text("")
    monkeypatch.setattr(check_sync, "OVERLAY", overlay)
    with pytest.raises(_lib.UserError) as e:
        check_sync.main()
    assert "vllm/v1/kv_offload/tiering/spec.py: differs" in str(e.value)
    assert "vllm/extra.py: in vllm_overlay/, not in patches/" in str(e.value)


def test_every_patch_says_why_and_is_signed_off():
    patches = sorted((ROOT / "patches").glob("*.patch"))
    assert patches
    for p in patches:
        text = p.read_text()
        subject = re.search(r"^Subject: \[PATCH[^\]]*\] (.*)$", text, re.M).group(1)
        assert subject.startswith("[KV Offloading]"), p.name
        assert re.search(r"^Signed-off-by: .+ <.+>$", text, re.M), p.name
        message = text.split("\n---\n")[0]
        assert "Upstream status:" in message, f"{p.name}: no 'Upstream status:' paragraph"


def test_apply_builds_the_series_and_is_idempotent(project_copy):
    r = run_script(project_copy, "apply.py")
    assert r.returncode == 0, r.stderr
    repo = project_copy / "build/vllm"
    n = len(list((project_copy / "patches").glob("*.patch")))
    assert git(repo, "rev-list", "--count", "v0.22.1..HEAD") == str(n)
    assert "assert len(self.gpu_block_size) == 1" in git(
        repo, "show", "v0.22.1:vllm/v1/kv_offload/tiering/spec.py")
    assert "assert len(self.gpu_block_size) == 1" not in (
        repo / "vllm/v1/kv_offload/tiering/spec.py").read_text()
    head = git(repo, "rev-parse", "HEAD")

    again = run_script(project_copy, "apply.py")
    assert again.returncode == 0 and "already applied" in again.stdout
    assert git(repo, "rev-parse", "HEAD") == head

    # Local edits are never destroyed silently.
    spec = repo / "vllm/v1/kv_offload/tiering/spec.py"
    spec.write_text(spec.read_text() + "# mine\n")
    refused = run_script(project_copy, "apply.py")
    assert refused.returncode == 2
    assert "uncommitted edits" in refused.stderr and "FORCE=1" in refused.stderr
    assert spec.read_text().endswith("# mine\n")

    # ...nor are local commits that were not exported.
    git(repo, "commit", "-qam", "my work")
    refused = run_script(project_copy, "apply.py")
    assert refused.returncode == 2 and "make patches" in refused.stderr
    forced = run_script(project_copy, "apply.py", env={"FORCE": "1"})
    assert forced.returncode == 0, forced.stderr
    assert git(repo, "rev-parse", "HEAD") == head


def test_a_series_that_does_not_apply_leaves_the_pristine_tag(project_copy):
    # A patch written against other code: its context is not in 0.22.1, and its blobs
    # are unknown, so no 3-way merge can rescue it (as with a series on another release).
    first = sorted((project_copy / "patches").glob("*.patch"))[0]
    text = re.sub(r"^index \S+", "index " + "1" * 40 + ".." + "2" * 40, first.read_text(),
                  flags=re.M)
    text = text.replace(" # Create primary tier (CPU-based)", " # Create the primary tier")
    patches = [project_copy / "patches" / "9999-KV-Offloading-conflicting.patch"]
    patches[0].write_text(text)
    r = run_script(project_copy, "apply.py")
    assert r.returncode == 2
    assert patches[0].name in r.stderr
    assert "vllm/v1/kv_offload/tiering/spec.py" in r.stderr
    repo = project_copy / "build/vllm"
    assert git(repo, "rev-parse", "HEAD") == git(repo, "rev-parse", "v0.22.1^{commit}")
    assert git(repo, "status", "--porcelain") == ""


def test_the_environment_imports_the_patched_vllm():
    py = ROOT / ".venv/bin/python"
    out = subprocess.run(
        [py, "-c", "import vllm.v1.kv_offload.tiering.spec as s; print(s.__file__)"],
        capture_output=True, text=True, check=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    ).stdout.strip().splitlines()[-1]
    assert "/.venv/" in out
    src = open(out).read()
    assert "assert len(self.gpu_block_size) == 1" not in src
    assert src == (ROOT / "vllm_overlay/vllm/v1/kv_offload/tiering/spec.py").read_text()


def test_a_session_on_unpatched_vllm_aborts_at_start(tmp_path):
    """vLLM's tests never run against the wrong vLLM: the plugin stops the session."""
    import os

    import unpatched_site

    site = unpatched_site.build()
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([site, str(ROOT / "scripts" / "pytest_plugins")]))
    env.pop("HMA_UNPATCHED", None)
    r = subprocess.run([ROOT / ".venv/bin/python", "-m", "pytest", "-p", "hma_pytest",
                        "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 3, r.stdout[-2000:]
    assert "the imported vLLM is not patched" in r.stdout + r.stderr
    assert "make apply" in r.stdout + r.stderr
