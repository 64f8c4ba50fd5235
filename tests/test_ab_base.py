"""scripts/ab_base.sh, the base of a kernel A/B (docs/testing.md#kernel-ab): in a scratch git
repository, a revision's version of every changed file lands at its path, files the revision
lacks are listed for deletion, and files outside the build's paths are left out."""
import pathlib
import shutil
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "ab_base.sh"


def _git(repo, *args):
    who = {f"GIT_{role}_{key}": value for role in ("AUTHOR", "COMMITTER")
           for key, value in (("NAME", "t"), ("EMAIL", "t@t"))}
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                   env={**who, "HOME": str(repo), "PATH": "/usr/bin:/bin"})


def test_ab_base_takes_the_revisions_files_and_lists_the_new_ones(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("no git")
    repo = tmp_path / "repo"
    (repo / "csrc" / "k").mkdir(parents=True)
    (repo / "docs").mkdir()
    (repo / "csrc" / "k" / "a.cu").write_text("old kernel\n")
    (repo / "csrc" / "same.h").write_text("unchanged\n")
    (repo / "docs" / "d.md").write_text("old doc\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    (repo / "csrc" / "k" / "a.cu").write_text("new kernel\n")       # changed, uncommitted
    (repo / "csrc" / "k" / "b.cu").write_text("added, untracked\n")  # the base lacks it
    (repo / "docs" / "d.md").write_text("new doc\n")                # not a build input
    out = subprocess.run(["bash", str(SCRIPT), "HEAD", ".out/ab_base"], cwd=repo,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    base = repo / ".out" / "ab_base"
    files = sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())
    assert files == [".ab-delete", "csrc/k/a.cu"]
    assert (base / "csrc" / "k" / "a.cu").read_text() == "old kernel\n"
    assert (base / ".ab-delete").read_text().split() == ["csrc/k/b.cu"]

    bad = subprocess.run(["bash", str(SCRIPT), "no-such-rev", ".out/x"], cwd=repo,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no revision no-such-rev" in bad.stderr
