// A caching CPU allocator for PyTorch: the large blocks one training step frees serve the next step's
// requests with their pages still resident, while the memory held for them never exceeds the most that
// was alive at once.
//
// Why: a training step frees and re-allocates the same activations. glibc either returns each large
// block to the OS (every re-allocation then page-faults in fresh zeroed pages: ~5 s a step on bench_vs_hf's
// model) or keeps it in a heap that fragments (+35-65% RSS). CUDA's caching allocator answers the same
// problem on GPUs; this is the CPU's, kept small.
//
// How a request of n bytes (rounded to whole pages) is served:
//   1. a cached block of exactly that size: taken as it is (a hit);
//   2. else, while the budget below has room for it, a fresh anonymous mapping (a miss), so the cached
//      blocks stay whole for the requests of their own sizes;
//   3. else a cached block of another size, resized in place with mremap (a resize): the smallest one at
//      least as large (its tail is unmapped), else the largest one (only the growth is new pages);
//   4. else (nothing cached) a fresh mapping.
// The rule that keeps RSS honest: `budget` is the peak of live bytes since the last reset. Bytes mapped
// (live + cached) stay within max(budget, live + request): before anything grows, the oldest cached blocks
// are unmapped until it fits. So the high-water mark is what returning every block at once would reach,
// and the cache only fills the room below it.
//
// Blocks under `min_block_bytes` go to the allocator this one replaced (glibc's small-block heap). Large
// blocks of 2 MiB or more are 2 MiB-aligned and advised into transparent huge pages when
// THP_MEM_ALLOC_ENABLE=1, as PyTorch's own allocator does. torch.profiler is told of live tensor bytes only,
// as with CUDA's caching allocator: cached blocks are reserved, not allocated.
//
// Built by megalite/caching_cpu_allocator.py with c10's headers only; driven through ctypes.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = 2 << 20;

size_t round_to_page(size_t n) { return (n + kPage - 1) / kPage * kPage; }

bool huge_pages_wanted() {
  const char* value = std::getenv("THP_MEM_ALLOC_ENABLE");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

void advise_huge_pages(void* ptr, size_t bytes, bool huge_pages) {
#ifdef MADV_HUGEPAGE
  if (huge_pages && bytes >= kHugePage) madvise(ptr, bytes, MADV_HUGEPAGE);
#endif
}

// A fresh anonymous mapping; 2 MiB-aligned when huge pages are wanted (map 2 MiB more, trim both ends).
void* map_block(size_t bytes, bool huge_pages) {
  const bool align = huge_pages && bytes >= kHugePage;
  const size_t span = align ? bytes + kHugePage : bytes;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  if (!align) return raw;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) munmap(raw, aligned - start);
  const size_t tail = start + span - (aligned + bytes);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  void* ptr = reinterpret_cast<void*>(aligned);
  advise_huge_pages(ptr, bytes, huge_pages);
  return ptr;
}

// The same pages under a new size: a shrink unmaps the tail; a growth may move the block (its resident
// pages move with it) and only the new part faults. nullptr when the kernel refuses.
void* resize_block(void* ptr, size_t old_bytes, size_t new_bytes, bool huge_pages) {
  if (new_bytes < old_bytes) {
    munmap(static_cast<char*>(ptr) + new_bytes, old_bytes - new_bytes);
    return ptr;
  }
  void* moved = mremap(ptr, old_bytes, new_bytes, MREMAP_MAYMOVE);
  if (moved == MAP_FAILED) return nullptr;
  advise_huge_pages(moved, new_bytes, huge_pages);
  return moved;
}

struct Block {
  void* ptr;
  size_t bytes;
};

struct Stats {
  int64_t live_bytes, cached_bytes, budget_bytes, hits, resizes, misses, released;
};

void delete_cached(void* ptr);

class CachingCPUAllocator final : public c10::Allocator {
 public:
  CachingCPUAllocator(c10::Allocator* underlying, size_t min_block_bytes)
      : underlying_(underlying), min_block_bytes_(min_block_bytes), huge_pages_(huge_pages_wanted()) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < min_block_bytes_) return underlying_->allocate(n);
    const size_t bytes = round_to_page(n);
    std::lock_guard<std::mutex> guard(mutex_);
    void* ptr = take_or_map(bytes);
    if (ptr == nullptr) {
      c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(bytes), live_bytes_, live_bytes_ + cached_bytes_,
                                       c10::Device(c10::DeviceType::CPU));
      TORCH_CHECK_WITH(OutOfMemoryError, false, "megalite's caching CPU allocator: out of memory allocating ",
                       bytes, " bytes (", live_bytes_, " live, ", cached_bytes_, " cached)");
    }
    live_bytes_ += bytes;
    budget_bytes_ = std::max(budget_bytes_, live_bytes_);
    live_.emplace(ptr, bytes);
    report(ptr, static_cast<int64_t>(bytes));
    return {ptr, ptr, &delete_cached, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_cached; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Called by every DataPtr this allocator made; a pointer it did not make came from raw_allocate's
  // small-block path and belongs to the replaced allocator.
  void free(void* ptr) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = live_.find(ptr);
    if (it == live_.end()) {
      underlying_->raw_deallocate(ptr);
      return;
    }
    const size_t bytes = it->second;
    live_.erase(it);
    live_bytes_ -= bytes;
    cached_bytes_ += bytes;
    cached_.push_back(Block{ptr, bytes});
    report(ptr, -static_cast<int64_t>(bytes));
  }

  // Unmap every cached block and restart the budget from what is alive now (a measuring window's start).
  void empty_cache() {
    std::lock_guard<std::mutex> guard(mutex_);
    while (!cached_.empty()) release_oldest();
    budget_bytes_ = live_bytes_;
  }

  // fork() copies the lock as it is: hold it across the fork so a child (a data-loader worker) never
  // starts with it taken by a thread that does not exist there.
  void lock_for_fork() { mutex_.lock(); }
  void unlock_after_fork() { mutex_.unlock(); }

  Stats stats() {
    std::lock_guard<std::mutex> guard(mutex_);
    return {static_cast<int64_t>(live_bytes_), static_cast<int64_t>(cached_bytes_),
            static_cast<int64_t>(budget_bytes_), hits_, resizes_, misses_, released_};
  }

 private:
  void* take_or_map(size_t bytes) {
    auto exact = cached_.end(), above = cached_.end(), below = cached_.end();
    for (auto it = cached_.begin(); it != cached_.end(); ++it) {   // later entries: freed more recently
      if (it->bytes == bytes) exact = it;
      else if (it->bytes > bytes && (above == cached_.end() || it->bytes <= above->bytes)) above = it;
      else if (it->bytes < bytes && (below == cached_.end() || it->bytes >= below->bytes)) below = it;
    }
    if (exact != cached_.end()) {
      ++hits_;
      return take(exact);
    }
    const bool room_to_map = live_bytes_ + cached_bytes_ + bytes <= budget_bytes_;
    const auto pick = above != cached_.end() ? above : below;
    if (pick != cached_.end() && !room_to_map) {
      const size_t old_bytes = pick->bytes;
      void* ptr = take(pick);              // counted as `bytes` from here on: make room for the growth
      release_until_fits(bytes);
      void* resized = resize_block(ptr, old_bytes, bytes, huge_pages_);
      if (resized != nullptr) {
        ++resizes_;
        return resized;
      }
      munmap(ptr, old_bytes);
      ++released_;
    } else {
      release_until_fits(bytes);
    }
    ++misses_;
    return map_block(bytes, huge_pages_);
  }

  void* take(std::list<Block>::iterator it) {
    void* ptr = it->ptr;
    cached_bytes_ -= it->bytes;
    cached_.erase(it);
    return ptr;
  }

  // Unmap the oldest cached blocks until mapping `bytes` more stays within the budget.
  void release_until_fits(size_t bytes) {
    const size_t limit = std::max(budget_bytes_, live_bytes_ + bytes);
    while (!cached_.empty() && live_bytes_ + cached_bytes_ + bytes > limit) release_oldest();
  }

  void release_oldest() {
    munmap(cached_.front().ptr, cached_.front().bytes);
    cached_bytes_ -= cached_.front().bytes;
    cached_.pop_front();
    ++released_;
  }

  void report(void* ptr, int64_t delta) {
    if (c10::memoryProfilingEnabled())
      c10::reportMemoryUsageToProfiler(ptr, delta, live_bytes_, live_bytes_ + cached_bytes_,
                                       c10::Device(c10::DeviceType::CPU));
  }

  c10::Allocator* underlying_;
  const size_t min_block_bytes_;
  const bool huge_pages_;
  std::mutex mutex_;
  std::unordered_map<void*, size_t> live_;  // pointer -> bytes
  std::list<Block> cached_;                 // oldest freed first
  size_t live_bytes_ = 0, cached_bytes_ = 0, budget_bytes_ = 0;
  int64_t hits_ = 0, resizes_ = 0, misses_ = 0, released_ = 0;
};

CachingCPUAllocator* g_allocator = nullptr;  // never destroyed: tensors may outlive static destruction

void delete_cached(void* ptr) { g_allocator->free(ptr); }

void before_fork() { g_allocator->lock_for_fork(); }
void after_fork() { g_allocator->unlock_after_fork(); }

}  // namespace

extern "C" {

// Installs the allocator for every later CPU allocation; returns 1 if it was already installed.
int megalite_cpu_cache_install(int64_t min_block_bytes) {
  if (g_allocator != nullptr) return 1;
  g_allocator = new CachingCPUAllocator(c10::GetCPUAllocator(), static_cast<size_t>(min_block_bytes));
  pthread_atfork(&before_fork, &after_fork, &after_fork);
  c10::SetCPUAllocator(g_allocator, /*priority=*/1);
  return 0;
}

void megalite_cpu_cache_empty() {
  if (g_allocator != nullptr) g_allocator->empty_cache();
}

// live, cached, budget bytes; hits, resizes, misses, released blocks (zeros before install).
void megalite_cpu_cache_stats(int64_t* out) {
  Stats s{0, 0, 0, 0, 0, 0, 0};
  if (g_allocator != nullptr) s = g_allocator->stats();
  const int64_t values[] = {s.live_bytes, s.cached_bytes, s.budget_bytes, s.hits,
                            s.resizes, s.misses, s.released};
  std::copy(values, values + 7, out);
}

}  // extern "C"
