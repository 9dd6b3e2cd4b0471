//! A persistent thread pool for the hundreds of small parallel ops of one decode step.
//!
//! A general-purpose pool wakes sleeping workers through the kernel for every op, which
//! costs more than a decode-sized matmul. Here workers spin on a generation counter between
//! ops and only park after a stretch of idleness (between requests), so handing out an op
//! costs a few atomic operations. The calling thread works too: with `n` threads there are
//! `n - 1` workers.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle, Thread};

/// How long an idle worker spins before parking (iterations of `spin_loop`).
const SPIN_LIMIT: u32 = 200_000;

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Bumped once per op; workers watch it.
    generation: AtomicUsize,
    /// The current op. Written only by the caller of `run`, before it bumps `generation`;
    /// read by workers until they decrement `pending`.
    job: UnsafeCell<Option<&'static Job>>,
    n_tasks: AtomicUsize,
    next: AtomicUsize,
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
            n_tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
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
                    .spawn(move || worker(s, i))
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

    /// Runs `f(0) … f(n_tasks - 1)` across the pool and returns when all are done. Tasks are
    /// claimed dynamically, so uneven tasks balance out.
    pub fn run<'a>(&self, n_tasks: usize, f: &'a (dyn Fn(usize) + Sync + 'a)) {
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
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        s.pending.store(self.workers.len(), Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::Release);
        for (i, (_, t)) in self.workers.iter().enumerate() {
            if s.sleeping[i].load(Ordering::Acquire) {
                t.unpark();
            }
        }
        // Even if a task panics here, wait for the workers: they still hold `f`.
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(s, job)));
        while s.pending.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        if let Err(e) = mine {
            std::panic::resume_unwind(e);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a thread pool task panicked on a worker thread");
        }
    }
}

fn work(s: &Shared, job: &Job) {
    let n = s.n_tasks.load(Ordering::Relaxed);
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        job(i);
    }
}

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
                std::hint::spin_loop();
            } else {
                s.sleeping[me].store(true, Ordering::Release);
                // Re-check after announcing sleep: an op posted in between is not missed,
                // and an unpark that raced ahead makes `park` return at once.
                if s.generation.load(Ordering::Acquire) == seen && !s.stop.load(Ordering::Relaxed) {
                    thread::park();
                }
                s.sleeping[me].store(false, Ordering::Release);
                spins = 0;
            }
        };
        if s.stop.load(Ordering::Relaxed) {
            return;
        }
        seen = gen;
        // SAFETY: written before the generation bump we just observed (Acquire).
        if let Some(job) = unsafe { *s.job.get() } {
            let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(&s, job)));
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
        let pool = ThreadPool::new(3);
        for n in [0usize, 1, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..200 {
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
            }
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 200));
        }
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
