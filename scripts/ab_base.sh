#!/usr/bin/env bash
# The base of a kernel A/B (scripts/gpu_check.sh ab): fills DIR with revision REV's version of
# every file under csrc/, jax_ep/, CMakeLists.txt and pyproject.toml that differs from the
# working tree, at its repository path, and lists in DIR/.ab-delete the files there REV lacks
# (untracked ones included). Run it here, where git is; DIR under .out/ travels to the GPU
# machine with `carry`.
#   scripts/ab_base.sh HEAD .out/ab_base   (the uncommitted change against HEAD)
#   AB_BASE=.out/ab_base AB_CMD='python3 "$R/benchmarks/trace_phases.py" --ranks 1 --fused' \
#       scripts/gpu_check.sh build ab
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: scripts/ab_base.sh REV DIR" >&2; exit 2; }
rev=$1 dir=$(mkdir -p "$2" && cd "$2" && pwd)  # (the caller's path, before the cd below)
git rev-parse --verify -q "$rev^{commit}" > /dev/null || { echo "ab_base: no revision $rev" >&2; exit 2; }
cd "$(git rev-parse --show-toplevel)"
paths=(csrc jax_ep CMakeLists.txt pyproject.toml)
rm -rf "$dir" && mkdir -p "$dir" && : > "$dir/.ab-delete"
{ git diff --name-only "$rev" -- "${paths[@]}"; git ls-files --others --exclude-standard -- "${paths[@]}"; } \
  | sort -u | while read -r f; do
    if git cat-file -e "$rev:$f" 2> /dev/null; then
      mkdir -p "$dir/$(dirname "$f")" && git show "$rev:$f" > "$dir/$f"
    else
      echo "$f" >> "$dir/.ab-delete"
    fi
  done
echo "ab_base: $(find "$dir" -type f ! -name .ab-delete | wc -l) files of $rev in $dir," \
  "$(wc -l < "$dir/.ab-delete") to delete"
