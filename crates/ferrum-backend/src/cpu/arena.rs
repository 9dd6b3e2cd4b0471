//! Weights and KV caches on transparent huge pages.
//!
//! Decode streams every weight once per step. On 4 KiB pages that is one TLB miss, and a
//! page walk, every 4 KiB: about 25,000 per step for a 100 MB model, each on the path of a
//! prefetch or a load that is already waiting on memory. A 2 MiB page covers 512 times as
//! much. One weight matrix is often smaller than 2 MiB (SmolLM2's are 0.2–0.6 MB), so the
//! matrices are placed one after another in large 2 MiB-aligned chunks that the kernel is
//! asked (`madvise(MADV_HUGEPAGE)`) to back with huge pages. Where the system does not
//! (THP off, no free huge pages) the chunks are ordinary memory and nothing else changes.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

/// The huge page size the chunks are aligned to (x86-64 and most aarch64 kernels).
const HUGE: usize = 2 << 20;
/// Size of a shared chunk; a request of more than a quarter of it gets a chunk of its own,
/// so that at most a quarter chunk is left unused where a request does not fit.
const CHUNK: usize = 32 << 20;
/// Every allocation starts on a cache line.
const ALIGN: usize = 64;

struct Chunk {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: a chunk is plain memory; who may write where is up to its `ArenaVec`s, each of
// which owns a disjoint range.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

impl Chunk {
    fn new(bytes: usize) -> Chunk {
        // `from_size_align` refuses sizes past `isize::MAX`; the rounding is checked first.
        let layout = bytes
            .checked_next_multiple_of(HUGE)
            .and_then(|size| Layout::from_size_align(size, HUGE).ok())
            .expect("capacity overflow");
        // SAFETY: the layout has a non-zero size (callers ask for at least one byte).
        let ptr = unsafe { alloc(layout) };
        if ptr.is_null() {
            handle_alloc_error(layout);
        }
        advise_huge_pages(ptr, layout.size());
        Chunk { ptr, layout }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(ptr: *mut u8, bytes: usize) {
    extern "C" {
        fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
    }
    const MADV_HUGEPAGE: i32 = 14;
    // SAFETY: the range is one live allocation of ours. The advice only changes how the
    // kernel backs it; failure (THP compiled out) leaves ordinary pages, so it is ignored.
    unsafe { madvise(ptr.cast(), bytes, MADV_HUGEPAGE) };
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_: *mut u8, _: usize) {}

/// Hands out ranges of shared, huge-page-backed chunks, each in the first chunk with room
/// for it (so a chunk's tail that a large matrix did not fit still takes smaller ones: an
/// unused huge page is never faulted in, a partly used one is resident whole). A chunk's
/// space is not reused while any range of it lives; once none does, it is freed at the
/// arena's next allocation or with the arena (a chunk of its own, with its one range).
#[derive(Default)]
pub struct Arena {
    /// The shared chunks and how many of each one's bytes are handed out.
    chunks: Mutex<Vec<(Arc<Chunk>, usize)>>,
}

impl Arena {
    /// Room for `n` values of `T`, not yet written: see [`ArenaVec::from_fn`].
    fn take<T>(&self, n: usize) -> (Arc<Chunk>, *mut T) {
        let bytes = n
            .checked_mul(std::mem::size_of::<T>())
            .expect("capacity overflow")
            .max(1);
        assert!(
            std::mem::align_of::<T>() <= ALIGN,
            "arena values align to at most 64"
        );
        if bytes > CHUNK / 4 {
            let c = Arc::new(Chunk::new(bytes));
            let p = c.ptr.cast();
            return (c, p);
        }
        let mut chunks = self.chunks.lock().unwrap_or_else(|e| e.into_inner());
        // Chunks no range holds any more (only the arena's own count is left) go back to the
        // system. Counts only grow under this lock, so one seen at 1 stays there.
        chunks.retain(|(c, _)| Arc::strong_count(c) > 1);
        let fits = |(c, used): &(Arc<Chunk>, usize)| {
            used.next_multiple_of(ALIGN) + bytes <= c.layout.size()
        };
        let i = match chunks.iter().position(fits) {
            Some(i) => i,
            None => {
                chunks.push((Arc::new(Chunk::new(CHUNK)), 0));
                chunks.len() - 1
            }
        };
        let (c, used) = &mut chunks[i];
        let start = used.next_multiple_of(ALIGN);
        *used = start + bytes;
        // SAFETY: `start + bytes` is within the chunk (it fits, or the chunk is new).
        let p = unsafe { c.ptr.add(start) }.cast();
        (c.clone(), p)
    }
}

/// A fixed-length array of plain values in an [`Arena`] chunk.
pub struct ArenaVec<T> {
    _chunk: Arc<Chunk>,
    ptr: *mut T,
    len: usize,
    _values: PhantomData<T>,
}

// SAFETY: an `ArenaVec` owns its range exclusively, like a `Box<[T]>`: shared slices through
// `&self`, a mutable one only through `&mut self`.
unsafe impl<T: Send> Send for ArenaVec<T> {}
unsafe impl<T: Sync> Sync for ArenaVec<T> {}

impl<T: Copy> ArenaVec<T> {
    /// `n` values in `arena`, written by `fill(dst)`.
    ///
    /// # Safety
    /// `fill` writes every one of the `n` values at `dst` (`dst.add(i)` for `i < n`, each
    /// once, from any threads) before it returns.
    pub unsafe fn from_fn(arena: &Arena, n: usize, fill: impl FnOnce(*mut T)) -> ArenaVec<T> {
        let (chunk, ptr) = arena.take::<T>(n);
        fill(ptr);
        ArenaVec {
            _chunk: chunk,
            ptr,
            len: n,
            _values: PhantomData,
        }
    }

    /// `n` copies of `v` in `arena` (every page written, so all of it is resident at once).
    pub fn filled(arena: &Arena, n: usize, v: T) -> ArenaVec<T> {
        // SAFETY: writes all `n` values.
        unsafe {
            ArenaVec::from_fn(arena, n, |p: *mut T| {
                for i in 0..n {
                    p.add(i).write(v)
                }
            })
        }
    }
}

impl<T> Deref for ArenaVec<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `len` values written (the `from_fn` contract), kept alive by `_chunk`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T> DerefMut for ArenaVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; `&mut self` makes the range exclusively ours.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(arena: &Arena, n: usize, v: u32) -> ArenaVec<u32> {
        // SAFETY: writes all `n` values.
        unsafe {
            ArenaVec::from_fn(arena, n, |p: *mut u32| {
                for i in 0..n {
                    p.add(i).write(v + i as u32)
                }
            })
        }
    }

    #[test]
    fn ranges_are_disjoint_aligned_and_outlive_the_arena() {
        let arena = Arena::default();
        // Small ones share a chunk; a large one gets its own; a small one after it goes on
        // filling the shared chunk.
        let sizes = [1usize, 3, 1000, (CHUNK / 4) / 4 + 1, 17, 5];
        let vs: Vec<ArenaVec<u32>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| filled(&arena, n, 1000 * i as u32))
            .collect();
        let mut spans: Vec<(usize, usize)> = vs
            .iter()
            .map(|v| (v.as_ptr() as usize, v.as_ptr() as usize + 4 * v.len()))
            .collect();
        spans.sort();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "overlap");
        assert!(vs
            .iter()
            .all(|v| (v.as_ptr() as usize).is_multiple_of(ALIGN)));
        let first = vs[0].as_ptr() as usize;
        assert!(
            vs.iter()
                .filter(|v| v.len() < CHUNK / 16)
                .all(|v| (v.as_ptr() as usize).abs_diff(first) < CHUNK),
            "small ranges share one chunk"
        );
        drop(arena);
        for (i, v) in vs.iter().enumerate() {
            assert!(v
                .iter()
                .enumerate()
                .all(|(j, &x)| x == 1000 * i as u32 + j as u32));
        }
    }

    #[test]
    fn a_chunk_no_range_holds_is_freed_at_the_next_allocation() {
        let arena = Arena::default();
        let a = filled(&arena, 10, 0);
        let weak = Arc::downgrade(&a._chunk);
        drop(a);
        assert!(
            weak.upgrade().is_some(),
            "kept until the arena allocates again"
        );
        let b = filled(&arena, 10, 0);
        assert!(weak.upgrade().is_none(), "freed");
        assert_eq!(b[9], 9);
    }

    #[test]
    #[should_panic(expected = "capacity overflow")]
    fn a_size_past_the_address_space_is_refused() {
        let _ = ArenaVec::<u32>::filled(&Arena::default(), (usize::MAX >> 2) + 16, 0);
    }

    #[test]
    fn a_full_chunk_makes_way_for_a_new_one_and_tails_are_filled() {
        let arena = Arena::default();
        let quarter = CHUNK / 4 / 4; // a quarter chunk of u32: shared
        let chunk_of = |v: &ArenaVec<u32>| Arc::as_ptr(&v._chunk) as usize;
        let big: Vec<_> = (0..5).map(|i| filled(&arena, quarter - 16, i)).collect();
        // Four nearly fill the first chunk; the fifth starts another; a small one still
        // fits the first one's tail.
        let small = filled(&arena, 8, 99);
        assert_ne!(chunk_of(&big[3]), chunk_of(&big[4]));
        assert!(big[..4].iter().all(|v| chunk_of(v) == chunk_of(&big[0])));
        assert_eq!(chunk_of(&small), chunk_of(&big[0]));
        assert!(big
            .iter()
            .enumerate()
            .all(|(i, v)| v[quarter - 17] == (i + quarter - 17) as u32));
        assert_eq!(small[7], 106);
    }
}
