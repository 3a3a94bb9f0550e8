"""patches/<version>/, vllm_overlay/<version>/ and the checkout stay one change."""

import re
import subprocess
import sys

import pytest
from conftest import ROOT, run_script

import _lib
import check_sync

V = _lib.SERIES_VERSION  # the default track


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

    shutil.copytree(ROOT / "vllm_overlay" / V, overlay)
    spec = overlay / "vllm/v1/kv_offload/tiering/spec.py"
    spec.write_text(spec.read_text() + "\n# drift\n")
    (overlay / "vllm/extra.py").write_text("")
    monkeypatch.setattr(check_sync, "OVERLAY", overlay)
    with pytest.raises(_lib.UserError) as e:
        check_sync.main()
    assert "vllm/v1/kv_offload/tiering/spec.py: differs" in str(e.value)
    assert f"vllm/extra.py: in {overlay}/, not in patches/{V}/" in str(e.value)


def test_the_files_both_tracks_share_are_identical():
    r = run_script(ROOT, "check_shared.py")
    assert r.returncode == 0, r.stderr
    assert "identical on both tracks; fs tier:" in r.stdout


def test_a_shared_file_changed_on_one_track_only_fails(tmp_path, monkeypatch):
    import shutil

    import check_shared

    for version in (V, _lib.series_versions()[-1]):
        shutil.copytree(ROOT / "vllm_overlay" / version, tmp_path / version)
    shared = tmp_path / V / check_shared.SHARED[0]
    shared.write_text(shared.read_text() + "\n# a fix made on one track only\n")
    monkeypatch.setattr(check_shared, "overlay_dir", lambda version: tmp_path / version)
    with pytest.raises(_lib.UserError) as e:
        check_shared.main()
    assert f"{check_shared.SHARED[0]}: differs between" in str(e.value)
    assert "make the same change on both series" in str(e.value)


# Every series folder of patches/ (the default track's and the upstream track's).
SERIES = sorted(d.name for d in (ROOT / "patches").iterdir() if any(d.glob("*.patch")))
SUBJECT_MAX, BODY_MAX, WIDTH = 72, 15, 72  # vLLM's commit messages: a subject line, a short body


def patch_message(text: str) -> tuple[str, list[str]]:
    """A format-patch file's subject (the `Subject:` header unfolded, without `[PATCH n/m] `)
    and its body lines (between the header and the `---` line, trailers left out)."""
    head, _, rest = text.partition("\n\n")
    subject = re.search(r"^Subject: (.*(?:\n[ \t].*)*)", head, re.M).group(1)
    subject = re.sub(r"^\[PATCH[^\]]*\] ", "", re.sub(r"\n[ \t]", " ", subject))
    paras = re.split(r"\n[ \t]*\n", rest.split("\n---\n")[0].strip("\n"))
    if paras and all(re.match(r"[A-Za-z][\w-]*: ", line) for line in paras[-1].split("\n")):
        paras = paras[:-1]  # the trailers
    return subject, "\n\n".join(paras).rstrip("\n").split("\n") if paras else []


@pytest.mark.parametrize("version", SERIES)
def test_every_patch_says_why_in_a_short_message_without_sign_off(version):
    """As vLLM writes commit messages: an area tag, a subject of at most 72 characters, a body
    of at most 15 lines wrapped at 72 columns (what the patch fixes and why, the test that
    guards it). The upstream status and when to drop a patch are in docs/series.md."""
    patches = sorted((ROOT / "patches" / version).glob("*.patch"))
    assert patches and V in SERIES
    too_long = []
    for p in patches:
        text = p.read_text()
        subject, body = patch_message(text)
        # vLLM's convention: an area tag, e.g. [KV Offloading] or [Core]
        assert re.match(r"\[(KV Offloading|Core)\] \S", subject), p.name
        # A Signed-off-by certifies the DCO for a real person: the contributor adds it at
        # PR time (make pr); the project never writes one.
        assert not re.search(r"^Signed-off-by:", text, re.M), p.name
        assert body and body[0].strip(), f"{p.name}: no body saying why"
        # a line over 72 columns only where it cannot be broken (one long path or URL)
        wide = [line for line in body if len(line) > WIDTH and " " in line.strip()]
        if len(subject) > SUBJECT_MAX or len(body) > BODY_MAX or wide:
            too_long.append(f"{p.name}: subject {len(subject)} chars, body {len(body)} lines"
                            + (f", {len(wide)} line(s) over {WIDTH} columns" if wide else ""))
    assert not too_long, (f"messages over {SUBJECT_MAX} chars / {BODY_MAX} lines:\n"
                          + "\n".join(too_long))


def series_md_rows(version: str) -> tuple[list[str], dict[str, list[str]]]:
    """The header cells and the rows (by patch number; `0008-0010` names three) of the table
    under docs/series.md's `## The <version> series` heading."""
    text = (ROOT / "docs" / "series.md").read_text()
    m = re.search(rf"^## The {re.escape(version)} series.*?(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/series.md has no '## The {version} series' section"

    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split(" | ")]

    lines = m.group(0).split("\n")
    header = next((cells(line) for line in lines if line.startswith("| patch |")), [])
    rows = {}
    for line in lines:
        n = re.match(r"\| (\d{4})(?:-(\d{4}))? ", line)
        if n:
            for i in range(int(n.group(1)), int(n.group(2) or n.group(1)) + 1):
                rows[f"{i:04d}"] = cells(line)
    return header, rows


@pytest.mark.parametrize("version", SERIES)
def test_every_patch_has_a_series_md_row_with_upstream_status_and_drop_rule(version):
    """docs/series.md carries what the messages do not: for every patch, a row under its
    series' heading naming its number, with its upstream status and when it can be dropped
    (or, for tests, that it is kept)."""
    header, rows = series_md_rows(version)
    lower = [h.lower() for h in header]
    assert "upstream" in lower and "drop when" in lower, (
        f"docs/series.md, the {version} table: columns {header}, want 'upstream' and 'drop when'")
    up, drop = lower.index("upstream"), lower.index("drop when")
    missing, empty = [], []
    for p in sorted((ROOT / "patches" / version).glob("*.patch")):
        row = rows.get(p.name[:4])
        if row is None:
            missing.append(p.name)
        elif len(row) != len(header) or any(
                row[i].strip(" -?").lower() in ("", "tbd", "todo") for i in (up, drop)):
            empty.append(p.name)
    assert not missing, f"no row in docs/series.md's {version} table: {missing}"
    assert not empty, f"rows without an upstream status or a drop/keep rule: {empty}"


def test_apply_builds_the_series_and_is_idempotent(project_copy):
    r = run_script(project_copy, "apply.py")
    assert r.returncode == 0, r.stderr
    repo = project_copy / "build/vllm"
    n = len(list((project_copy / "patches" / V).glob("*.patch")))
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
    assert "(vllm/v1/kv_offload/tiering/spec.py)" in refused.stderr
    assert spec.read_text().endswith("# mine\n")

    # ...nor are local commits that were not exported.
    git(repo, "commit", "-qam", "my work")
    refused = run_script(project_copy, "apply.py")
    assert refused.returncode == 2 and "make patches" in refused.stderr
    forced = run_script(project_copy, "apply.py", env={"FORCE": "1"})
    assert forced.returncode == 0, forced.stderr
    assert git(repo, "rev-parse", "HEAD") == head


def test_a_series_that_does_not_apply_names_the_first_patch_and_its_conflicts(project_copy):
    # A patch written against other code: its context is not in 0.22.1, and its blobs
    # are unknown, so no 3-way merge can rescue it (as with a series on another release).
    # Placed first, so every real patch after it is "not tried".
    first = sorted((project_copy / "patches" / V).glob("*.patch"))[0]
    text = re.sub(r"^index \S+", "index " + "1" * 40 + ".." + "2" * 40, first.read_text(),
                  flags=re.M)
    text = text.replace(" # Create primary tier (CPU-based)", " # Create the primary tier")
    bad = project_copy / "patches" / V / "0000-KV-Offloading-conflicting.patch"
    bad.write_text(text)
    n_real = len(list((project_copy / "patches" / V).glob("*.patch"))) - 1
    r = run_script(project_copy, "apply.py")
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.splitlines()
    assert bad.name in err[0] and f"patch 1 of {n_real + 1}" in err[0], r.stderr
    # the conflicting file, alone on its line; the file the patch adds applied, so unnamed
    assert "  vllm/v1/kv_offload/tiering/spec.py" in err, r.stderr
    assert "test_tiering_hma.py" not in r.stderr
    assert f"not tried (they build on it): {n_real} patch(es), {first.name}" in r.stderr
    assert "make patches" in r.stderr
    repo = project_copy / "build/vllm"
    assert git(repo, "rev-parse", "HEAD") == git(repo, "rev-parse", "v0.22.1^{commit}")
    assert git(repo, "status", "--porcelain") == ""


def test_round_trip_apply_then_export_changes_no_byte(tmp_path):
    """make checkout, then make patches, gives back patches/ byte for byte: same flags as
    scripts/apply.py (git am) and scripts/export_patches.py (git format-patch), in a
    scratch clone of build/vllm's objects (the real checkout is not touched)."""
    import apply
    import export_patches

    pin = _lib.load_pin(_lib.SERIES_VERSION)
    if not (_lib.CHECKOUT / ".git").exists():
        pytest.fail(f"no checkout at {_lib.CHECKOUT}: run `make apply` first")
    clone = tmp_path / "vllm"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(_lib.CHECKOUT),
                    str(clone)], check=True)
    git(clone, "checkout", "-q", pin["tag"])
    patches = apply.series()
    apply.apply_series(clone, pin["tag"], patches)
    out = export_patches.format_patch(clone, pin["tag"], tmp_path / "exported")
    assert [p.name for p in out] == [p.name for p in patches]
    for old, new in zip(patches, out):
        assert new.read_bytes() == old.read_bytes(), f"{old.name} changes in the round trip"


def _fake_checkout(path, tag, commits: int):
    """A tiny git repo standing in for build/vllm: a tag and `commits` commits past it."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.name", "t")
    git(path, "config", "user.email", "t@localhost")
    (path / "a.py").write_text("a = 1\n")
    git(path, "add", "a.py")
    git(path, "commit", "-qm", "pristine")
    git(path, "tag", tag)
    for i in range(commits):
        (path / "a.py").write_text(f"a = {i + 2}\n")
        git(path, "commit", "-qam", f"[KV Offloading] change {i}")


def _snapshot(root):
    return {p.relative_to(root): p.read_bytes()
            for d in ("patches", "vllm_overlay") for p in (root / d).rglob("*") if p.is_file()}


def test_export_refuses_an_empty_series(project_copy):
    _fake_checkout(project_copy / "build" / "vllm", "v0.22.1", commits=0)
    before = _snapshot(project_copy)
    r = run_script(project_copy, "export_patches.py")
    assert r.returncode == 2
    assert "no commit past v0.22.1" in r.stderr and "Nothing was written" in r.stderr
    assert _snapshot(project_copy) == before


def test_export_of_another_version_writes_its_own_series_only(project_copy, tmp_path):
    _fake_checkout(project_copy / "build" / "vllm-0.23.0", "v0.23.0", commits=1)
    before = _snapshot(project_copy)
    r = run_script(project_copy, "export_patches.py", env={"VLLM_VERSION": "0.23.0"})
    assert r.returncode == 0, r.stderr
    after = _snapshot(project_copy)
    new = {str(k) for k in after.keys() - before.keys()}
    assert new == {"patches/0.23.0/0001-KV-Offloading-change-0.patch", "vllm_overlay/0.23.0/a.py"}
    assert {k: after[k] for k in before} == before  # no other track's byte changed
    before = after
    # ...and a port can be exported anywhere else, touching no series
    out = tmp_path / "port"
    r = run_script(project_copy, "export_patches.py", "--out", str(out),
                   env={"VLLM_VERSION": "0.23.0"})
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out.glob("*.patch")] == ["0001-KV-Offloading-change-0.patch"]
    assert _snapshot(project_copy) == before


def test_export_refuses_to_overwrite_a_borrowed_series(project_copy, tmp_path):
    """A release whose pin names another track's series (`series = "0.34.0"`) applies that
    series as it is: `make patches` there would write commits made on its own tag over
    patches/0.34.0/; it refuses, writing nothing."""
    pin = (project_copy / "pins" / "vllm-0.32.0.toml").read_text()
    pin = pin.replace("0.32.0", "0.31.0").replace('tag = "v0.31.0"\n',
                                                  'tag = "v0.31.0"\nseries = "0.34.0"\n')
    assert 'series = "0.34.0"' in pin
    (project_copy / "pins" / "vllm-0.31.0.toml").write_text(pin)
    _fake_checkout(project_copy / "build" / "vllm-0.31.0", "v0.31.0", commits=1)
    before = _snapshot(project_copy)
    r = run_script(project_copy, "export_patches.py", env={"VLLM_VERSION": "0.31.0"})
    assert r.returncode == 2
    assert "applies the 0.34.0 series" in r.stderr and "Nothing was written" in r.stderr
    assert _snapshot(project_copy) == before
    out = tmp_path / "elsewhere"
    r = run_script(project_copy, "export_patches.py", "--out", str(out),
                   env={"VLLM_VERSION": "0.31.0"})
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out.glob("*.patch")] == ["0001-KV-Offloading-change-0.patch"]
    assert _snapshot(project_copy) == before


def test_uncommitted_edits_are_named_with_their_full_path(tmp_path):
    import apply

    repo = tmp_path / "vllm"
    _fake_checkout(repo, "v0.22.1", commits=0)
    (repo / "a.py").write_text("mine\n")
    with pytest.raises(_lib.UserError) as e:
        apply.check_no_local_work(repo, "v0.22.1")
    assert "(a.py)" in str(e.value)


def test_the_environment_imports_the_patched_vllm():
    py = ROOT / ".venv/bin/python"
    out = subprocess.run(
        [py, "-c", "import vllm.v1.kv_offload.tiering.spec as s; print(s.__file__)"],
        capture_output=True, text=True, check=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    ).stdout.strip().splitlines()[-1]
    assert "/.venv/" in out
    src = open(out).read()
    assert "assert len(self.gpu_block_size) == 1" not in src
    assert src == (ROOT / "vllm_overlay" / V / "vllm/v1/kv_offload/tiering/spec.py").read_text()


def test_a_session_on_unpatched_vllm_aborts_at_start(tmp_path):
    """vLLM's tests never run against the wrong vLLM: the plugin stops the session."""
    import os

    import unpatched_site

    site = unpatched_site.build()
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HMA_OVERLAY=str(ROOT / "vllm_overlay" / V),
               PYTHONPATH=os.pathsep.join([site, str(ROOT / "scripts" / "pytest_plugins")]))
    env.pop("HMA_UNPATCHED", None)
    r = subprocess.run([ROOT / ".venv/bin/python", "-m", "pytest", "-p", "hma_pytest",
                        "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 3, r.stdout[-2000:]
    assert "the imported vLLM is not patched" in r.stdout + r.stderr
    assert "make apply" in r.stdout + r.stderr


def test_clean_never_removes_unexported_work(project_copy):
    repo = project_copy / "build" / "vllm"
    _fake_checkout(repo, "v0.22.1", commits=0)
    (repo / "a.py").write_text("mine\n")
    r = run_script(project_copy, "clean.py")
    assert r.returncode == 2 and "Nothing was removed" in r.stderr
    assert (repo / "a.py").read_text() == "mine\n"
    git(repo, "commit", "-qam", "mine")
    r = run_script(project_copy, "clean.py")
    assert r.returncode == 2 and "make patches" in r.stderr
    r = run_script(project_copy, "clean.py", env={"FORCE": "1"})
    assert r.returncode == 0, r.stderr
    assert not (project_copy / "build").exists()


def test_glue_unit_puts_a_unit_written_on_the_tag_into_the_series(tmp_path, monkeypatch,
                                                                  capsys):
    """scripts/glue_unit.py: a unit written on the tag replaces the series' patch that sits
    beside another fix's line, as three commits: glue that sets that line back to the tag's,
    the unit's own patch byte for byte, glue back to the series' tree plus the unit's test
    file; the later patch rebases on it, and the final tree is the old one plus that file.
    A line the unit adds that the series lacks is named (the glue drops it)."""
    import glue_unit

    repo = tmp_path / "repo"
    repo.mkdir()
    lines = [f"{i}\n" for i in range(1, 13)]

    def commit(changes: dict[int, str], msg: str, extra: dict[str, str] | None = None) -> str:
        for n, text in changes.items():
            lines[n - 1] = text + "\n"
        (repo / "a.py").write_text("".join(lines))
        for name, text in (extra or {}).items():
            (repo / name).write_text(text)
        subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
        subprocess.run(["git", "commit", "-q", "-m", msg], cwd=repo, check=True,
                       env=glue_unit.git_env())
        return glue_unit.git("rev-parse", "HEAD", cwd=repo)

    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=repo, check=True)
    tag = commit({}, "tag")
    commit({3: "three, fixed"}, "[KV Offloading] Fix three")
    old = commit({4: "four, the unit's", 9: "nine, the unit's"}, "[KV Offloading] The unit")
    commit({12: "twelve, later"}, "[KV Offloading] Later")
    subprocess.run(["git", "checkout", "-q", "-b", "unit", tag], cwd=repo, check=True)
    lines[:] = [f"{i}\n" for i in range(1, 13)]
    unit = commit({4: "four, the unit's", 9: "nine, the unit's, and a fix"},
                  "[KV Offloading] The unit", {"test_unit.py": "def test_unit(): pass\n"})
    subprocess.run(["git", "checkout", "-q", "main"], cwd=repo, check=True)
    before = glue_unit.git("rev-parse", "main^{tree}", cwd=repo)
    (tmp_path / "aside").write_text("[KV Offloading] Set aside\n")
    (tmp_path / "back").write_text("[KV Offloading] Combine\n")
    monkeypatch.setattr(glue_unit, "checkout_dir", lambda: repo)
    monkeypatch.setattr(sys, "argv", ["glue_unit.py", tag, unit, old,
                                      str(tmp_path / "aside"), str(tmp_path / "back")])
    glue_unit.main()

    subjects = glue_unit.git("log", "--format=%s", f"{tag}..main", cwd=repo).splitlines()
    assert subjects[::-1] == ["[KV Offloading] Fix three", "[KV Offloading] Set aside",
                              "[KV Offloading] The unit", "[KV Offloading] Combine",
                              "[KV Offloading] Later"]
    aside = glue_unit.git("show", "main~3:a.py", cwd=repo)
    assert "three, fixed" not in aside  # beside the unit's line 4: the tag's again
    placed = glue_unit.git("diff", "main~3", "main~2", cwd=repo)
    assert placed == glue_unit.git("diff", tag, unit, cwd=repo)  # the unit as written
    assert glue_unit.git("diff", "--stat", before, "main", cwd=repo).startswith(
        "test_unit.py")  # the final tree: the old one plus the unit's test file
    assert "three, fixed" in glue_unit.git("show", "main:a.py", cwd=repo)
    assert "drift: a.py lacks 1 line(s) the unit adds, e.g. \"nine, the unit's, and a fix\"" \
        in capsys.readouterr().out


def test_glue_unit_finds_a_unit_patch_that_would_not_give_the_unit_on_its_base(tmp_path):
    """The series exports the unit's patch with the set-aside glue as its pre-image: where
    `git diff` aligns its hunks on the series' lines, it does not turn BASE into UNIT (as the
    C MACs' did in session 35), and glue_unit.py must then set that file aside whole."""
    import glue_unit

    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=repo, check=True)

    def commit(text: str) -> str:
        (repo / "a.c").write_text(text)
        subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
        subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "c"], cwd=repo,
                       check=True, env=glue_unit.git_env())
        return glue_unit.git("rev-parse", "HEAD", cwd=repo)

    base = commit("b\nc\nd\n")
    unit = commit("b\nc, the unit's\nd\n")
    first = commit("x\nb\nc\ny\n")  # the series' lines beside the unit's
    placed = commit("x\nb\nc, the unit's\ny\n")
    assert glue_unit.misplaced(repo, base, unit, first, placed) == ["a.c"]
    assert glue_unit.misplaced(repo, base, unit, base, unit) == []
