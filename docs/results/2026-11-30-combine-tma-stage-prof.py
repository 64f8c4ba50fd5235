"""Combine-only blocks' tasks, staged (even blocks) against registers (odd blocks): time per task
past its waits, and the SM clock, from the words the profiling hook adds into the phase tracer's
slots 27-31 (2026-11-30-combine-tma-stage.patch, then 2026-11-30-combine-tma-stage-prof-hook.patch
on top). Run from the repository's root with trace_phases.py's arguments, e.g.
  python docs/results/2026-11-30-combine-tma-stage-prof.py --ranks 1 --fused --absolute \
      --scan 5 --combine-blocks 8
The clock divides by 25 calls (5 runs of 5); with the trace_phases.py of the day the scan's calls
ran as one, so the figure it printed is a fifth of the clock (see the log)."""
import sys
sys.path.insert(0, "benchmarks")
import trace_phases as tp
orig = tp.report


def report(name, group, before, after, host_us, names=None):
    orig(name, group, before, after, host_us, names)
    for d in group:
        for s, row in after[d].items():
            old = before[d].get(s)
            if old is None or old == row:
                continue
            ns_s, n_s, ns_r, n_r, mhz = (row[i] - old[i] for i in range(27, 32))
            warps = 12 * 25 * max(1, tp.COMBINE_BLOCKS)  # each combine-only warp, 25 calls
            print(f"  PROF dev {d}: staged blocks: {n_s} tasks, {ns_s / max(n_s, 1) / 1e3:.2f} us "
                  f"past the waits; register blocks: {n_r} tasks, "
                  f"{ns_r / max(n_r, 1) / 1e3:.2f} us; SM clock ~{mhz / warps / 1e3:.3f} GHz")


tp.report = report
tp.main()
