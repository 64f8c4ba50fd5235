"""Compare the SASS of every kernel between two git revisions: a code move must not change it.

Builds the given translation units of each revision to sm_90a cubins (same flags as the
extension, without -lineinfo: moved lines must not count), disassembles them with cuobjdump and
compares each kernel's instructions. Masked, because they depend on the file a kernel sits in
and not on its code: the anonymous-namespace part of kernel names and the slots of bank 4 of
the constant memory (the addresses of the unit's global symbols, e.g. printf formats).

  python scripts/sass_compare.py REV_BEFORE REV_AFTER \\
      --before csrc/kernels/low_latency.cu,csrc/kernels/high_throughput.cu \\
      --after csrc/kernels/low_latency/dispatch.cu,csrc/kernels/low_latency/combine.cu,...

Needs nvcc, and cuobjdump + nvdisasm on PATH (the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels carry them), and the jaxlib FFI headers (the installed jaxlib).
Exit status 1 when a kernel's SASS differs or a kernel exists on one side only.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile

ANON = re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}")
BANK4 = re.compile(r"c\[0x4\]\[0x[0-9a-f]+\]")
ENCODING = re.compile(r"/\* 0x[0-9a-f]{16} \*/")


def checkout(rev, root, dest):
    data = subprocess.run(["git", "archive", rev, "csrc"], cwd=root, capture_output=True,
                          check=True).stdout
    path = os.path.join(dest, "archive.tar")
    with open(path, "wb") as f:
        f.write(data)
    with tarfile.open(path) as t:
        t.extractall(dest, filter="data")


def build(tree, units, out, jaxlib_include):
    cubins = []
    for i, u in enumerate(units):
        cubin = os.path.join(out, f"{i}.cubin")
        subprocess.run(["nvcc", "-cubin", "-std=c++17", "-O3", "--expt-relaxed-constexpr",
                        "-Xcudafe", "--diag_suppress=177", "-gencode=arch=compute_90a,code=sm_90a",
                        "-I" + os.path.join(tree, "csrc"), "-I" + jaxlib_include,
                        "-I/usr/local/cuda/include/cccl", os.path.join(tree, u), "-o", cubin],
                       check=True)
        cubins.append(cubin)
    return cubins


def kernels(cubins):
    out = {}
    for c in cubins:
        text = subprocess.run(["cuobjdump", "-sass", c], capture_output=True, text=True,
                              check=True).stdout
        for block in re.split(r"\n\s*Function : ", text)[1:]:
            name, body = block.split("\n", 1)
            out[ANON.sub("ANON", name.strip())] = [
                BANK4.sub("c[0x4][*]", ENCODING.sub("", ANON.sub("ANON", line))).strip()
                for line in body.splitlines() if line.strip().startswith("/*")]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before_rev")
    ap.add_argument("after_rev")
    ap.add_argument("--before", required=True, help="comma-separated units of before_rev")
    ap.add_argument("--after", required=True, help="comma-separated units of after_rev")
    args = ap.parse_args()
    import jaxlib
    inc = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        sides = []
        for side, rev, units in (("before", args.before_rev, args.before),
                                 ("after", args.after_rev, args.after)):
            tree = os.path.join(tmp, side)
            os.makedirs(tree)
            checkout(rev, root, tree)
            sides.append(kernels(build(tree, units.split(","), tree, inc)))
    a, b = sides
    same = [n for n in a if b.get(n) == a[n]]
    differ = [n for n in a if n in b and b[n] != a[n]]
    only = sorted(set(a) ^ set(b))
    print(f"kernels: {len(a)} before, {len(b)} after; identical SASS: {len(same)} "
          f"({sum(len(a[n]) for n in same)} instructions); differing: {len(differ)}; "
          f"on one side only: {len(only)}")
    for n in differ + only:
        print("  ", n)
    return 0 if not differ and not only else 1


if __name__ == "__main__":
    sys.exit(main())
