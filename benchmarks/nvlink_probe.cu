// nvlink_probe.cu: NVLink all-to-all egress bandwidth, one method at a time.
//
// What it measures: every GPU at the same time sends B bytes to each of its
// G-1 peers (bytes [j*B, (j+1)*B) of src_i land in bytes [i*B, (i+1)*B) of
// dst_j). Reported bandwidth is (G-1)*B / median time, i.e. bytes leaving each
// GPU per second (GB/s = 1e9 B/s). Methods:
//   push_st_U    SM kernel: 16-byte loads of local src, stores into peer dst
//                (U vectors in flight per thread, U = 4, 8, 16)
//   pull_ld_U    SM kernel: 16-byte loads of peer src, stores into local dst
//   push_tma     TMA: bulk load local global -> smem (mbarrier), bulk store
//                smem -> peer global (bulk_group); one pipeline per block
//   push_tma_w4  same, four independent pipelines (warps) per block
//   pull_tma     TMA: bulk load peer global -> smem, bulk store smem -> local
//   pull_tma_w4  same, four pipelines per block
//   copy_engine  cudaMemcpyPeerAsync, one stream per (src GPU, dst GPU) pair
// One process drives all GPUs; all pairs need peer access (NVLink/NVSwitch).
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/nvlink_probe benchmarks/nvlink_probe.cu
// Run:   /tmp/nvlink_probe [--bytes-per-peer 48M] [--sms 16,24,32,66,132]
//            [--threads 512] [--reps 20] [--warmup 3] [--modes all|name,name,...]
//            [--gpus N] [--json out.json]
//            [--tma-chunk 16K] [--tma-smem 192K] [--tma-lag N]
// Exit code 1 if any data check failed, 2 on a CUDA or usage error.

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CK(call)                                                              \
  do {                                                                        \
    cudaError_t e_ = (call);                                                  \
    if (e_ != cudaSuccess) {                                                  \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call,    \
              cudaGetErrorString(e_));                                        \
      std::exit(2);                                                           \
    }                                                                         \
  } while (0)

static constexpr int kMaxGpus = 8;

// Everything one GPU's kernel needs. Peer pointers are UVA addresses of the
// other GPUs' allocations, usable directly once peer access is enabled.
struct A2A {
  const char* src;                 // this GPU's src, G*B bytes
  char* dst;                       // this GPU's dst, G*B bytes
  const char* peer_src[kMaxGpus];  // src of every GPU (index = GPU)
  char* peer_dst[kMaxGpus];        // dst of every GPU
  unsigned long long B;            // bytes per peer, multiple of 16
  int me, G;
};

// q-th peer of this GPU, q in [0, G-1). Starting at me+1 staggers the GPUs.
__device__ __forceinline__ int peer_of(const A2A& a, int q) { return (a.me + 1 + q) % a.G; }

// Worker w of nw owns [lo, hi) (in units) of every peer chunk: contiguous
// per worker, and every worker touches every peer.
__device__ __forceinline__ void worker_slice(unsigned long long n, int w, int nw,
                                             unsigned long long& lo, unsigned long long& hi) {
  lo = n * w / nw;
  hi = n * (w + 1) / nw;
}

__host__ __device__ __forceinline__ uint32_t pattern(int owner, unsigned long long word) {
  return (uint32_t)owner * 0x1000193u ^ (uint32_t)word;
}

// ---------------------------------------------------------------------------
// SM load/store kernels.
// A block walks its slice in tiles of blockDim*U vectors; per tile it visits
// all peers (rotated by block index so blocks start on different peers).
// Within a tile each warp owns 32*U consecutive vectors and lane l handles
// vectors u*32 + l: every instruction moves 512 contiguous bytes per warp and
// the U addresses are one base register plus immediate offsets (few registers).
// Each thread issues U loads, then U stores, so U*16 bytes per thread are in
// flight on the remote side (stores for push, loads for pull).
// ---------------------------------------------------------------------------
template <int U, bool PULL>
__device__ __forceinline__ void ldst_copy(const A2A& a) {
  const int npeers = a.G - 1;
  unsigned long long lo, hi;
  worker_slice(a.B / 16, blockIdx.x, gridDim.x, lo, hi);
  const unsigned long long tile = (unsigned long long)blockDim.x * U;
  for (unsigned long long base = lo; base < hi; base += tile) {
    for (int q = 0; q < npeers; ++q) {
      const int p = peer_of(a, (int)((blockIdx.x + q) % npeers));
      const int4* s;
      int4* d;
      if (PULL) {  // peer src chunk me -> local dst chunk p
        s = reinterpret_cast<const int4*>(a.peer_src[p] + a.me * a.B) + base;
        d = reinterpret_cast<int4*>(a.dst + p * a.B) + base;
      } else {     // local src chunk p -> peer dst chunk me
        s = reinterpret_cast<const int4*>(a.src + p * a.B) + base;
        d = reinterpret_cast<int4*>(a.peer_dst[p] + a.me * a.B) + base;
      }
      const unsigned first = (threadIdx.x / 32) * (32 * U) + threadIdx.x % 32;
      s += first;
      d += first;
      int4 v[U];
      if (base + tile <= hi) {  // full tile: no bounds checks, all U loads issued first
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = s[u * 32];
#pragma unroll
        for (int u = 0; u < U; ++u) d[u * 32] = v[u];
      } else {                  // tail tile
        const unsigned long long n = hi - base;
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (first + u * 32 < n) v[u] = s[u * 32];
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (first + u * 32 < n) d[u * 32] = v[u];
      }
    }
  }
}

// Dynamic smem is requested only to pin one block per SM (see launch code).
template <int U>
__global__ void push_st_kernel(A2A a) { ldst_copy<U, false>(a); }

template <int U>
__global__ void pull_ld_kernel(A2A a) { ldst_copy<U, true>(a); }

// ---------------------------------------------------------------------------
// TMA (cp.async.bulk) helpers, inline PTX for sm_90.
// ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}

// Make the initialised barriers visible to the async proxy (TMA).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// One arrival (count 1) plus the number of bytes the TMA will deliver.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

// Bounded wait for the phase with the given parity to complete.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  for (uint32_t spins = 0;; ++spins) {
    uint32_t done;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
    if (done) return;
    if (spins == (1u << 26)) {
      printf("nvlink_probe: mbarrier wait timed out (block %d thread %d parity %u)\n", blockIdx.x,
             threadIdx.x, parity);
      __trap();
    }
  }
}

// global -> own CTA's smem, completion signalled on bar (complete_tx).
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gsrc, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(smem_dst)),
      "l"(gsrc), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// smem -> global (local or peer), tracked by this thread's bulk async-groups.
__device__ __forceinline__ void bulk_store(void* gdst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gdst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Wait until at most n of this thread's bulk groups are still reading smem.
// The PTX operand must be an immediate, hence the switch.
__device__ __forceinline__ void bulk_wait_read(int n) {
#define NVP_WAIT_READ(N) \
  case N: asm volatile("cp.async.bulk.wait_group.read " #N ";" ::: "memory"); break;
  switch (n) {
    NVP_WAIT_READ(0) NVP_WAIT_READ(1) NVP_WAIT_READ(2) NVP_WAIT_READ(3)
    NVP_WAIT_READ(4) NVP_WAIT_READ(5) NVP_WAIT_READ(6) NVP_WAIT_READ(7)
    NVP_WAIT_READ(8) NVP_WAIT_READ(9) NVP_WAIT_READ(10) NVP_WAIT_READ(11)
    NVP_WAIT_READ(12) NVP_WAIT_READ(13) NVP_WAIT_READ(14)
    default: asm volatile("cp.async.bulk.wait_group.read 15;" ::: "memory"); break;
  }
#undef NVP_WAIT_READ
}

// Wait until all of this thread's bulk stores have completed (writes done).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// ---------------------------------------------------------------------------
// TMA pipeline. Each warp of the block is one independent pipeline driven by
// its lane 0 (the other lanes exit). A pipeline owns `stages` smem buffers of
// `chunk` bytes, each with its own mbarrier, and a contiguous slice of every
// peer chunk; its work list is (round r, peer q) -> `chunk` bytes at slice
// offset r*chunk, peers rotated by pipeline id.
//   nl = chunks whose bulk load was issued, ns = bulk stores issued,
//   nf = stores known to have finished reading their stage (stage free).
// Loop: fill every free stage with a load; wait for the oldest load; issue its
// store; if more than `lag` stores may still be reading smem, wait_group.read
// lag to recycle the oldest. So up to `lag` stages are held by stores and
// stages-lag by loads. Push wants a large lag (remote stores are the slow
// side), pull a small one (remote loads are the slow side).
// ---------------------------------------------------------------------------
template <bool PULL>
__device__ __forceinline__ void tma_copy(const A2A& a, int stages, uint32_t chunk, int lag) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32;
  const int pipes = blockDim.x / 32;
  unsigned char* buf = smem + (size_t)warp * stages * chunk;
  uint64_t* bars =
      reinterpret_cast<uint64_t*>(smem + (size_t)pipes * stages * chunk) + (size_t)warp * stages;
  if (threadIdx.x % 32 != 0) return;

  for (int s = 0; s < stages; ++s) mbar_init(&bars[s], 1);
  mbar_init_fence();

  const int npeers = a.G - 1;
  const int pipe = blockIdx.x * pipes + warp;
  unsigned long long lo, hi;
  worker_slice(a.B / 16, pipe, gridDim.x * pipes, lo, hi);
  lo *= 16;
  hi *= 16;
  const uint32_t rounds = (uint32_t)((hi - lo + chunk - 1) / chunk);
  const uint32_t n = rounds * (uint32_t)npeers;

  // Chunk c -> (source, destination, size). Sizes stay multiples of 16.
  struct Piece {
    const char* src;
    char* dst;
    uint32_t bytes;
  };
  auto locate = [&](uint32_t c) -> Piece {
    const uint32_t r = c / npeers;
    const int p = peer_of(a, (int)((pipe + c % npeers) % npeers));
    const unsigned long long off = lo + (unsigned long long)r * chunk;
    const uint32_t bytes = (uint32_t)min((unsigned long long)chunk, hi - off);
    if (PULL) return {a.peer_src[p] + a.me * a.B + off, a.dst + p * a.B + off, bytes};
    return {a.src + p * a.B + off, a.peer_dst[p] + a.me * a.B + off, bytes};
  };

  uint32_t nl = 0, ns = 0, nf = 0;
  while (ns < n) {
    while (nl < n && nl - nf < (uint32_t)stages) {  // fill free stages
      const int s = nl % stages;
      const Piece pc = locate(nl);
      mbar_arrive_expect_tx(&bars[s], pc.bytes);
      bulk_load(buf + (size_t)s * chunk, pc.src, pc.bytes, &bars[s]);
      ++nl;
    }
    const int s = ns % stages;  // oldest loaded chunk -> store it
    mbar_wait(&bars[s], (ns / stages) & 1);
    const Piece pc = locate(ns);
    bulk_store(pc.dst, buf + (size_t)s * chunk, pc.bytes);
    bulk_commit();
    ++ns;
    if (ns - nf > (uint32_t)lag) {  // recycle stages of older stores
      bulk_wait_read(lag);
      nf = ns - lag;
    }
  }
  bulk_wait_all();  // stores complete before the block exits
}

__global__ void push_tma_kernel(A2A a, int stages, uint32_t chunk, int lag) {
  tma_copy<false>(a, stages, chunk, lag);
}

__global__ void pull_tma_kernel(A2A a, int stages, uint32_t chunk, int lag) {
  tma_copy<true>(a, stages, chunk, lag);
}

// ---------------------------------------------------------------------------
// Setup and checking kernels.
// ---------------------------------------------------------------------------
__global__ void fill_kernel(uint32_t* p, unsigned long long nwords, int owner) {
  for (unsigned long long w = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
       w < nwords; w += (unsigned long long)gridDim.x * blockDim.x)
    p[w] = pattern(owner, w);
}

// Full check of dst on GPU me: chunk j must equal src_j chunk me; the self
// chunk must still be zero. Adds the number of bad words to *bad.
__global__ void check_kernel(const uint4* dst, int me, int G, unsigned long long B,
                             unsigned long long* bad) {
  const unsigned long long vpc = B / 16, nvec = vpc * G;
  unsigned long long nbad = 0;
  for (unsigned long long v = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; v < nvec;
       v += (unsigned long long)gridDim.x * blockDim.x) {
    const int j = (int)(v / vpc);
    const uint4 x = dst[v];
    uint32_t e0 = 0, e1 = 0, e2 = 0, e3 = 0;
    if (j != me) {
      const unsigned long long w = me * (B / 4) + (v - j * vpc) * 4;
      e0 = pattern(j, w);
      e1 = pattern(j, w + 1);
      e2 = pattern(j, w + 2);
      e3 = pattern(j, w + 3);
    }
    nbad += (x.x != e0) + (x.y != e1) + (x.z != e2) + (x.w != e3);
  }
  if (nbad) atomicAdd(bad, nbad);
}

__global__ void gather_kernel(const uint4* dst, const unsigned long long* idx, uint4* out, int n) {
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x)
    out[k] = dst[idx[k]];
}

// ---------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------
enum class Kind { PushSt, PullLd, PushTma, PullTma, CopyEngine };

struct Mode {
  std::string name;
  Kind kind;
  int unroll;  // PushSt / PullLd
  int pipes;   // PushTma / PullTma: warps (pipelines) per block
};

static std::vector<Mode> all_modes() {
  std::vector<Mode> m;
  for (int u : {4, 8, 16}) m.push_back({"push_st_" + std::to_string(u), Kind::PushSt, u, 0});
  for (int u : {4, 8, 16}) m.push_back({"pull_ld_" + std::to_string(u), Kind::PullLd, u, 0});
  m.push_back({"push_tma", Kind::PushTma, 0, 1});
  m.push_back({"push_tma_w4", Kind::PushTma, 0, 4});
  m.push_back({"pull_tma", Kind::PullTma, 0, 1});
  m.push_back({"pull_tma_w4", Kind::PullTma, 0, 4});
  m.push_back({"copy_engine", Kind::CopyEngine, 0, 0});
  return m;
}

struct Options {
  unsigned long long bytes_per_peer = 48ull << 20;
  std::vector<int> sms = {16, 24, 32, 66, 132};
  int threads = 512;
  int reps = 20;
  int warmup = 3;
  std::vector<std::string> modes;  // empty = all
  std::string json;
  int gpus = 0;  // 0 = all visible
  unsigned long long tma_chunk = 16 << 10;
  unsigned long long tma_smem = 192 << 10;
  int tma_lag = -1;  // -1 = per-direction default
};

static void usage_exit(const char* msg) {
  if (msg) fprintf(stderr, "error: %s\n", msg);
  fprintf(stderr,
          "usage: nvlink_probe [--bytes-per-peer N[K|M|G]] [--sms 16,24,...] [--threads N]\n"
          "         [--reps N] [--warmup N] [--modes all|name,...] [--json PATH] [--gpus N]\n"
          "         [--tma-chunk N[K]] [--tma-smem N[K]] [--tma-lag N]\nmodes:");
  for (const Mode& m : all_modes()) fprintf(stderr, " %s", m.name.c_str());
  fprintf(stderr, "\n");
  std::exit(2);
}

static unsigned long long parse_bytes(const std::string& s) {
  char* end = nullptr;
  const double v = strtod(s.c_str(), &end);
  std::string suf(end);
  for (char& c : suf) c = (char)toupper((unsigned char)c);
  double mul = 1;
  if (suf == "" || suf == "B") mul = 1;
  else if (suf == "K" || suf == "KB" || suf == "KIB") mul = 1024.0;
  else if (suf == "M" || suf == "MB" || suf == "MIB") mul = 1024.0 * 1024;
  else if (suf == "G" || suf == "GB" || suf == "GIB") mul = 1024.0 * 1024 * 1024;
  else usage_exit(("bad byte count: " + s).c_str());
  if (end == s.c_str() || v <= 0) usage_exit(("bad byte count: " + s).c_str());
  return (unsigned long long)(v * mul);
}

static int parse_int(const std::string& s) {
  char* end = nullptr;
  const long v = strtol(s.c_str(), &end, 10);
  if (end == s.c_str() || *end) usage_exit(("bad integer: " + s).c_str());
  return (int)v;
}

static std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t c = s.find(',', pos);
    const std::string item = s.substr(pos, c == std::string::npos ? std::string::npos : c - pos);
    if (!item.empty()) out.push_back(item);
    if (c == std::string::npos) break;
    pos = c + 1;
  }
  return out;
}

static Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "-h" || k == "--help") usage_exit(nullptr);
    if (i + 1 >= argc) usage_exit(("missing value for " + k).c_str());
    const std::string v = argv[++i];
    if (k == "--bytes-per-peer") o.bytes_per_peer = parse_bytes(v);
    else if (k == "--sms") {
      o.sms.clear();
      for (const std::string& x : split(v)) o.sms.push_back(parse_int(x));
    } else if (k == "--threads") o.threads = parse_int(v);
    else if (k == "--reps") o.reps = parse_int(v);
    else if (k == "--warmup") o.warmup = parse_int(v);
    else if (k == "--modes") o.modes = (v == "all") ? std::vector<std::string>{} : split(v);
    else if (k == "--json") o.json = v;
    else if (k == "--gpus") o.gpus = parse_int(v);
    else if (k == "--tma-chunk") o.tma_chunk = parse_bytes(v);
    else if (k == "--tma-smem") o.tma_smem = parse_bytes(v);
    else if (k == "--tma-lag") o.tma_lag = parse_int(v);
    else usage_exit(("unknown option " + k).c_str());
  }
  if (o.bytes_per_peer % 16) usage_exit("--bytes-per-peer must be a multiple of 16");
  if (o.threads < 32 || o.threads > 1024 || o.threads % 32) usage_exit("--threads: 32..1024, multiple of 32");
  if (o.reps < 1 || o.warmup < 0) usage_exit("--reps >= 1, --warmup >= 0");
  if (o.tma_chunk % 16 || o.tma_chunk == 0 || o.tma_chunk >= (1u << 20))
    usage_exit("--tma-chunk must be a multiple of 16 below 1 MiB");
  if (o.sms.empty()) usage_exit("--sms is empty");
  return o;
}

struct Gpu {
  char* src = nullptr;
  char* dst = nullptr;
  cudaStream_t stream{};
  cudaEvent_t ev_start{}, ev_stop{};
  std::vector<cudaStream_t> pair_stream;  // copy_engine: one per destination
  std::vector<cudaEvent_t> pair_done;
  std::vector<unsigned long long> sample_idx;  // dst vector indices checked on the host
  unsigned long long* d_sample_idx = nullptr;
  uint4* d_sample_out = nullptr;
  unsigned long long* d_bad = nullptr;
  int sms = 0;
};

struct Row {
  std::string mode, detail;
  int sms, threads;
  double host_us, event_us, gbps_host, gbps_event;
  bool ok;
};

struct Bench {
  Options opt;
  int G = 0;
  std::vector<Gpu> gpu;
  A2A args[kMaxGpus];
  size_t smem_optin = 0, smem_per_sm = 0;

  void setup() {
    int ndev = 0;
    CK(cudaGetDeviceCount(&ndev));
    G = opt.gpus ? opt.gpus : ndev;
    if (G < 2 || G > ndev || G > kMaxGpus) {
      fprintf(stderr, "need 2..%d GPUs (visible %d, requested %d)\n", kMaxGpus, ndev, G);
      std::exit(2);
    }
    gpu.resize(G);
    const unsigned long long B = opt.bytes_per_peer, bytes = B * G;
    for (int i = 0; i < G; ++i) {
      CK(cudaSetDevice(i));
      cudaDeviceProp prop;
      CK(cudaGetDeviceProperties(&prop, i));
      gpu[i].sms = prop.multiProcessorCount;
      if (i == 0) {
        smem_optin = prop.sharedMemPerBlockOptin;
        smem_per_sm = prop.sharedMemPerMultiprocessor;
      }
      for (int j = 0; j < G; ++j) {
        if (j == i) continue;
        int can = 0;
        CK(cudaDeviceCanAccessPeer(&can, i, j));
        if (!can) {
          fprintf(stderr, "GPU %d cannot access GPU %d (no peer access)\n", i, j);
          std::exit(2);
        }
        const cudaError_t e = cudaDeviceEnablePeerAccess(j, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
        else CK(e);
      }
      // The kernels may use up to the opt-in dynamic smem limit.
      const int optin = (int)prop.sharedMemPerBlockOptin;
      const void* kernels[] = {
          (const void*)push_st_kernel<4>, (const void*)push_st_kernel<8>,
          (const void*)push_st_kernel<16>, (const void*)pull_ld_kernel<4>,
          (const void*)pull_ld_kernel<8>, (const void*)pull_ld_kernel<16>,
          (const void*)push_tma_kernel, (const void*)pull_tma_kernel};
      for (const void* k : kernels)
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));

      Gpu& g = gpu[i];
      CK(cudaMalloc(&g.src, bytes));
      CK(cudaMalloc(&g.dst, bytes));
      CK(cudaMemset(g.dst, 0, bytes));
      fill_kernel<<<4 * prop.multiProcessorCount, 256>>>(reinterpret_cast<uint32_t*>(g.src),
                                                          bytes / 4, i);
      CK(cudaGetLastError());
      CK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
      CK(cudaEventCreate(&g.ev_start));
      CK(cudaEventCreate(&g.ev_stop));
      g.pair_stream.resize(G);
      g.pair_done.resize(G);
      for (int j = 0; j < G; ++j) {
        CK(cudaStreamCreateWithFlags(&g.pair_stream[j], cudaStreamNonBlocking));
        CK(cudaEventCreateWithFlags(&g.pair_done[j], cudaEventDisableTiming));
      }
      // Sample: first, last and 1000 random 16-byte vectors of each received chunk.
      const unsigned long long vpc = B / 16;
      std::mt19937_64 rng(12345 + i);
      std::uniform_int_distribution<unsigned long long> pick(0, vpc - 1);
      for (int j = 0; j < G; ++j) {
        if (j == i) continue;
        g.sample_idx.push_back(j * vpc);
        g.sample_idx.push_back(j * vpc + vpc - 1);
        for (int k = 0; k < 1000; ++k) g.sample_idx.push_back(j * vpc + pick(rng));
      }
      const size_t ns = g.sample_idx.size();
      CK(cudaMalloc(&g.d_sample_idx, ns * sizeof(unsigned long long)));
      CK(cudaMalloc(&g.d_sample_out, ns * sizeof(uint4)));
      CK(cudaMalloc(&g.d_bad, sizeof(unsigned long long)));
      CK(cudaMemcpy(g.d_sample_idx, g.sample_idx.data(), ns * sizeof(unsigned long long),
                    cudaMemcpyHostToDevice));
    }
    for (int i = 0; i < G; ++i) {
      A2A& a = args[i];
      memset(&a, 0, sizeof(a));
      a.src = gpu[i].src;
      a.dst = gpu[i].dst;
      for (int j = 0; j < G; ++j) {
        a.peer_src[j] = gpu[j].src;
        a.peer_dst[j] = gpu[j].dst;
      }
      a.B = B;
      a.me = i;
      a.G = G;
    }
    sync_all();
  }

  void sync_all() {
    for (int i = 0; i < G; ++i) {
      CK(cudaSetDevice(i));
      CK(cudaDeviceSynchronize());
    }
  }

  void clear_dst() {
    for (int i = 0; i < G; ++i) {
      CK(cudaSetDevice(i));
      CK(cudaMemset(gpu[i].dst, 0, opt.bytes_per_peer * G));
    }
    sync_all();
  }

  // TMA geometry for a mode: stages per pipeline from the smem budget; lag
  // (stores allowed to hold stages) large for push, small for pull.
  void tma_geometry(const Mode& m, int& stages, int& lag, size_t& smem) const {
    const unsigned long long budget = std::min<unsigned long long>(opt.tma_smem, smem_optin);
    stages = (int)(budget / ((unsigned long long)m.pipes * opt.tma_chunk));
    // Stage buffers first, then one 8-byte mbarrier per stage.
    while (stages >= 2 && (unsigned long long)m.pipes * stages * (opt.tma_chunk + 8) > smem_optin)
      --stages;
    if (stages < 2) {
      fprintf(stderr, "%s: smem budget %llu too small for 2 stages of %llu bytes x %d pipes\n",
              m.name.c_str(), budget, opt.tma_chunk, m.pipes);
      std::exit(2);
    }
    if (opt.tma_lag >= 0) lag = opt.tma_lag;
    else lag = (m.kind == Kind::PushTma) ? stages - 2 : 2;
    lag = std::max(1, std::min({lag, stages - 1, 15}));
    smem = (size_t)m.pipes * stages * (opt.tma_chunk + 8);
  }

  int threads_for(const Mode& m) const {
    if (m.kind == Kind::PushTma || m.kind == Kind::PullTma) return 32 * m.pipes;
    if (m.kind == Kind::CopyEngine) return 0;
    return opt.threads;
  }

  std::string detail_for(const Mode& m) const {
    if (m.kind == Kind::PushTma || m.kind == Kind::PullTma) {
      int stages, lag;
      size_t smem;
      tma_geometry(m, stages, lag, smem);
      char buf[128];
      snprintf(buf, sizeof(buf), "pipes=%d stages=%d chunk=%llu lag=%d smem=%zu", m.pipes, stages,
               opt.tma_chunk, lag, smem);
      return buf;
    }
    if (m.kind == Kind::PushSt || m.kind == Kind::PullLd)
      return "U=" + std::to_string(m.unroll) + " bytes_in_flight/thread=" +
             std::to_string(16 * m.unroll);
    return "streams=" + std::to_string(G - 1) + "/gpu";
  }

  static void (*ldst_kernel(const Mode& m))(A2A) {
    const bool push = m.kind == Kind::PushSt;
    if (m.unroll == 4) return push ? push_st_kernel<4> : pull_ld_kernel<4>;
    if (m.unroll == 8) return push ? push_st_kernel<8> : pull_ld_kernel<8>;
    return push ? push_st_kernel<16> : pull_ld_kernel<16>;
  }

  // Largest block the kernel of this mode can be launched with (registers).
  int max_threads(const Mode& m) const {
    if (m.kind != Kind::PushSt && m.kind != Kind::PullLd) return 1024;
    cudaFuncAttributes attr;
    CK(cudaFuncGetAttributes(&attr, (const void*)ldst_kernel(m)));
    return attr.maxThreadsPerBlock;
  }

  // Enqueue one all-to-all on GPU i's stream (events around it).
  void launch(const Mode& m, int i, int sms) {
    Gpu& g = gpu[i];
    CK(cudaSetDevice(i));
    CK(cudaEventRecord(g.ev_start, g.stream));
    const A2A& a = args[i];
    // For SM load/store kernels, ask for just over half an SM's smem so two
    // blocks can never share an SM: grid = SM count really is one block per SM.
    const size_t pin_smem = std::min(smem_optin, smem_per_sm / 2 + 1024);
    switch (m.kind) {
      case Kind::PushSt:
      case Kind::PullLd:
        ldst_kernel(m)<<<sms, opt.threads, pin_smem, g.stream>>>(a);
        break;
      case Kind::PushTma:
      case Kind::PullTma: {
        int stages, lag;
        size_t smem;
        tma_geometry(m, stages, lag, smem);
        auto k = (m.kind == Kind::PushTma) ? push_tma_kernel : pull_tma_kernel;
        k<<<sms, 32 * m.pipes, smem, g.stream>>>(a, stages, (uint32_t)opt.tma_chunk, lag);
        break;
      }
      case Kind::CopyEngine: {
        // Fork: every pair stream waits for ev_start; join: g.stream waits for all.
        const unsigned long long B = opt.bytes_per_peer;
        for (int j = 0; j < G; ++j) {
          if (j == i) continue;
          CK(cudaStreamWaitEvent(g.pair_stream[j], g.ev_start, 0));
          CK(cudaMemcpyPeerAsync(gpu[j].dst + i * B, j, g.src + j * B, i, B, g.pair_stream[j]));
          CK(cudaEventRecord(g.pair_done[j], g.pair_stream[j]));
          CK(cudaStreamWaitEvent(g.stream, g.pair_done[j], 0));
        }
        break;
      }
    }
    CK(cudaGetLastError());
    CK(cudaEventRecord(g.ev_stop, g.stream));
  }

  // One timed all-to-all: launch on every GPU, then wait for every GPU.
  void run_once(const Mode& m, int sms, double& host_us, double& event_us) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < G; ++i) launch(m, i, sms);
    for (int i = 0; i < G; ++i) {
      CK(cudaSetDevice(i));
      CK(cudaEventSynchronize(gpu[i].ev_stop));
    }
    const auto t1 = std::chrono::steady_clock::now();
    host_us = std::chrono::duration<double, std::micro>(t1 - t0).count();
    event_us = 0;
    for (int i = 0; i < G; ++i) {
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, gpu[i].ev_start, gpu[i].ev_stop));
      event_us = std::max(event_us, 1e3 * ms);
    }
  }

  // Host-side sample check plus a full on-device count of bad words.
  // quiet: report nothing (used by the checker's self-test).
  bool verify(const std::string& label, bool quiet = false) {
    const unsigned long long B = opt.bytes_per_peer, vpc = B / 16;
    bool ok = true;
    for (int i = 0; i < G; ++i) {
      Gpu& g = gpu[i];
      CK(cudaSetDevice(i));
      const int ns = (int)g.sample_idx.size();
      CK(cudaMemset(g.d_bad, 0, sizeof(unsigned long long)));
      gather_kernel<<<(ns + 255) / 256, 256>>>(reinterpret_cast<const uint4*>(g.dst),
                                               g.d_sample_idx, g.d_sample_out, ns);
      CK(cudaGetLastError());
      check_kernel<<<4 * g.sms, 256>>>(reinterpret_cast<const uint4*>(g.dst), i, G, B, g.d_bad);
      CK(cudaGetLastError());
      std::vector<uint4> got(ns);
      unsigned long long dev_bad = 0;
      CK(cudaMemcpy(got.data(), g.d_sample_out, ns * sizeof(uint4), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(&dev_bad, g.d_bad, sizeof(dev_bad), cudaMemcpyDeviceToHost));
      int host_bad = 0;
      for (int k = 0; k < ns; ++k) {
        const unsigned long long v = g.sample_idx[k];
        const int j = (int)(v / vpc);
        const unsigned long long w = i * (B / 4) + (v - j * vpc) * 4;
        const uint32_t e[4] = {pattern(j, w), pattern(j, w + 1), pattern(j, w + 2),
                               pattern(j, w + 3)};
        const uint32_t x[4] = {got[k].x, got[k].y, got[k].z, got[k].w};
        for (int t = 0; t < 4; ++t) {
          if (x[t] == e[t]) continue;
          if (host_bad < 3 && !quiet)
            fprintf(stderr, "FAIL %s: GPU %d dst chunk %d byte %llu: got 0x%08x want 0x%08x\n",
                    label.c_str(), i, j, (v - j * vpc) * 16 + 4 * t, x[t], e[t]);
          ++host_bad;
        }
      }
      // Every sampled and every scanned word must match.
      if (host_bad || dev_bad) {
        if (!quiet)
          fprintf(stderr, "FAIL %s: GPU %d: %d bad sampled words, %llu bad words in full scan\n",
                  label.c_str(), i, host_bad, dev_bad);
        ok = false;
      }
    }
    return ok;
  }

  Row measure(const Mode& m, int sms) {
    clear_dst();
    double h, e;
    for (int r = 0; r < opt.warmup; ++r) run_once(m, sms, h, e);
    std::vector<double> hs, es;
    for (int r = 0; r < opt.reps; ++r) {
      run_once(m, sms, h, e);
      hs.push_back(h);
      es.push_back(e);
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      const size_t n = v.size();
      return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    };
    Row row;
    row.mode = m.name;
    row.detail = detail_for(m);
    row.sms = sms;
    row.threads = threads_for(m);
    row.host_us = median(hs);
    row.event_us = median(es);
    const double egress = (double)(G - 1) * opt.bytes_per_peer;
    row.gbps_host = egress / (row.host_us * 1e-6) / 1e9;
    row.gbps_event = egress / (row.event_us * 1e-6) / 1e9;
    row.ok = verify(m.name + (sms ? " sms=" + std::to_string(sms) : std::string()));
    return row;
  }
};

static void write_json(const std::string& path, const Bench& b, const std::string& device,
                       const std::vector<Row>& rows) {
  FILE* f = fopen(path.c_str(), "w");
  if (!f) {
    fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(2);
  }
  fprintf(f, "{\n  \"gpus\": %d,\n  \"device\": \"%s\",\n  \"bytes_per_peer\": %llu,\n", b.G,
          device.c_str(), b.opt.bytes_per_peer);
  fprintf(f, "  \"reps\": %d,\n  \"warmup\": %d,\n  \"rows\": [\n", b.opt.reps, b.opt.warmup);
  for (size_t k = 0; k < rows.size(); ++k) {
    const Row& r = rows[k];
    fprintf(f,
            "    {\"mode\": \"%s\", \"sms\": %s, \"threads\": %d, \"host_us\": %.2f, "
            "\"event_us\": %.2f, \"gbps\": %.2f, \"gbps_event\": %.2f, \"check\": \"%s\", "
            "\"detail\": \"%s\"}%s\n",
            r.mode.c_str(), r.sms ? std::to_string(r.sms).c_str() : "null", r.threads, r.host_us,
            r.event_us, r.gbps_host, r.gbps_event, r.ok ? "OK" : "FAIL", r.detail.c_str(),
            k + 1 < rows.size() ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  fclose(f);
}

int main(int argc, char** argv) {
  Bench b;
  b.opt = parse_args(argc, argv);

  std::vector<Mode> modes;
  const std::vector<Mode> known = all_modes();
  if (b.opt.modes.empty()) modes = known;
  for (const std::string& name : b.opt.modes) {
    auto it = std::find_if(known.begin(), known.end(), [&](const Mode& m) { return m.name == name; });
    if (it == known.end()) usage_exit(("unknown mode " + name).c_str());
    modes.push_back(*it);
  }

  b.setup();
  // Checker self-test: dst is all zeros now, so the check must fail.
  if (b.verify("self-test", true)) {
    fprintf(stderr, "checker self-test failed: an all-zero dst passed the check\n");
    return 2;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("nvlink_probe: %d GPUs (%s, %d SMs), bytes per peer %llu (%.2f MiB), egress per GPU "
         "%.2f MiB, reps %d, warmup %d\n",
         b.G, prop.name, prop.multiProcessorCount, b.opt.bytes_per_peer,
         b.opt.bytes_per_peer / 1048576.0, (b.G - 1) * b.opt.bytes_per_peer / 1048576.0,
         b.opt.reps, b.opt.warmup);
  printf("GB/s = (G-1)*B / median time (host: launch all + sync all; event: max over GPUs)\n\n");
  printf("%-12s %5s %7s %11s %11s %9s %9s %5s  %s\n", "mode", "sms", "threads", "host_us",
         "event_us", "GB/s", "GB/s_ev", "check", "detail");
  fflush(stdout);

  std::vector<Row> rows;
  bool all_ok = true;
  for (const Mode& m : modes) {
    std::vector<int> sms_list = b.opt.sms;
    if (m.kind == Kind::CopyEngine) sms_list = {0};  // SM count does not apply
    for (int sms : sms_list) {
      if (sms < 0 || sms > prop.multiProcessorCount) {
        printf("%-12s %5d skipped (GPU has %d SMs)\n", m.name.c_str(), sms,
               prop.multiProcessorCount);
        continue;
      }
      if (sms == 0 && m.kind != Kind::CopyEngine) continue;
      if (b.threads_for(m) > b.max_threads(m)) {
        printf("%-12s %5d skipped (%d threads > kernel limit %d)\n", m.name.c_str(), sms,
               b.threads_for(m), b.max_threads(m));
        continue;
      }
      const Row r = b.measure(m, sms);
      all_ok = all_ok && r.ok;
      rows.push_back(r);
      printf("%-12s %5s %7d %11.1f %11.1f %9.1f %9.1f %5s  %s\n", r.mode.c_str(),
             r.sms ? std::to_string(r.sms).c_str() : "-", r.threads, r.host_us, r.event_us,
             r.gbps_host, r.gbps_event, r.ok ? "OK" : "FAIL", r.detail.c_str());
      fflush(stdout);
    }
  }
  if (!b.opt.json.empty()) write_json(b.opt.json, b, prop.name, rows);
  if (!all_ok) printf("\nsome checks FAILED\n");
  return all_ok ? 0 : 1;
}
