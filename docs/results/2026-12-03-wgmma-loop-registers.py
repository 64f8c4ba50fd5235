"""Per kernel of a cubin: the instructions around its wgmma loop (from 40 before the first HGMMA
to 40 after the last), counting the R2UR moves (a per-thread register copied into a uniform one)
and the barrier waits (SYNCS.PHASECHK ... TRYWAIT) that address shared memory through a uniform
register. The tree's fused mainloops keep their stage and descriptor arithmetic in uniform
registers (1 R2UR, every wait on a uniform address); a branch that the compiler cannot prove
warp-uniform around the mainloop moved it to per-thread registers
(docs/kernels.md#fused-half-tiles).

  nvcc -std=c++17 -DJAX_EP_WITH_GEMM=1 -DNDEBUG -lineinfo -O3 \
      --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I csrc \
      -I <jaxlib FFI headers> -I <cutlass>/include -I <cutlass>/tools/util/include \
      -cubin -o gather_gemm.cubin csrc/kernels/fused/gather_gemm.cu
  python docs/results/2026-12-03-wgmma-loop-registers.py gather_gemm.cubin

Needs nvdisasm on PATH (the nvidia-cuda-nvdisasm wheel carries it).
"""
import re
import subprocess
import sys

sass = subprocess.run(["nvdisasm", "-c", sys.argv[1]], capture_output=True, text=True,
                      check=True).stdout
for part in re.split(r"\n(?=//-+ \.text\.)", sass):
    m = re.match(r"//-+ \.text\.(\S+)", part)
    if not m:
        continue
    lines = part.split("\n")
    at = [i for i, line in enumerate(lines) if "HGMMA" in line]
    if not at:
        continue
    hot = lines[max(at[0] - 40, 0):at[-1] + 40]
    waits = [line for line in hot if "TRYWAIT" in line]
    print(f"{m.group(1)[-50:]}: HGMMA {len(at)}, R2UR {sum('R2UR' in line for line in hot)}, "
          f"waits on a uniform address {sum('[UR' in line for line in waits)} of {len(waits)}")
