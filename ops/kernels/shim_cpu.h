// CPU shim: lets a C++ compiler build the CUDA kernel sources in this folder.
//
// [Note: one source, two targets]
// Every kernel keeps its math in __device__ functions. nvcc/NVRTC compile the
// __global__ grid-stride kernels; g++ compiles the same text with this shim
// prepended, which (1) turns the CUDA qualifiers into plain C++, (2) provides
// threadIdx/blockIdx/blockDim/gridDim as thread-locals, and (3) emulates
// __syncthreads, full-warp shuffles and integer atomicAdd so that a __global__ kernel can be run
// on the CPU exactly as launched, one block at a time, its CUDA threads fibers
// (or OS threads: ZS_EMULATE_OS_THREADS; see zs_emulate_launch below). The
// fast CPU drivers (`*_host` entry points) call the same __device__ functions
// from OpenMP loops.
#pragma once
#define ZS_CPU 1
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstddef>
#include <omp.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)

struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

static thread_local uint3 threadIdx = {0, 0, 0};
static thread_local uint3 blockIdx = {0, 0, 0};
static thread_local dim3 blockDim(1, 1, 1);
static thread_local dim3 gridDim(1, 1, 1);

static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
using std::sqrt;

#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// How a block's CUDA threads are emulated. By default they are fibers on the
// launching thread (ucontext): each runs until it waits at a barrier or a
// shuffle, and the next one runs; a barrier lets its fibers on once all have
// arrived. That is a valid CUDA interleaving and needs no OS scheduler, so a
// block of 256 threads costs a few hundred context switches per barrier
// rather than 256 OS threads woken on two cores. A kernel family whose source
// has no barrier and no shuffle (ZS_FAMILY_SYNCS 0) runs its threads one after
// another, with no fibers at all. With ZS_EMULATE_OS_THREADS every CUDA thread
// is an OS thread instead, so that ThreadSanitizer sees a missing
// __syncthreads() as the data race it is (tests/test_kernel_races.py).
#ifndef ZS_FAMILY_SYNCS
#define ZS_FAMILY_SYNCS 1
#endif

static thread_local unsigned zs_tid = 0;
static thread_local int zs_bad_mask = 0;
static int zs_unsynced = 0;  // a barrier or shuffle in a launch run without them

#ifdef ZS_EMULATE_OS_THREADS
#include <barrier>
#include <thread>
using ZsBarrier = std::barrier<>;
#else
#include <ucontext.h>
struct ZsFiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  bool done = true;
};
static constexpr size_t ZS_FIBER_STACK = 128 * 1024;
static ucontext_t zs_scheduler;
static ZsFiber* zs_running = nullptr;
static int zs_progress = 0;  // a fiber arrived at a barrier or finished in this pass
static inline void zs_yield() { swapcontext(&zs_running->ctx, &zs_scheduler); }
struct ZsBarrier {
  unsigned expected, arrived = 0, generation = 0;
  explicit ZsBarrier(unsigned n) : expected(n) {}
  void arrive_and_wait() {
    unsigned g = generation;
    zs_progress = 1;
    if (++arrived == expected) {
      arrived = 0;
      ++generation;
      return;
    }
    while (generation == g) zs_yield();
  }
};
#endif

// __shared__ variables are function-local statics: one copy shared by every
// emulated thread, which is right because blocks run one at a time.
#define __shared__ static

struct ZsBlockSync {
  ZsBarrier block;
  std::vector<std::unique_ptr<ZsBarrier>> warps;
  std::vector<uint64_t> lanes;  // one 8-byte exchange slot per thread
  ZsBlockSync(unsigned nthreads)
      : block(nthreads), lanes(nthreads) {
    for (unsigned w = 0; w * 32 < nthreads; ++w) {
      unsigned n = nthreads - w * 32 < 32 ? nthreads - w * 32 : 32;
      warps.emplace_back(new ZsBarrier(n));
    }
  }
};
static ZsBlockSync* zs_sync = nullptr;

static inline void __syncthreads() {
  if (!zs_sync) { zs_unsynced = 1; return; }
  zs_sync->block.arrive_and_wait();
}

template <typename T, typename F>
static inline T zs_shfl(unsigned mask, T v, F src_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  if (!zs_sync) { zs_unsynced = 1; return v; }
  if (mask != 0xffffffffu) zs_bad_mask = 1;  // partial masks are not emulated
  unsigned warp = zs_tid / 32, lane = zs_tid % 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  zs_sync->lanes[zs_tid] = bits;
  zs_sync->warps[warp]->arrive_and_wait();
  unsigned src = src_lane(lane);
  unsigned warp_size = zs_sync->lanes.size() - warp * 32;
  if (warp_size > 32) warp_size = 32;
  T r = v;
  if (src < warp_size) std::memcpy(&r, &zs_sync->lanes[warp * 32 + src], sizeof(T));
  zs_sync->warps[warp]->arrive_and_wait();
  return r;
}
template <typename T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
  return zs_shfl(mask, v, [delta](unsigned lane) { return lane + delta; });
}
template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, unsigned m) {
  return zs_shfl(mask, v, [m](unsigned lane) { return lane ^ m; });
}

// Integer atomics on memory the emulated threads share (__shared__ or global).
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

template <typename... A, size_t... I>
static void zs_call(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

// Every block of the grid in order, blockIdx set; `f` returns false to stop.
template <typename F>
static inline void zs_each_block(dim3 grid, F f) {
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = {bx, by, bz};
        if (!f()) return;
      }
}

static inline void zs_place(unsigned t, dim3 block) {
  zs_tid = t;
  threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
}

// Runs kernel `k` with CUDA launch semantics: every block of the grid in turn,
// each with blockDim CUDA threads (see above). `args` is laid out as
// cuLaunchKernel's kernelParams: one pointer to each argument's value. Returns
// 0; 1 when the kernel used a partial-mask shuffle, which is not emulated; 2
// when a block's threads stopped at a barrier that not all of them reach
// (a hang on a GPU); 3 when a family counted as free of barriers and
// shuffles used one.
#ifdef ZS_EMULATE_OS_THREADS
template <typename... A>
static int zs_emulate_launch(void (*k)(A...), dim3 grid, dim3 block, void** args, bool) {
  static std::mutex one_launch_at_a_time;
  std::lock_guard<std::mutex> guard(one_launch_at_a_time);
  unsigned nthreads = block.x * block.y * block.z;
  ZsBlockSync sync(nthreads);
  zs_sync = &sync;
  std::barrier<> between_blocks(nthreads);
  int bad = 0;
  std::mutex bad_lock;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      zs_place(t, block);
      blockDim = block;
      gridDim = grid;
      zs_each_block(grid, [&] {
        zs_call(k, args, std::index_sequence_for<A...>{});
        between_blocks.arrive_and_wait();
        return true;
      });
      if (zs_bad_mask) { std::lock_guard<std::mutex> g(bad_lock); bad = 1; }
    });
  }
  for (auto& th : threads) th.join();
  zs_sync = nullptr;
  return bad;
}
#else
static void (*zs_fiber_body)() = nullptr;
static void zs_fiber_main() {
  zs_fiber_body();
  zs_running->done = true;  // back to the scheduler through uc_link
}

template <typename... A>
static int zs_emulate_launch(void (*k)(A...), dim3 grid, dim3 block, void** args, bool syncs) {
  static std::mutex one_launch_at_a_time;
  std::lock_guard<std::mutex> guard(one_launch_at_a_time);
  unsigned nthreads = block.x * block.y * block.z;
  blockDim = block;
  gridDim = grid;
  zs_bad_mask = 0;
  zs_unsynced = 0;
  if (!syncs) {  // no barrier or shuffle in the family: each thread runs to its end
    zs_each_block(grid, [&] {
      for (unsigned t = 0; t < nthreads; ++t) {
        zs_place(t, block);
        zs_call(k, args, std::index_sequence_for<A...>{});
      }
      return true;
    });
    return zs_unsynced ? 3 : 0;
  }
  static std::vector<ZsFiber> fibers;
  if (fibers.size() < nthreads) fibers.resize(nthreads);
  for (unsigned t = 0; t < nthreads; ++t)
    if (!fibers[t].stack) fibers[t].stack.reset(new char[ZS_FIBER_STACK]);
  static void (*kernel)(A...);
  static void** kernel_args;
  kernel = k;
  kernel_args = args;
  zs_fiber_body = [] { zs_call(kernel, kernel_args, std::index_sequence_for<A...>{}); };
  ZsBlockSync sync(nthreads);
  zs_sync = &sync;
  int status = 0;
  zs_each_block(grid, [&] {
    for (unsigned t = 0; t < nthreads; ++t) {
      ZsFiber& f = fibers[t];
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.get();
      f.ctx.uc_stack.ss_size = ZS_FIBER_STACK;
      f.ctx.uc_link = &zs_scheduler;
      makecontext(&f.ctx, zs_fiber_main, 0);
      f.done = false;
    }
    unsigned live = nthreads;
    while (live) {
      zs_progress = 0;
      for (unsigned t = 0; t < nthreads; ++t) {
        if (fibers[t].done) continue;
        zs_running = &fibers[t];
        zs_place(t, block);
        swapcontext(&zs_scheduler, &fibers[t].ctx);
        if (fibers[t].done) {
          --live;
          zs_progress = 1;
        }
      }
      if (live && !zs_progress) {  // every live thread waits on the others
        status = 2;
        return false;
      }
    }
    return true;
  });
  zs_sync = nullptr;
  zs_running = nullptr;
  if (status) return status;
  return zs_bad_mask ? 1 : 0;
}
#endif

#define ZS_EMULATE(name)                                                      \
  extern "C" int zs_emu_##name(const unsigned* grid, const unsigned* block,   \
                               void** args) {                                 \
    return zs_emulate_launch(name, dim3(grid[0], grid[1], grid[2]),           \
                             dim3(block[0], block[1], block[2]), args,        \
                             ZS_FAMILY_SYNCS);                                \
  }
