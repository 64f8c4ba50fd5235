"""The docs hold together: every relative link in README.md and docs/*.md reaches a file (and,
for `page.md#anchor`, an anchor of that page), and every file in docs/results is cited, so
that the results folder holds the evidence the docs point to and nothing else."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md",
        *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "docs" / "results"
# Besides the docs, a script or test that names a results file cites it.
CODE = [p for d in ("scripts", "benchmarks", "tests") for p in sorted((ROOT / d).rglob("*"))
        if p.is_file() and p.suffix in (".py", ".sh")]

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _text(path):
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path):
    text = _text(path)
    found = set(ANCHOR.findall(text))
    seen = {}
    for h in HEADING.findall(text):
        s = _slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def _links():
    for doc in DOCS:
        for target in LINK.findall(_text(doc)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            yield doc, target


def test_docs_have_links():
    assert sum(1 for _ in _links()) > 100


def test_relative_links_reach_files_and_anchors():
    broken = []
    for doc, target in _links():
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{doc.relative_to(ROOT)}: {target} (no file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{doc.relative_to(ROOT)}: {target} (no anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


SOURCES = [p for d in ("jax_ep", "csrc", "tests", "scripts", "benchmarks", "examples")
           for p in sorted((ROOT / d).rglob("*"))
           if p.is_file() and p.suffix in (".py", ".sh", ".cc", ".cu", ".cuh", ".h")]
DOC_REF = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")


def test_code_cites_existing_docs_and_anchors():
    """Docstrings and comments cite `docs/<page>.md#<anchor>`: the page and the anchor exist."""
    broken = []
    for src in SOURCES:
        for page, anchor in DOC_REF.findall(src.read_text(encoding="utf-8", errors="replace")):
            dest = ROOT / "docs" / page
            if not dest.exists() or (anchor and anchor not in _anchors(dest)):
                ref = f"docs/{page}#{anchor}" if anchor else f"docs/{page}"
                broken.append(f"{src.relative_to(ROOT)}: {ref}")
    assert not broken, "references to missing docs or anchors:\n" + "\n".join(broken)


def _cites(text, name):
    """Whether `text` names the results file `name`: in full, or by its run's name without the
    extension (a run's .json and .png sit beside the .log that the docs link)."""
    stem = name.rsplit(".", 1)[0]
    return name in text or re.search(re.escape(stem) + r"(?![\w-])", text) is not None


def test_every_results_file_is_cited():
    files = sorted(p for p in RESULTS.iterdir() if p.is_file())
    assert files
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in DOCS + CODE]
    cited = {p.name for p in files if any(_cites(t, p.name) for t in texts)}
    # A results page cites further files only when it is cited itself.
    grew = True
    while grew:
        pages = [(RESULTS / n).read_text(encoding="utf-8") for n in cited if n.endswith(".md")]
        more = {p.name for p in files if p.name not in cited
                and any(_cites(t, p.name) for t in pages)}
        cited |= more
        grew = bool(more)
    uncited = [p.name for p in files if p.name not in cited]
    assert not uncited, (f"{len(uncited)} files in docs/results are cited by no doc (cite them "
                         "or git rm them):\n" + "\n".join(uncited))
