// The phase tracer's points: the index of trace[] in a slot (common/limits.h) that each
// trace_mark / trace_mark_last / end_barrier call (transport/peer.cuh) or diag_max call
// (kernels/low_latency/, JAX_EP_LL_DIAG) writes. module_runtime.cc exports the names
// (`_C.trace_marks`, `_C.diag_marks`) for benchmarks/trace_phases.py. Host and device code.
#pragma once

namespace jax_ep {
namespace trace {

// %globaltimer of one point of one call (block 0 or the last block; see peer.cuh). Plain ints
// (not an enum): end_barrier takes the index as an int.
// high-throughput dispatch / gather
constexpr int kLayoutStart = 0;
constexpr int kLayoutPeersReady = 1;
constexpr int kLayoutCounts = 2;
constexpr int kLayoutGridBarrier = 3;
constexpr int kLayoutEnd = 4;
constexpr int kCopyStart = 5;
constexpr int kCopyLoopDone = 6;
constexpr int kCopyAllBlocksArrived = 7;  // end_barrier marks this and the next
constexpr int kCopyPeersDone = 8;
constexpr int kGatherPeersReady = 9;
// high-throughput combine
constexpr int kCombineStart = 10;
constexpr int kCombinePeersReady = 11;
constexpr int kCombineLoopDone = 12;
constexpr int kCombineAllBlocksArrived = 13;  // end_barrier marks this and the next
constexpr int kCombinePeersDone = 14;
// low-latency dispatch
constexpr int kLlDispatchStart = 16;
constexpr int kLlDispatchSendDone = 17;
constexpr int kLlDispatchFirstFill = 18;
constexpr int kLlDispatchReceiveDone = 19;
// low-latency combine
constexpr int kLlCombineStart = 24;
constexpr int kLlCombineSendDone = 25;
constexpr int kLlCombineReceiveStarts = 26;
constexpr int kLlCombineReceiveDone = 27;

// The fused GEMM + combine (its call site's own slot, so these indices are its own; exported
// apart as `_C.fused_trace_marks`): block 0 past the peers' publication; per column chunk
// c < kFusedTracedChunks, the latest time a tile of chunk c was counted stored, a first-step
// task of chunk c ended and a second-step task of chunk c ended (trace_max); the latest time a
// tile block finished its tiles; the end barrier passed (block 0).
constexpr int kFusedStart = 0;
constexpr int kFusedTracedChunks = 8;
constexpr int kFusedChunkStored = 1;                                          // + chunk
constexpr int kFusedChunkReduced = kFusedChunkStored + kFusedTracedChunks;    // + chunk
constexpr int kFusedChunkCombined = kFusedChunkReduced + kFusedTracedChunks;  // + chunk
constexpr int kFusedTilesDone = kFusedChunkCombined + kFusedTracedChunks;
constexpr int kFusedEnd = kFusedTilesDone + 1;

// With the diag attribute (JAX_EP_LL_DIAG=1), the low-latency kernels' per-warp points: the
// latest time any block or warp reached each (atomicMax into trace[i]).
constexpr int kDiagLastBlockStart = 0;
constexpr int kDiagPastWaitFreed = 1;
constexpr int kDiagFirstSendTicket = 2;
constexpr int kDiagSendLoopDone = 3;
constexpr int kDiagReceiveItemDone = 4;
constexpr int kDiagFirstCopyPastRowWait = 5;
constexpr int kDiagFastCopyWordsIn = 6;
constexpr int kDiagFirstReceiveTicket = 7;
constexpr int kDiagItemDataIn = 8;
constexpr int kDiagReceiveLoopDone = 9;
constexpr int kDiagCloserPastFreed = 10;
constexpr int kDiagKernelExit = 11;

struct Named {
  int index;
  const char* name;
};

inline constexpr Named kMarkNames[] = {
    {kLayoutStart, "layout start"},
    {kLayoutPeersReady, "layout: peers ready"},
    {kLayoutCounts, "layout: counts"},
    {kLayoutGridBarrier, "layout: grid barrier"},
    {kLayoutEnd, "layout end"},
    {kCopyStart, "copy start"},
    {kCopyLoopDone, "copy loop done"},
    {kCopyAllBlocksArrived, "all blocks arrived"},
    {kCopyPeersDone, "peers done"},
    {kGatherPeersReady, "gather: peers ready"},
    {kCombineStart, "start"},
    {kCombinePeersReady, "peers ready"},
    {kCombineLoopDone, "loop done"},
    {kCombineAllBlocksArrived, "all blocks arrived"},
    {kCombinePeersDone, "peers done"},
    {kLlDispatchStart, "start"},
    {kLlDispatchSendDone, "send done (items counted)"},
    {kLlDispatchFirstFill, "first fill item done (its counts in)"},
    {kLlDispatchReceiveDone, "receive done"},
    {kLlCombineStart, "start"},
    {kLlCombineSendDone, "send done (rows and tags out)"},
    {kLlCombineReceiveStarts, "receive starts (block 0)"},
    {kLlCombineReceiveDone, "receive done"},
};

inline constexpr Named kDiagNames[] = {
    {kDiagLastBlockStart, "last block start"},
    {kDiagPastWaitFreed, "last block past wait-freed"},
    {kDiagFirstSendTicket, "last warp's first send ticket"},
    {kDiagSendLoopDone, "last warp's send loop done (items counted)"},
    {kDiagReceiveItemDone, "last receive item done"},
    {kDiagFirstCopyPastRowWait, "last warp's first copy item past its row wait"},
    {kDiagFastCopyWordsIn, "last fast copy's words in"},
    {kDiagFirstReceiveTicket, "last warp's first receive ticket"},
    {kDiagItemDataIn, "last item's data in"},
    {kDiagReceiveLoopDone, "last warp's receive loop done (items counted)"},
    {kDiagCloserPastFreed, "closer past freed"},
    {kDiagKernelExit, "last warp at kernel exit"},
};

}  // namespace trace
}  // namespace jax_ep
