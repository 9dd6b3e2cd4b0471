//! A persistent thread pool for the hundreds of small parallel ops of one decode step.
//!
//! A general-purpose pool wakes sleeping workers through the kernel for every op, which
//! costs more than a decode-sized matmul. Here workers spin on a generation counter between
//! ops and only park after a stretch of idleness (between requests), so handing out an op
//! costs a few atomic operations. The calling thread works too: with `n` threads there are
//! `n - 1` workers.
//!
//! Each thread starts on a contiguous share of an op's tasks and only then takes what is
//! left of the others'. Handing tasks out one by one from a single counter interleaves the
//! threads' row ranges, so a thread's next task is never where its prefetches and the
//! hardware prefetcher were heading: four-token matmuls (compute-bound here, so a stalled
//! load is not hidden behind others) took 10-15% longer that way.

use std::cell::UnsafeCell;
use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle, Thread};

/// How long an idle worker waits before parking: checks of the generation counter, the
/// first [`YIELD_AFTER`] with `spin_loop` between them, the rest with a yield (about 10 ms
/// in all on an idle machine).
const SPIN_LIMIT: u32 = 22_000;

/// Spins after which a waiting thread yields its core between checks: a wait that long
/// means the thread it waits for is not running (more busy threads than cores: another
/// process, or tests running side by side), and spinning on would only keep it off the core
/// for the rest of a time slice. On an otherwise idle machine a yield returns at once.
const YIELD_AFTER: u32 = 2_000;

/// One iteration of a wait that has run `spins` times.
pub(crate) fn relax(spins: u32) {
    if spins < YIELD_AFTER {
        std::hint::spin_loop();
    } else {
        thread::yield_now();
    }
}

type Job = dyn Fn(usize) + Sync;

/// One thread's share of the current op: tasks `next..end`, claimed from the front by the
/// thread itself and, once their own share is done, by the others. Each on its own cache
/// lines, so one thread's claims do not slow another's.
#[repr(align(128))]
#[derive(Default)]
struct Share {
    next: AtomicUsize,
    end: AtomicUsize,
}

struct Shared {
    /// Bumped once per op; workers watch it.
    generation: AtomicUsize,
    /// The current op. Written only by the caller of `run`, before it bumps `generation`;
    /// read by workers until they decrement `pending`.
    job: UnsafeCell<Option<&'static Job>>,
    /// Tasks `0..first` of the current op, handed out one at a time before any share.
    first: AtomicUsize,
    next_first: AtomicUsize,
    /// Per thread (the caller's first), its share of tasks `first..`.
    shares: Vec<Share>,
    /// Workers that have not finished the current op yet.
    pending: AtomicUsize,
    /// A task of the current op panicked on a worker; `run` panics in turn once the op is
    /// over, rather than the caller waiting forever for a worker that died.
    panicked: AtomicBool,
    stop: AtomicBool,
    sleeping: Vec<AtomicBool>,
}

// SAFETY: `job` is written only by `run` while no worker reads it (all workers have finished
// the previous op, `pending == 0`), and read only between a generation bump and the worker's
// `pending` decrement.
unsafe impl Sync for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<(JoinHandle<()>, Thread)>,
}

impl ThreadPool {
    /// A pool running ops on `threads` threads in all (the caller plus `threads - 1`).
    pub fn new(threads: usize) -> ThreadPool {
        let n_workers = threads.max(1) - 1;
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            first: AtomicUsize::new(0),
            next_first: AtomicUsize::new(0),
            shares: (0..=n_workers).map(|_| Share::default()).collect(),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleeping: (0..n_workers).map(|_| AtomicBool::new(false)).collect(),
        });
        let workers = (0..n_workers)
            .map(|i| {
                let s = shared.clone();
                let h = thread::Builder::new()
                    .name(format!("ferrum-worker-{i}"))
                    .spawn(move || worker(s, i + 1))
                    .expect("spawning a worker thread");
                let t = h.thread().clone();
                (h, t)
            })
            .collect();
        ThreadPool { shared, workers }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(0) … f(n_tasks - 1)` across the pool and returns when all are done. Each
    /// thread takes a contiguous share of the tasks in order, then helps with what is left of
    /// the others', so uneven tasks balance out.
    pub fn run<'a>(&self, n_tasks: usize, f: &'a (dyn Fn(usize) + Sync + 'a)) {
        self.run_after(0, n_tasks, f)
    }

    /// As [`run`](Self::run), but tasks `0..first` are handed out one at a time, in order,
    /// before any thread starts on the rest: when a later task begins, every one of them has
    /// been claimed by a thread that does not wait, so a later task may wait for them (as
    /// long as they wait for nothing). With one thread the tasks simply run in order.
    pub fn run_after<'a>(&self, first: usize, n_tasks: usize, f: &'a (dyn Fn(usize) + Sync + 'a)) {
        if n_tasks == 0 {
            return;
        }
        if self.workers.is_empty() || n_tasks == 1 {
            (0..n_tasks).for_each(f);
            return;
        }
        let s = &*self.shared;
        // SAFETY: the reference outlives every use: workers read the job only until they
        // decrement `pending`, and this function waits for `pending == 0` before returning.
        let job: &'static Job =
            unsafe { std::mem::transmute::<&'a (dyn Fn(usize) + Sync + 'a), &'static Job>(f) };
        // SAFETY: no worker is inside an op (the previous `run` waited for `pending == 0`).
        unsafe { *s.job.get() = Some(job) };
        let first = first.min(n_tasks);
        s.first.store(first, Ordering::Relaxed);
        s.next_first.store(0, Ordering::Relaxed);
        let (rest, threads) = (n_tasks - first, s.shares.len());
        for (i, share) in s.shares.iter().enumerate() {
            share
                .next
                .store(first + i * rest / threads, Ordering::Relaxed);
            share
                .end
                .store(first + (i + 1) * rest / threads, Ordering::Relaxed);
        }
        s.pending.store(self.workers.len(), Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::Release);
        // Pairs with the fence after a worker announces sleep: without both, the worker's
        // store of `sleeping` and this thread's bump of `generation` could each miss the
        // other (store buffers), the worker park and this thread wait for it forever.
        fence(Ordering::SeqCst);
        for (i, (_, t)) in self.workers.iter().enumerate() {
            if s.sleeping[i].load(Ordering::Acquire) {
                t.unpark();
            }
        }
        // Even if a task panics here, wait for the workers: they still hold `f`.
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(s, 0, job)));
        let mut spins = 0;
        while s.pending.load(Ordering::Acquire) != 0 {
            relax(spins);
            spins = spins.saturating_add(1);
        }
        if let Err(e) = mine {
            std::panic::resume_unwind(e);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a thread pool task panicked on a worker thread");
        }
    }
}

/// Thread `me`'s part of the current op: the leading tasks while any are left, its own
/// share, then the others' leftovers.
fn work(s: &Shared, me: usize, job: &Job) {
    let first = s.first.load(Ordering::Relaxed);
    // (A plain `run` has none: no claim on the shared counter then.)
    if first > 0 {
        loop {
            let i = s.next_first.fetch_add(1, Ordering::Relaxed);
            if i >= first {
                break;
            }
            job(i);
        }
    }
    let n = s.shares.len();
    for share in (0..n).map(|k| &s.shares[(me + k) % n]) {
        let end = share.end.load(Ordering::Relaxed);
        loop {
            let i = share.next.fetch_add(1, Ordering::Relaxed);
            if i >= end {
                break;
            }
            job(i);
        }
    }
}

/// Worker `me` (1-based: share 0 is the caller's).
fn worker(s: Arc<Shared>, me: usize) {
    let mut seen = 0;
    loop {
        let mut spins = 0u32;
        let gen = loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen || s.stop.load(Ordering::Relaxed) {
                break g;
            }
            spins += 1;
            if spins < SPIN_LIMIT {
                relax(spins);
            } else {
                s.sleeping[me - 1].store(true, Ordering::Release);
                fence(Ordering::SeqCst);
                // Re-check after announcing sleep: an op posted in between is not missed,
                // and an unpark that raced ahead makes `park` return at once.
                if s.generation.load(Ordering::Acquire) == seen && !s.stop.load(Ordering::Relaxed) {
                    thread::park();
                }
                s.sleeping[me - 1].store(false, Ordering::Release);
                spins = 0;
            }
        };
        if s.stop.load(Ordering::Relaxed) {
            return;
        }
        seen = gen;
        // SAFETY: written before the generation bump we just observed (Acquire).
        if let Some(job) = unsafe { *s.job.get() } {
            let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(&s, me, job)));
            if done.is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.generation.fetch_add(1, Ordering::Release);
        for (h, t) in self.workers.drain(..) {
            t.unpark();
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_many_ops() {
        for threads in [2, 3] {
            let pool = ThreadPool::new(threads);
            for n in [0usize, 1, 2, 7, 100] {
                for first in [0, 1, 5, n] {
                    let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    for _ in 0..100 {
                        pool.run_after(first, n, &|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                    }
                    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 100));
                }
            }
        }
    }

    #[test]
    fn later_tasks_may_wait_for_the_first_ones() {
        // What quantised matmuls rely on: with the leading tasks handed out before the rest,
        // a later task that waits for all of them always sees them finish. Were a share
        // started first, a thread could wait on a leading task that nobody had claimed.
        for threads in [2, 3] {
            let pool = ThreadPool::new(threads);
            for first in [1usize, 2, 4] {
                for _ in 0..200 {
                    let done = AtomicUsize::new(0);
                    pool.run_after(first, first + 8, &|i| {
                        if i < first {
                            thread::sleep(std::time::Duration::from_micros(20));
                            done.fetch_add(1, Ordering::Release);
                            return;
                        }
                        let start = std::time::Instant::now();
                        while done.load(Ordering::Acquire) < first {
                            assert!(
                                start.elapsed() < std::time::Duration::from_secs(10),
                                "a later task waited on leading tasks nobody ran"
                            );
                            std::hint::spin_loop();
                        }
                    });
                }
            }
        }
    }

    #[test]
    fn each_thread_starts_on_its_own_share() {
        // Two threads: the caller starts at task 0 and the worker at the middle (from a
        // single counter it would take task 1). Each thread's first task waits for the
        // other's, so neither can finish its share and take the other's first task however
        // the threads are scheduled.
        let pool = ThreadPool::new(2);
        let n = 16;
        let arrived = AtomicUsize::new(0);
        let order = std::sync::Mutex::new(Vec::new());
        pool.run(n, &|i| {
            let me = thread::current().id();
            let mut order = order.lock().expect("no task panics");
            let first = order.iter().all(|&(t, _)| t != me);
            order.push((me, i));
            drop(order);
            if first {
                arrived.fetch_add(1, Ordering::AcqRel);
                let start = std::time::Instant::now();
                while arrived.load(Ordering::Acquire) < 2 {
                    assert!(
                        start.elapsed() < std::time::Duration::from_secs(10),
                        "one thread ran every task"
                    );
                    thread::yield_now();
                }
            }
        });
        let order = order.into_inner().expect("no task panics");
        let caller = thread::current().id();
        let first_of = |mine: bool| order.iter().find(|o| (o.0 == caller) == mine).map(|o| o.1);
        assert_eq!(order.len(), n);
        assert_eq!(first_of(true), Some(0));
        assert_eq!(first_of(false), Some(n / 2), "{order:?}");
    }

    #[test]
    fn a_task_panic_reaches_the_caller_and_the_pool_goes_on() {
        let pool = ThreadPool::new(2);
        // Whichever thread takes task 5 (the caller or the worker), `run` panics once every
        // other task is done, instead of waiting forever for a dead worker.
        for _ in 0..20 {
            let count = AtomicUsize::new(0);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.run(8, &|i| {
                    if i == 5 {
                        panic!("task 5");
                    }
                    count.fetch_add(1, Ordering::Relaxed);
                })
            }));
            assert!(r.is_err());
            assert_eq!(count.load(Ordering::Relaxed), 7);
        }
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = ThreadPool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(4, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        // Long enough for the worker to give up spinning and park.
        thread::sleep(std::time::Duration::from_millis(300));
        pool.run(4, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }
}
