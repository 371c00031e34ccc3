//! The process's allocator: glibc's `malloc`, with a larger per-thread cache of freed
//! blocks in front of it (Envoy links tcmalloc for the same reason).
//!
//! glibc's own per-thread cache (tcache) keeps 7 blocks of each size, and none over
//! 1 KiB. An HTTP request in flight holds a dozen blocks (its ~10 KiB future, its log
//! slot, header values, the h2 stream's task), and 100 of them are in flight under the
//! h2 bench: tcache runs dry, and each `malloc` and `free` goes to glibc's bins (about
//! 300 instructions each, `callgrind`), in memory the cache would have kept warm. Here
//! each worker thread keeps up to [`MAX_BLOCKS`] freed blocks per size class up to
//! 16 KiB, [`MAX_BYTES`] in all, for layouts aligned up to 16 bytes (`malloc`'s) and up
//! to 128 (tokio's tasks); the rest goes to glibc as before. Only the threads that carry
//! traffic cache ([`cache_this_thread`]), from the end of their start-up, and a cache is
//! handed back before `malloc_trim` ([`release_this_thread`]): a first version that
//! cached everywhere kept start-up's frees, scattered over the heap, and 7 MiB more RSS
//! at rest. mimalloc and jemalloc were measured too (see git history): faster on
//! HTTP/1.1, at 1.7x-1.9x the RSS.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::ptr;

/// Sizes up to this are kept in classes [`SMALL_STEP`] bytes apart, each the most a
/// glibc chunk of its size holds (see [`class_size`]).
const MAX_SMALL: usize = 1024;
const SMALL_STEP: usize = 16;
/// The smallest glibc chunk (32 bytes) holds 24: its size word takes 8.
const SMALLEST: usize = 24;
/// Sizes up to this (the request's future is about 10 KiB) in classes [`LARGE_STEP`]
/// apart: a block is at most a quarter larger than asked.
const MAX_CACHED: usize = 16 * 1024;
const LARGE_STEP: usize = 256;
/// The small classes hold 24, 40, .., 1032 bytes.
const SMALL_CLASSES: usize = (MAX_SMALL - SMALLEST).div_ceil(SMALL_STEP) + 1;
const CLASSES: usize = SMALL_CLASSES + (MAX_CACHED - MAX_SMALL) / LARGE_STEP;
/// glibc's `malloc` aligns every block to 16 bytes. Layouts asking for more, up to
/// [`WIDE_ALIGN`] (a tokio task is cache-line padded to 128), have classes of their
/// own, allocated with `posix_memalign`; wider ones bypass the cache.
const MALLOC_ALIGN: usize = 16;
const WIDE_ALIGN: usize = 128;
/// Freed blocks one thread keeps per class, and in all.
pub const MAX_BLOCKS: u32 = 512;
pub const MAX_BYTES: usize = 2 << 20;

/// The global allocator (`#[global_allocator]` in `main.rs`).
pub struct CachingMalloc;

/// The size class of a `size`-byte block, if blocks of that size are cached.
fn class(size: usize) -> Option<usize> {
    if size <= MAX_SMALL {
        Some(size.saturating_sub(SMALLEST).div_ceil(SMALL_STEP))
    } else if size <= MAX_CACHED {
        Some(SMALL_CLASSES + (size - MAX_SMALL - 1) / LARGE_STEP)
    } else {
        None
    }
}

/// What a block of class `class` holds: every block of a class is allocated this size,
/// so any of them serves any size of the class. A small class is what a glibc chunk
/// holds (16n bytes, 8 of them its size word): a block costs the chunk `malloc` would
/// have given its size anyway. Classes of multiples of 16 took a chunk 16 bytes larger
/// for half of all sizes (a 24-byte `Arc<str>` in a 48-byte chunk, not 32): 0.8 KiB per
/// service of a sidecar's config.
fn class_size(class: usize) -> usize {
    if class < SMALL_CLASSES {
        SMALLEST + class * SMALL_STEP
    } else {
        MAX_SMALL + (class - SMALL_CLASSES + 1) * LARGE_STEP
    }
}

/// Where blocks of `layout` are cached: its class, offset by [`CLASSES`] for the
/// wide-aligned ones.
fn cached_class(layout: Layout) -> Option<usize> {
    let class = class(layout.size())?;
    if layout.align() <= MALLOC_ALIGN {
        Some(class)
    } else if layout.align() <= WIDE_ALIGN {
        Some(CLASSES + class)
    } else {
        None
    }
}

/// A fresh block for cache slot `slot`.
fn fresh(slot: usize) -> *mut u8 {
    if slot < CLASSES {
        // SAFETY: plain `malloc`; the size is never 0.
        return unsafe { libc::malloc(class_size(slot)).cast() };
    }
    let mut block = ptr::null_mut();
    // SAFETY: a power-of-two alignment that is a multiple of the pointer size.
    match unsafe { libc::posix_memalign(&mut block, WIDE_ALIGN, class_size(slot - CLASSES)) } {
        0 => block.cast(),
        _ => ptr::null_mut(),
    }
}

/// A freed block, linked through its first word.
struct Free {
    next: *mut Free,
}

/// Cache slots: the classes of 16-byte aligned blocks, then the wide-aligned ones.
const SLOTS: usize = 2 * CLASSES;

/// One thread's freed blocks, a stack per slot (the last freed is the warmest).
struct ThreadCache {
    heads: [*mut Free; SLOTS],
    counts: [u32; SLOTS],
    bytes: usize,
    /// Set by [`cache_this_thread`]; until then blocks come from and go to glibc.
    enabled: bool,
}

impl ThreadCache {
    const fn new() -> Self {
        Self {
            heads: [ptr::null_mut(); SLOTS],
            counts: [0; SLOTS],
            bytes: 0,
            enabled: false,
        }
    }

    fn pop(&mut self, slot: usize) -> *mut u8 {
        let head = self.heads[slot];
        if !head.is_null() {
            // SAFETY: `head` is a block this cache took in `push`; its first word is the
            // link written there.
            self.heads[slot] = unsafe { (*head).next };
            self.counts[slot] -= 1;
            self.bytes -= class_size(slot % CLASSES);
        }
        head.cast()
    }

    /// Keeps `block` unless its slot is full; false hands it back to the caller. A
    /// cache over [`MAX_BYTES`] first gives the other slots' blocks back to glibc: what
    /// a thread freed at start-up (config parsing) must not keep its requests' blocks
    /// out for good.
    fn push(&mut self, slot: usize, block: *mut u8) -> bool {
        let size = class_size(slot % CLASSES);
        if !self.enabled || self.counts[slot] >= MAX_BLOCKS {
            return false;
        }
        if self.bytes + size > MAX_BYTES {
            self.release(|other| other != slot);
            if self.bytes + size > MAX_BYTES {
                return false;
            }
        }
        let block = block.cast::<Free>();
        // SAFETY: the block is freed (ours now), at least 16 bytes and 16-aligned.
        unsafe {
            block.write(Free {
                next: self.heads[slot],
            })
        };
        self.heads[slot] = block;
        self.counts[slot] += 1;
        self.bytes += size;
        true
    }

    /// Gives the blocks of the slots `which` picks back to glibc.
    fn release(&mut self, which: impl Fn(usize) -> bool) {
        for slot in (0..SLOTS).filter(|&slot| which(slot)) {
            loop {
                let block = self.pop(slot);
                if block.is_null() {
                    break;
                }
                // SAFETY: every cached block came from `malloc` or `posix_memalign`.
                unsafe { libc::free(block.cast()) };
            }
        }
    }
}

impl Drop for ThreadCache {
    /// A thread that ends gives its blocks back to glibc.
    fn drop(&mut self) {
        self.release(|_| true);
    }
}

thread_local! {
    // No lazy initialiser: the allocator must not allocate to reach its cache. Once
    // the thread's destructors have run, `try_with` fails and glibc is used directly.
    static CACHE: UnsafeCell<ThreadCache> = const { UnsafeCell::new(ThreadCache::new()) };
}

/// Caches the blocks this thread frees from now on: called by the threads that carry
/// traffic (the data plane's workers), once their start-up is done.
pub fn cache_this_thread() {
    with_cache(|cache| cache.enabled = true);
}

/// Gives this thread's cached blocks back to glibc, before `malloc_trim` hands free
/// pages to the kernel: a block left cached keeps its page resident (start-up's
/// descriptor pool, dropped on the worker, filled the cache with blocks scattered over
/// 6 MiB of heap).
pub fn release_this_thread() {
    with_cache(|cache| cache.release(|_| true));
}

fn with_cache<R>(f: impl FnOnce(&mut ThreadCache) -> R) -> Option<R> {
    // SAFETY: the cache is this thread's alone, and no call below re-enters it (glibc
    // is called outside of `f`).
    CACHE.try_with(|cache| f(unsafe { &mut *cache.get() })).ok()
}

// SAFETY: every block handed out is a `malloc` block at least as large as its layout
// and 16-aligned (or `System`'s, for other layouts); a block is in one place at a time:
// handed out, in one thread's cache, or freed to glibc.
unsafe impl GlobalAlloc for CachingMalloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(slot) = cached_class(layout) else {
            // SAFETY: the caller's layout, passed on.
            return unsafe { System.alloc(layout) };
        };
        match with_cache(|cache| cache.pop(slot)) {
            Some(block) if !block.is_null() => block,
            _ => fresh(slot),
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if cached_class(layout).is_none() {
            // SAFETY: the caller's layout, passed on.
            return unsafe { System.alloc_zeroed(layout) };
        }
        // SAFETY: as `alloc`; the block is at least `layout.size()` bytes.
        unsafe {
            let block = self.alloc(layout);
            if !block.is_null() {
                block.write_bytes(0, layout.size());
            }
            block
        }
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        let Some(slot) = cached_class(layout) else {
            // SAFETY: a block `System` gave out for this layout.
            return unsafe { System.dealloc(block, layout) };
        };
        if with_cache(|cache| cache.push(slot, block)) != Some(true) {
            // SAFETY: cached blocks come from `malloc`, `posix_memalign` or `realloc`.
            unsafe { libc::free(block.cast()) };
        }
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.align() > MALLOC_ALIGN {
            // `realloc` would not keep the alignment: a new block, copied (as `System`).
            // SAFETY: the new layout is valid (the caller's contract); each block is
            // used within its size.
            unsafe {
                let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
                let new = self.alloc(new_layout);
                if !new.is_null() {
                    ptr::copy_nonoverlapping(block, new, layout.size().min(new_size));
                    self.dealloc(block, layout);
                }
                return new;
            }
        }
        let (old, new) = (class(layout.size()), class(new_size));
        if old.is_some() && old == new {
            // The block already holds its whole class.
            return block;
        }
        // A block of a cached class must hold its class's size whoever frees it.
        let size = new.map_or(new_size, class_size);
        // SAFETY: every block of 16-byte alignment here came from `malloc`.
        unsafe { libc::realloc(block.cast(), size).cast() }
    }
}

/// Hands free heap back to the kernel when glibc holds at least `min_free` bytes
/// free: after a burst (many connections' buffers freed at once) glibc keeps the
/// pages in its per-thread arenas, and RSS stays at the burst's peak. Returns the
/// free bytes it saw when it trimmed.
pub fn trim_free_heap(min_free: usize) -> Option<usize> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads the allocator's own statistics.
        let free = unsafe { libc::mallinfo2() }.fordblks;
        if free >= min_free {
            trim_heap();
            return Some(free);
        }
    }
    let _ = min_free;
    None
}

/// Asked for by [`trim_soon`]: the next [`periodic_trim`] trims at
/// [`FREED_BY_REBUILD`] free.
static TRIM_WANTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How much free heap a [`periodic_trim`] after [`trim_soon`] returns at least.
pub const FREED_BY_REBUILD: usize = 1 << 20;

/// Asks the next [`periodic_trim`] to hand back even a little free heap: a config
/// rebuild freed what it decoded and the replaced config. Trimming in the rebuild
/// itself costs a walk of every arena (`mallinfo2`, `malloc_trim`) per rebuild: in
/// node mode, per pod and per push, on a heap of every pod's config.
pub fn trim_soon() {
    TRIM_WANTED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// The one periodic trim of a process: [`trim_free_heap`] at `min_free`, or at
/// [`FREED_BY_REBUILD`] when [`trim_soon`] asked since the last one.
pub fn periodic_trim(min_free: usize) -> Option<usize> {
    let wanted = TRIM_WANTED.swap(false, std::sync::atomic::Ordering::Relaxed);
    trim_free_heap(if wanted {
        min_free.min(FREED_BY_REBUILD)
    } else {
        min_free
    })
}

/// Returns free heap pages to the kernel (glibc keeps them otherwise), this thread's
/// cached blocks first.
pub fn trim_heap() {
    release_this_thread();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_size_maps_to_a_class_that_holds_it_in_the_chunk_malloc_would_take() {
        // The chunk glibc's `malloc(size)` takes.
        let chunk = |size: usize| (size + 8).next_multiple_of(16).max(32);
        for size in 1..=MAX_CACHED {
            let class = class(size).expect("cached");
            let held = class_size(class);
            assert!(held >= size, "{size} in class {class} of {held}");
            if size <= MAX_SMALL {
                assert_eq!(chunk(held), chunk(size), "{size}: {held}");
            } else {
                assert!(held <= size + size / 4, "{size}: {held}");
            }
            assert!(class < CLASSES);
        }
        assert_eq!(class(MAX_CACHED + 1), None);
        assert_eq!(class_size(CLASSES - 1), MAX_CACHED);
    }

    #[test]
    fn a_freed_block_is_handed_out_again_until_the_class_is_full() {
        cache_this_thread();
        let alloc = CachingMalloc;
        let layout = Layout::from_size_align(10_000, 8).unwrap();
        // SAFETY: blocks of `layout`, each freed once.
        unsafe {
            let first = alloc.alloc(layout);
            first.write_bytes(0xa5, layout.size());
            alloc.dealloc(first, layout);
            let again = alloc.alloc(layout);
            assert_eq!(again, first, "the warmest block comes back");
            // A class keeps at most MAX_BLOCKS: more frees go to glibc, and the cache's
            // accounting stays within its bounds.
            let blocks: Vec<_> = (0..MAX_BLOCKS + 8).map(|_| alloc.alloc(layout)).collect();
            for &block in &blocks {
                assert!(!block.is_null());
                block.write_bytes(0x5a, layout.size());
            }
            for block in blocks {
                alloc.dealloc(block, layout);
            }
            let (count, bytes) = with_cache(|c| {
                let class = class(10_000).unwrap();
                (c.counts[class], c.bytes)
            })
            .unwrap();
            assert!(count <= MAX_BLOCKS && bytes <= MAX_BYTES, "{count} {bytes}");
            alloc.dealloc(again, layout);
        }
    }

    #[test]
    fn realloc_keeps_the_bytes_across_classes_and_alignments() {
        let alloc = CachingMalloc;
        // SAFETY: each block is used within the size it was last given.
        unsafe {
            let mut layout = Layout::from_size_align(24, 8).unwrap();
            let mut block = alloc.alloc(layout);
            for i in 0..24 {
                block.add(i).write(i as u8);
            }
            // Same class, a larger class, past the cached sizes, and back.
            for new_size in [30, 900, 5_000, 40_000, 100] {
                block = alloc.realloc(block, layout, new_size);
                assert!(!block.is_null());
                for i in 0..24 {
                    assert_eq!(block.add(i).read(), i as u8, "byte {i} at {new_size}");
                }
                block.add(new_size - 1).write(0xff);
                layout = Layout::from_size_align(new_size, 8).unwrap();
            }
            alloc.dealloc(block, layout);
            let wide = Layout::from_size_align(256, 64).unwrap();
            let block = alloc.alloc_zeroed(wide);
            assert_eq!(block as usize % 64, 0);
            assert!((0..256).all(|i| block.add(i).read() == 0));
            alloc.dealloc(block, wide);
            let zeroed = Layout::from_size_align(700, 16).unwrap();
            let block = alloc.alloc(zeroed);
            block.write_bytes(0xee, 700);
            alloc.dealloc(block, zeroed);
            let block = alloc.alloc_zeroed(zeroed);
            assert!(
                (0..700).all(|i| block.add(i).read() == 0),
                "a reused block is zeroed"
            );
            alloc.dealloc(block, zeroed);
        }
    }

    #[test]
    fn a_full_cache_gives_other_sizes_back_to_keep_the_one_now_freed() {
        cache_this_thread();
        let alloc = CachingMalloc;
        let junk = Layout::from_size_align(MAX_CACHED, 8).unwrap();
        let hot = Layout::from_size_align(200, 8).unwrap();
        // SAFETY: blocks of their layouts, each freed once.
        unsafe {
            // Start-up frees more than the cache holds, all of one size.
            let blocks: Vec<_> = (0..MAX_BYTES / MAX_CACHED + 4)
                .map(|_| alloc.alloc(junk))
                .collect();
            for block in blocks {
                alloc.dealloc(block, junk);
            }
            assert!(with_cache(|c| c.bytes).unwrap() <= MAX_BYTES);
            // A request's block then still finds room, and comes back warm.
            let block = alloc.alloc(hot);
            alloc.dealloc(block, hot);
            let (kept, junk_left) = with_cache(|c| {
                (
                    c.counts[class(200).unwrap()],
                    c.counts[class(MAX_CACHED).unwrap()],
                )
            })
            .unwrap();
            assert_eq!((kept, junk_left), (1, 0));
            assert_eq!(alloc.alloc(hot), block);
            alloc.dealloc(block, hot);
        }
    }

    #[test]
    fn wide_aligned_blocks_are_cached_apart_and_keep_their_alignment() {
        cache_this_thread();
        let alloc = CachingMalloc;
        let task = Layout::from_size_align(640, 128).unwrap();
        let plain = Layout::from_size_align(640, 8).unwrap();
        // SAFETY: blocks of their layouts, each freed once.
        unsafe {
            let wide = alloc.alloc(task);
            assert_eq!(wide as usize % 128, 0);
            alloc.dealloc(wide, task);
            // A 16-aligned request of the same size never gets the wide block's slot
            // (nor the reverse): each comes back to its own kind.
            let other = alloc.alloc(plain);
            let again = alloc.alloc(task);
            assert_eq!(again, wide);
            assert_ne!(other, wide);
            let grown = alloc.realloc(again, task, 5_000);
            assert_eq!(grown as usize % 128, 0);
            alloc.dealloc(grown, Layout::from_size_align(5_000, 128).unwrap());
            alloc.dealloc(other, plain);
            let page = Layout::from_size_align(64, 4096).unwrap();
            let block = alloc.alloc(page);
            assert_eq!(block as usize % 4096, 0);
            alloc.dealloc(block, page);
        }
    }

    #[test]
    fn released_blocks_go_back_to_glibc() {
        cache_this_thread();
        let alloc = CachingMalloc;
        let layout = Layout::from_size_align(100, 8).unwrap();
        // SAFETY: blocks of `layout`, each freed once.
        unsafe {
            let blocks: Vec<_> = (0..10).map(|_| alloc.alloc(layout)).collect();
            for block in blocks {
                alloc.dealloc(block, layout);
            }
        }
        assert_eq!(with_cache(|c| c.counts[class(100).unwrap()]), Some(10));
        release_this_thread();
        assert_eq!(
            with_cache(|c| (c.bytes, c.heads.iter().all(|h| h.is_null()))),
            Some((0, true))
        );
    }

    #[test]
    fn a_thread_that_did_not_ask_keeps_nothing() {
        let alloc = CachingMalloc;
        let layout = Layout::from_size_align(10_000, 8).unwrap();
        // SAFETY: a block of `layout`, freed once.
        unsafe { alloc.dealloc(alloc.alloc(layout), layout) };
        assert_eq!(with_cache(|c| c.bytes), Some(0));
    }

    #[test]
    fn blocks_freed_on_other_threads_and_threads_that_end_are_safe() {
        let alloc = CachingMalloc;
        let layout = Layout::from_size_align(3_000, 16).unwrap();
        // Allocated here, freed there (into that thread's cache), which then ends and
        // hands them to glibc.
        let blocks: Vec<usize> = (0..64)
            // SAFETY: a fresh block of `layout`.
            .map(|_| unsafe { alloc.alloc(layout) } as usize)
            .collect();
        std::thread::spawn(move || {
            cache_this_thread();
            for block in blocks {
                // SAFETY: each block once, with its layout.
                unsafe { alloc.dealloc(block as *mut u8, layout) };
            }
            let held = with_cache(|c| c.bytes).unwrap();
            assert!(held >= 64 * 3_000, "{held}");
        })
        .join()
        .unwrap();
    }
}
