//! A global allocator that can meter one thread's allocations.
//!
//! A chat template is code from the internet, and a few Jinja instructions can build a string
//! of gigabytes (`{% set ns.s = ns.s ~ ns.s %}` in a loop doubles it each time; fuel counts
//! instructions, not bytes). Rust cannot fail an allocation gracefully, so the meter does the
//! next best thing: a metered thread that goes over its budget stops where it is (it sleeps
//! for good, holding what it had, at most the budget) and says so through the meter, and
//! whoever waits on it reports an error and never uses that code again. Metered code must
//! not take locks other threads need (a thread stopped holding one would block them): the
//! chat-template sandbox fills minijinja's shared caches before it meters anything.
//!
//! Only binaries that install [`Metered`] as their `#[global_allocator]` get the budget
//! ([`Metered::installed`] tells); elsewhere a meter never trips. The cost for every other
//! thread is one thread-local read per allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The system allocator, with per-thread metering on request.
pub struct Metered;

static INSTALLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The meter of this thread, or null. A raw pointer (kept alive by the `Arc` the
    /// thread's [`MeterGuard`] holds) so that reading it allocates nothing.
    static CURRENT: Cell<*const Meter> = const { Cell::new(std::ptr::null()) };
}

/// How many bytes a thread has allocated (less what it freed), how deep its stack is, and
/// the budgets for both.
#[derive(Debug)]
pub struct Meter {
    used: AtomicIsize,
    limit: isize,
    /// The stack address where metering started, and how far below it the thread may go.
    stack_top: AtomicUsize,
    stack_limit: usize,
    tripped: AtomicU8,
}

/// What a metered thread went over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trip {
    Memory,
    /// Its stack: runaway recursion (a stack overflow would abort the whole process). Caught
    /// at the next allocation, which recursion through values makes at every level.
    Stack,
}

impl Meter {
    /// A budget of `limit_bytes` of heap, and of `stack_bytes` of stack below where the
    /// thread enters the meter (checked at each allocation; give it well under the thread's
    /// stack size).
    pub fn new(limit_bytes: usize, stack_bytes: usize) -> Arc<Meter> {
        Arc::new(Meter {
            used: AtomicIsize::new(0),
            limit: isize::try_from(limit_bytes).unwrap_or(isize::MAX),
            stack_top: AtomicUsize::new(0),
            stack_limit: stack_bytes,
            tripped: AtomicU8::new(0),
        })
    }

    /// The metered thread went over a budget (and is now stopped for good).
    pub fn tripped(&self) -> Option<Trip> {
        match self.tripped.load(Ordering::Acquire) {
            0 => None,
            1 => Some(Trip::Memory),
            _ => Some(Trip::Stack),
        }
    }

    /// Meters the calling thread until the guard drops. Meters do not nest: entering one on
    /// a thread that is already metered panics (a guard dropped out of order would leave the
    /// thread pointing at a freed meter).
    pub fn enter(self: &Arc<Meter>) -> MeterGuard {
        let meter = Arc::clone(self);
        let here = 0u8;
        meter.stack_top.store(
            std::hint::black_box(&here) as *const u8 as usize,
            Ordering::Relaxed,
        );
        let previous = CURRENT.with(|c| c.replace(Arc::as_ptr(&meter)));
        assert!(
            previous.is_null(),
            "a thread can be metered by one meter at a time"
        );
        MeterGuard {
            _meter: meter,
            _not_send: std::marker::PhantomData,
        }
    }
}

/// Keeps the calling thread metered; dropping it ends the metering. Not `Send`: it belongs
/// to the thread it meters.
pub struct MeterGuard {
    _meter: Arc<Meter>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for MeterGuard {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(std::ptr::null()));
    }
}

impl Metered {
    /// True once the binary's `#[global_allocator]` is [`Metered`] and it has allocated.
    pub fn installed() -> bool {
        // Any allocation through `Metered` sets the flag; make one so the answer does not
        // depend on whether this process has allocated yet.
        drop(std::hint::black_box(Box::new(0u8)));
        INSTALLED.load(Ordering::Relaxed)
    }
}

#[inline]
fn charge(bytes: usize) {
    let p = CURRENT.with(Cell::get);
    if p.is_null() {
        return;
    }
    // SAFETY: a non-null pointer was set by `Meter::enter`, whose guard keeps the `Arc`
    // alive until it resets the pointer.
    let meter = unsafe { &*p };
    let used = meter.used.fetch_add(bytes as isize, Ordering::Relaxed) + bytes as isize;
    let here = 0u8;
    let sp = std::hint::black_box(&here) as *const u8 as usize;
    let depth = meter.stack_top.load(Ordering::Relaxed).saturating_sub(sp);
    let trip = if used > meter.limit {
        1
    } else if depth > meter.stack_limit {
        2
    } else {
        return;
    };
    // A panicking thread holds the panic hook's and the backtrace's locks while it allocates:
    // stopped there it would block every later panic in the process.
    if std::thread::panicking() {
        return;
    }
    if meter
        .tripped
        .compare_exchange(0, trip, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        // Stop this thread where it is. Sleeping allocates nothing, and the allocation that
        // went over the budget never happens.
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

#[inline]
fn credit(bytes: usize) {
    let p = CURRENT.with(Cell::get);
    if !p.is_null() {
        // SAFETY: as in `charge`.
        let meter = unsafe { &*p };
        meter.used.fetch_sub(bytes as isize, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to `System` with the same layout; the metering around it
// touches only atomics and a const thread-local, never the heap.
unsafe impl GlobalAlloc for Metered {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !INSTALLED.load(Ordering::Relaxed) {
            INSTALLED.store(true, Ordering::Relaxed);
        }
        charge(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        credit(layout.size());
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            charge(new_size - layout.size());
        } else {
            credit(layout.size() - new_size);
        }
        System.realloc(ptr, layout, new_size)
    }
}
