// Compiled only in builds with NVSHMEM (CMakeLists.txt); the others compile unbuilt.cc.
#include "nvshmem/symmetric.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "nvshmem/glue.h"
#include "testing/mutations.h"

namespace jax_ep {
namespace sym {

namespace {
constexpr size_t kAlign = 4096;
std::mutex g_mu;
const nvshmem::HostApi* g_api = nullptr;
uint8_t* g_arena = nullptr;
size_t g_arena_bytes = 0;
size_t g_used = 0;
int g_pe = -1, g_npes = 0;
// Some PE is not reachable by loads and stores (another node; or JAX_EP_FORCE_REMOTE_PEERS=1,
// which treats every other PE so, to exercise the NVSHMEM path on one node). The same on every
// PE of a job whose nodes are alike, so every PE makes the same allocations (see reserve).
bool g_force_remote = false, g_any_remote = false;
struct SymGroup {
  Workspace* local = nullptr;
  std::vector<Workspace*> peer;  // this process's address of each rank's workspace (or null)
};
std::map<std::vector<int>, SymGroup> g_sym_groups;
// The lease ledger (symmetric.h): its ring in the arena, the number of leases made so far and
// the running hash of their contents. The ring is written and read on a stream of its own
// (copies, and NVSHMEM gets for peers that loads do not reach), which never waits for the op
// streams (a peer's kernel may be waiting for us).
LedgerEntry* g_ledger = nullptr;
LedgerEntry* g_ledger_scratch = nullptr;  // where NVSHMEM gets put a remote peer's entry
LedgerEntry* g_ledger_pinned = nullptr;   // pinned host copy of it (an async copy to pageable
                                          // memory would wait for the get before returning)
cudaStream_t g_ledger_stream = nullptr;
int g_device = -1;  // this process's GPU (the ledger's copies run on it)
uint64_t g_leases = 0;
uint64_t g_chain = 0xcbf29ce484222325ull;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("jax_ep: ") + what + ": " + cudaGetErrorString(e));
  }
}

// Bump allocation from the arena (caller holds g_mu). The arena was zeroed at attach and
// nothing is ever freed, so a fresh sub-allocation is zero on every PE without a barrier.
uint8_t* take(size_t bytes, const char* what) {
  const size_t need = (bytes + kAlign - 1) / kAlign * kAlign;
  if (g_used + need > g_arena_bytes) {
    std::ostringstream os;
    os << "jax_ep: the symmetric arena is full: " << what << " needs " << bytes << " bytes, "
       << (g_arena_bytes - g_used) << " of " << g_arena_bytes
       << " are left. Set JAX_EP_SYMMETRIC_BYTES larger (every process the same) before "
          "jax_ep.initialize(); NVSHMEM_SYMMETRIC_SIZE must exceed it.";
    throw std::runtime_error(os.str());
  }
  uint8_t* p = g_arena + g_used;
  g_used += need;
  return p;
}

// This process's load/store address of `local`'s counterpart on `pe`, or null (remote).
void* peer_address(void* local, int pe) {
  if (pe == g_pe) return local;
  if (g_force_remote) return nullptr;
  return g_api->ptr(local, pe);
}

// Ledger entries move whole on g_ledger_stream. A write invalidates the ring entry,
// then writes the payload, then the number: a reader that sees a number sees the payload that
// goes with it once two reads in a row agree (see read_entry).
// Copies on g_ledger_stream with this process's GPU current: XLA's compile threads may have
// another device current, and a copy there would open a context on it.
class OnLedgerDevice {
 public:
  OnLedgerDevice() {
    e_ = cudaGetDevice(&prev_);
    if (e_ == cudaSuccess && prev_ != g_device) e_ = cudaSetDevice(g_device);
  }
  ~OnLedgerDevice() {
    if (prev_ >= 0 && prev_ != g_device) cudaSetDevice(prev_);
  }
  cudaError_t error() const { return e_; }

 private:
  int prev_ = -1;
  cudaError_t e_ = cudaSuccess;
};
// Waits for g_ledger_stream until `deadline` (cudaErrorTimeout after it).
cudaError_t finish(std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    const cudaError_t e = cudaStreamQuery(g_ledger_stream);
    if (e != cudaErrorNotReady) return e;
    if (std::chrono::steady_clock::now() > deadline) return cudaErrorTimeout;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}
cudaError_t copy_entry(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  OnLedgerDevice on;
  cudaError_t e = on.error();
  if (e == cudaSuccess) e = cudaMemcpyAsync(dst, src, bytes, kind, g_ledger_stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(g_ledger_stream);
  return e;
}
void write_entry(const LedgerEntry& e) {
  LedgerEntry* dst = g_ledger + (e.number_plus1 - 1) % kLedgerEntries;
  const uint64_t none = 0;
  LedgerEntry payload = e;
  payload.number_plus1 = 0;
  check(copy_entry(&dst->number_plus1, &none, sizeof none, cudaMemcpyHostToDevice),
        "writing the lease ledger");
  check(copy_entry(dst, &payload, sizeof payload, cudaMemcpyHostToDevice),
        "writing the lease ledger");
  check(copy_entry(&dst->number_plus1, &e.number_plus1, sizeof e.number_plus1,
                   cudaMemcpyHostToDevice),
        "writing the lease ledger");
}
// One read of PE pe's ring entry `entry` (this process's own address of it): by a copy from
// `mapped`, pe's entry as loads and stores reach it, or, for a PE they do not reach (mapped
// null), by an NVSHMEM get into g_ledger_scratch (callers are serialised: the per-process mode,
// runtime/mode.h). A get that does not complete by the deadline (a peer gone mid-read) gives
// cudaErrorTimeout; it then stays queued on g_ledger_stream, which nothing uses again (a failed
// check latches, runtime/mode_per_process.cc). The scratch is cleared first: a get that ended
// without writing reads as an entry never written, never as the previous peer's.
cudaError_t read_once(const LedgerEntry* entry, int pe, const LedgerEntry* mapped, LedgerEntry* out,
                      std::chrono::steady_clock::time_point deadline) {
  if (mapped != nullptr) return copy_entry(out, mapped, sizeof *out, cudaMemcpyDeviceToHost);
  OnLedgerDevice on;
  cudaError_t e = on.error();
  if (e == cudaSuccess)
    e = cudaMemsetAsync(g_ledger_scratch, 0, sizeof *g_ledger_scratch, g_ledger_stream);
  if (e == cudaSuccess)
    e = nvshmem::launch_get(g_ledger_scratch, entry, sizeof *out, pe, g_ledger_stream);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(g_ledger_pinned, g_ledger_scratch, sizeof *out, cudaMemcpyDeviceToHost,
                        g_ledger_stream);
  // Bounded: the get waits on the network, and pe may be gone (the deadline is at least a
  // second away, as the last poll of check_lease may come just before it).
  if (e == cudaSuccess)
    e = finish(std::max(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(1)));
  if (e == cudaSuccess) *out = *g_ledger_pinned;
  return e;
}
// cudaErrorNotReady: no two reads agreed before the deadline (the entry kept changing);
// cudaErrorTimeout: a read did not complete in time (read_once).
cudaError_t read_entry(const LedgerEntry* entry, int pe, const LedgerEntry* mapped,
                       LedgerEntry* out, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    LedgerEntry a, b;
    cudaError_t e = read_once(entry, pe, mapped, &a, deadline);
    if (e == cudaSuccess) e = read_once(entry, pe, mapped, &b, deadline);
    if (e != cudaSuccess) return e;
    if (std::memcmp(&a, &b, sizeof a) == 0) {
      *out = a;
      return cudaSuccess;
    }
    if (std::chrono::steady_clock::now() > deadline) return cudaErrorNotReady;
  }
}

const SymGroup* find_group(const int64_t* members, int n) {
  std::vector<int> key(members, members + n);
  auto it = g_sym_groups.find(key);
  return it == g_sym_groups.end() ? nullptr : &it->second;
}
}  // namespace

bool built() { return true; }
bool active() { return g_api != nullptr; }
int my_pe() { return g_pe; }
int n_pes() { return g_npes; }

void attach(size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_api != nullptr) {
    if (bytes != g_arena_bytes) {
      std::ostringstream os;
      os << "jax_ep: already attached with a " << g_arena_bytes << "-byte arena (asked " << bytes
         << ")";
      throw std::runtime_error(os.str());
    }
    return;
  }
  const nvshmem::HostApi& api = nvshmem::open();
  const size_t arena = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = api.align(kAlign, arena);
  if (p == nullptr) {
    std::ostringstream os;
    os << "jax_ep: nvshmem_align of the " << arena
       << "-byte arena failed: set NVSHMEM_SYMMETRIC_SIZE above JAX_EP_SYMMETRIC_BYTES (before "
          "NVSHMEM is initialised) and leave that much GPU memory outside JAX's pool "
          "(XLA_PYTHON_CLIENT_MEM_FRACTION)";
    throw std::runtime_error(os.str());
  }
  check(cudaMemset(p, 0, arena), "cudaMemset(symmetric arena)");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  api.barrier_all();  // nobody writes into a peer's arena before that peer has zeroed it
  g_arena = static_cast<uint8_t*>(p);
  g_arena_bytes = arena;
  g_pe = api.my_pe();
  g_npes = api.n_pes();
  const char* force = std::getenv("JAX_EP_FORCE_REMOTE_PEERS");
  g_force_remote = force != nullptr && std::string(force) == "1";
  g_any_remote = false;
  for (int pe = 0; pe < g_npes; ++pe)
    if (pe != g_pe && (g_force_remote || api.ptr(p, pe) == nullptr)) g_any_remote = true;
  g_ledger = reinterpret_cast<LedgerEntry*>(
      take(sizeof(LedgerEntry) * kLedgerEntries, "the lease ledger"));
  g_ledger_scratch =
      reinterpret_cast<LedgerEntry*>(take(sizeof(LedgerEntry), "the lease ledger's scratch"));
  check(cudaStreamCreateWithFlags(&g_ledger_stream, cudaStreamNonBlocking),
        "cudaStreamCreateWithFlags(lease ledger)");
  check(cudaMallocHost(&g_ledger_pinned, sizeof(LedgerEntry)), "cudaMallocHost(lease ledger)");
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  g_device = device;
  g_api = &api;
}

std::vector<long long> self_test() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_api == nullptr) throw std::runtime_error("jax_ep: self_test before attach");
  // A dedicated cell from the arena (same offset everywhere: every PE runs the same sequence).
  int* cell = reinterpret_cast<int*>(take(sizeof(int), "the self-test cell"));
  int* out = nullptr;
  check(cudaMalloc(&out, 4 * sizeof(int)), "cudaMalloc");
  check(cudaMemset(cell, 0, sizeof(int)), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  g_api->barrier_all();
  nvshmem::launch_self_test(cell, out);
  g_api->barrier_all();  // every PE's put has completed (quiet) before anyone reads its cell
  int host[4] = {0, 0, 0, 0};
  check(cudaMemcpy(host, out, 3 * sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaMemcpy(&host[3], cell, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(out);
  const int prev = (g_pe + g_npes - 1) % g_npes;
  return {host[0], host[1], host[3], 1000 + prev, host[2]};
}

void init_groups(const std::vector<std::vector<int>>& table) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_api == nullptr) throw std::runtime_error("jax_ep: per-process mode is not attached");
  for (const std::vector<int>& members : table) {
    if (g_sym_groups.count(members)) continue;
    for (int pe : members)
      if (pe < 0 || pe >= g_npes) {
        std::ostringstream os;
        os << "jax_ep: EP group names PE " << pe << " but there are " << g_npes << " PEs";
        throw std::runtime_error(os.str());
      }
    SymGroup g;
    g.local = reinterpret_cast<Workspace*>(take(sizeof(Workspace), "an EP group's workspace"));
    for (int pe : members) g.peer.push_back(static_cast<Workspace*>(peer_address(g.local, pe)));
    g_sym_groups[members] = g;
  }
}

Workspace* group_workspace(const int64_t* members, int n, int r, bool* remote, std::string* err) {
  std::lock_guard<std::mutex> lock(g_mu);
  *remote = false;
  const SymGroup* g = find_group(members, n);
  if (g == nullptr) {
    *err = "no workspace for this EP group (the lowering initialises it: was it skipped?)";
    return nullptr;
  }
  *remote = g->peer[r] == nullptr;
  return g->peer[r];
}

std::vector<unsigned long long> reserve(const std::vector<std::vector<int>>& table, int slot,
                                        size_t bytes, uint64_t content, LedgerEntry* entry) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_api == nullptr) throw std::runtime_error("jax_ep: per-process mode is not attached");
  if (slot < 0 || slot >= kNumSlots) throw std::runtime_error("jax_ep: slot out of range");
  // With remote peers, the buffer is followed by one scratch image per rank: the send area of
  // the push ops (rows for remote rank q), the mirror of remote q's staging buffer (pull ops).
  // Every lease gets memory no lease had before: the arena was zeroed at attach, so it reads
  // zero, and a faster peer may already have written rows into it (its own lease of this call
  // site came first), which zeroing it here would erase. Never reused: the arena only grows.
  struct {
    uint8_t* local;
    size_t bytes;
  } sb;
  const int images = g_any_remote && !table.empty() ? static_cast<int>(table[0].size()) : 0;
  sb.bytes = (bytes + kAlign - 1) / kAlign * kAlign;
  sb.local = take(sb.bytes * (1 + images), "a call site's data buffer");
  // The ledger: number, content chain (FNV-1a over the content hashes), slot, offset.
  g_chain = (g_chain ^ content) * 0x100000001b3ull;
  LedgerEntry e;
  e.number_plus1 = ++g_leases;
  e.chain = g_chain;
  e.slot = slot;
  e.offset = static_cast<uint64_t>(sb.local - g_arena);
  write_entry(e);
  *entry = e;
  std::vector<unsigned long long> out;
  for (const std::vector<int>& members : table) {
    bool mine = false;
    for (int pe : members) mine = mine || pe == g_pe;
    for (size_t r = 0; r < members.size(); ++r) {
      if (!mine) {
        out.push_back(0ull);
        continue;
      }
      void* a = peer_address(sb.local, members[r]);
      // Remote member: its scratch image, tagged by bit 0 (addresses are 4096-aligned).
      out.push_back(a != nullptr
                        ? reinterpret_cast<unsigned long long>(a)
                        : reinterpret_cast<unsigned long long>(sb.local + sb.bytes * (1 + r)) |
                              1ull);
    }
  }
  return out;
}

std::string check_lease(const LedgerEntry& mine, const std::vector<std::vector<int>>& table,
                        long long timeout_ns) {
  const LedgerEntry* ring_entry = nullptr;
  std::map<int, const LedgerEntry*> where;  // each peer: its entry as loads reach it, or null
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_api == nullptr || g_ledger == nullptr) return {};
    ring_entry = g_ledger + (mine.number_plus1 - 1) % kLedgerEntries;
    for (const std::vector<int>& members : table) {
      if (std::find(members.begin(), members.end(), g_pe) == members.end()) continue;
      for (int pe : members)
        if (pe != g_pe)
          where[pe] = static_cast<const LedgerEntry*>(
              peer_address(const_cast<LedgerEntry*>(ring_entry), pe));
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
  const uint64_t n = mine.number_plus1;
  for (const auto& [pe, mapped] : where) {
    if (JAX_EP_PLANTED(kLedgerSkipsRemote) && mapped == nullptr) continue;
    for (;;) {
      LedgerEntry theirs;
      const cudaError_t e = read_entry(ring_entry, pe, mapped, &theirs, deadline);
      if (e == cudaErrorTimeout && mapped == nullptr) {
        return "jax_ep: reading process " + std::to_string(pe) +
               "'s lease ledger through NVSHMEM did not complete in time: that process is "
               "gone or its node unreachable, or (if it is alive) raise JAX_EP_TIMEOUT_S.";
      }
      if (e == cudaErrorNotReady) {
        return "jax_ep: process " + std::to_string(pe) +
               "'s lease ledger entry kept changing until the deadline (two reads in a row "
               "never agreed)";
      }
      if (e != cudaSuccess) {
        cudaGetLastError();
        return "jax_ep: reading process " + std::to_string(pe) +
               "'s lease ledger failed: " + cudaGetErrorString(e);
      }
      if (theirs.number_plus1 > n) break;  // a whole ring ahead: that entry is gone
      if (theirs.number_plus1 == n) {
        if (theirs.chain == mine.chain && theirs.slot == mine.slot && theirs.offset == mine.offset)
          break;
        std::ostringstream os;
        os << "jax_ep: processes " << g_pe << " and " << pe
           << " disagree on their jax_ep call sites: call site number " << n << " of process "
           << g_pe << " holds workspace slot " << mine.slot << " and buffer offset " << mine.offset
           << ", call site number " << n << " of process " << pe << " slot " << theirs.slot
           << " and offset " << theirs.offset
           << (theirs.chain != mine.chain ? ", and the call sites compiled so far differ"
                                          : " (the same call sites, dropped in a different order)")
           << ". Every process must compile, and drop, the same programs that use jax_ep ops, "
              "in the same order: one extra compile on one process (a .lower().compile() for a "
              "cost analysis, a program only one process runs) shifts the slots and buffers of "
              "every later call site, and the ranks would exchange rows through the wrong "
              "buffers. Compile such programs on every process.";
        return os.str();
      }
      if (std::chrono::steady_clock::now() > deadline) {
        std::ostringstream os;
        os << "jax_ep: process " << pe << " has not compiled call site number " << n
           << " of process " << g_pe << " within " << timeout_ns / 1000000000.0
           << " s: it compiles other programs that use jax_ep ops (every process must "
              "compile the same ones, in the same order), is slower than that, or stopped. "
              "Raise JAX_EP_TIMEOUT_S if its compiles can legitimately lag that far.";
        return os.str();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return {};
}

std::vector<int> remote_pes() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<int> out;
  if (g_api == nullptr) return out;
  for (int pe = 0; pe < g_npes; ++pe)
    if (peer_address(g_arena, pe) == nullptr) out.push_back(pe);
  return out;
}
size_t arena_bytes() { return g_arena_bytes; }
size_t arena_used() { return g_used; }

}  // namespace sym
}  // namespace jax_ep
