"""Compare the SASS of every kernel between two git revisions: a code move must not change it.

Builds the given translation units of each revision to sm_90a cubins (same flags as the
extension, without -lineinfo: moved lines must not count), disassembles them with cuobjdump and
compares each kernel's instructions. Masked, because they depend on the file a kernel sits in
and not on its code: the anonymous-namespace part of kernel names and the slots of bank 4 of
the constant memory (the addresses of the unit's global symbols, e.g. printf formats).

  python scripts/sass_compare.py REV_BEFORE REV_AFTER \\
      --before csrc/kernels/low_latency.cu,csrc/kernels/high_throughput.cu \\
      --after csrc/kernels/low_latency/dispatch.cu,csrc/kernels/low_latency/combine.cu,...

-D NAME[=VALUE] defines a macro for both sides (the build's GEMM units: -D NDEBUG
-D JAX_EP_WITH_GEMM=1); --after-define only for after_rev. A build of csrc/testing/mutations.h's
planted bug N must differ from the real one, where the hooks compile away:

  python scripts/sass_compare.py main HEAD --before csrc/kernels/low_latency/dispatch.cu \
      --after csrc/kernels/low_latency/dispatch.cu --after-define JAX_EP_MUTATION=1

Needs nvcc, and cuobjdump + nvdisasm on PATH (the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels carry them), the jaxlib FFI headers (the installed jaxlib), and
for the GEMM and fused units CUTLASS's headers (the nvidia-cutlass package, or
JAX_EP_CUTLASS_DIR). Exit status 1 when a kernel's SASS differs or a kernel exists on one side
only.
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


def cutlass_includes():
    """CUTLASS's include folders as CMakeLists.txt finds them, or none."""
    root = os.environ.get("JAX_EP_CUTLASS_DIR", "")
    if not root:
        import importlib.util
        spec = importlib.util.find_spec("cutlass_library")
        root = os.path.join(os.path.dirname(spec.origin), "source") if spec else ""
    dirs = [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]
    return ["-I" + d for d in dirs] if root and os.path.isdir(dirs[0]) else []


def build(tree, units, out, jaxlib_include, defines):
    cubins = []
    for i, u in enumerate(units):
        cubin = os.path.join(out, f"{i}.cubin")
        subprocess.run(["nvcc", "-cubin", "-std=c++17", "-O3", "--expt-relaxed-constexpr",
                        "-Xcudafe", "--diag_suppress=177", "-gencode=arch=compute_90a,code=sm_90a",
                        *["-D" + d for d in defines],
                        "-I" + os.path.join(tree, "csrc"), "-I" + jaxlib_include,
                        "-I/usr/local/cuda/include/cccl", *cutlass_includes(),
                        os.path.join(tree, u), "-o", cubin],
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
    ap.add_argument("-D", "--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="a macro for both sides' units (repeatable)")
    ap.add_argument("--after-define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="a macro for after_rev's units only (repeatable), e.g. "
                         "JAX_EP_MUTATION=N")
    args = ap.parse_args()
    import jaxlib
    inc = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        sides = []
        for side, rev, units, defines in (
                ("before", args.before_rev, args.before, args.define),
                ("after", args.after_rev, args.after, args.define + args.after_define)):
            tree = os.path.join(tmp, side)
            os.makedirs(tree)
            checkout(rev, root, tree)
            sides.append(kernels(build(tree, units.split(","), tree, inc, defines)))
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
