//! A fork-join team for the short parallel loops of a decode step, where the
//! calling thread takes part in the work.
//!
//! zserve's decode step calls ~200 kernels of 10-1000 µs each. Through the
//! rayon pool ([`crate::par`]) every call injected a job from the (Python)
//! caller, woke a sleeping worker, and put the caller to sleep on a latch until
//! the workers were done: two wake-ups across cores per call, tens of µs each
//! on a busy machine, so a second thread made SmolLM2's decode slower, not
//! faster (W4: 20 ms a step on one thread, 27 ms on two). Here the caller
//! publishes the loop and claims tasks itself from a shared counter, while
//! `threads - 1` helpers that spin for `SPIN` after their last task (then
//! sleep) claim the others. A helper that is late, or descheduled by another
//! process, costs nothing: the caller takes the tasks it did not claim, and
//! only waits for tasks already running.
//!
//! A helper that claimed a task and was then descheduled keeps the caller
//! waiting for it (for a scheduler time slice, milliseconds, on a machine whose
//! cores other processes also use): when the caller waits longer than it worked
//! itself, the team stands down for `BACKOFF_PER_WAIT` times that wait (at
//! most `BACKOFF_MAX`) and loops run on the caller alone (the helpers go to
//! sleep), so a busy machine loses at most 1/`BACKOFF_PER_WAIT` of its time to
//! late helpers instead of a wait per kernel call, while a short hiccup (a
//! virtual CPU paused for 50-300 µs, seen several times a second on this
//! project's 2-core VMs) stands the team down for milliseconds, not for the
//! 100 ms a fixed stand-down took: that made two threads no faster than one on
//! SmolLM2's INT4 decode products (measured: 120 products of a step 7.4 ms on
//! one thread, 7.3 ms on two with the fixed 100 ms, 4.8 ms with this rule;
//! weights in cache). It stands down too when,
//! over `WINDOW` loops, the helpers ran under a quarter of the tasks: their
//! spinning then only takes CPU time from the caller (measured: 120 INT4 decode
//! products took 21 ms instead of 12.6 on two threads while another process
//! kept both cores busy).
//!
//! One loop runs on the team at a time; a call while it is busy (another
//! Python thread, or a task that calls a kernel) runs its tasks inline.
//!
//! [`stats`] (`znative.team_stats()`) counts what the team did: loops run on it,
//! loops run alone while it stood down, the helpers' share of the tasks, each
//! rule's stand-downs and the callers' waits, so a serving benchmark can tell a
//! team that helped from one that stood down. `ZNATIVE_TEAM_NO_BACKOFF` (any
//! value) turns the stand-downs off, to measure what they cost or save.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle helper spins for the next loop before it sleeps: longer
/// than the Python-side gap between two kernels of a decode step.
const SPIN: Duration = Duration::from_micros(300);

/// How long the team stands down after a loop whose caller waited on a late
/// helper, per unit of that wait (see [`BACKOFF_MAX`]).
const BACKOFF_PER_WAIT: u32 = 16;

/// The longest stand-down: what a helper descheduled for a time slice (ms) buys.
const BACKOFF_MAX: Duration = Duration::from_millis(100);

/// Waits shorter than this never count as a late helper (a task's own length).
const LATE: Duration = Duration::from_micros(50);

/// Loops over which the helpers' share of the tasks is judged.
const WINDOW: u64 = 32;

/// What the team did since the process started (see [`stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Loops run on the team (the caller and its helpers).
    pub loops: u64,
    /// Loops of more than one task run on the caller alone while the team stood down.
    pub stood_down: u64,
    /// Tasks of the team's loops, and how many of them the helpers ran.
    pub tasks: u64,
    pub helped: u64,
    /// Stand-downs for a late helper, and for the helpers' small share of a window.
    pub late: u64,
    pub idle: u64,
    /// Nanoseconds callers waited for helpers' tasks after running out of their own.
    pub waited_ns: u64,
}

static STATS: [AtomicU64; 7] = [const { AtomicU64::new(0) }; 7];

fn count(i: usize, v: u64) {
    STATS[i].fetch_add(v, Ordering::Relaxed);
}

/// The team's counters since the process started: how often it ran, stood down, and why.
pub fn stats() -> Stats {
    let s = |i: usize| STATS[i].load(Ordering::Relaxed);
    Stats {
        loops: s(0),
        stood_down: s(1),
        tasks: s(2),
        helped: s(3),
        late: s(4),
        idle: s(5),
        waited_ns: s(6),
    }
}

/// The loop body with its borrow's lifetime erased: it is only called for a
/// claimed task index below `n`, and the caller returns only after every such
/// call has finished (see [`run`]).
type Body = *const (dyn Fn(usize) + Sync);

/// One published loop: `n` tasks claimed through `next`, counted in `done`.
struct Job {
    n: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
    body: Body,
}

// SAFETY: `body` points to a `Sync` closure, dereferenced only while the caller
// that owns it waits in `run` (every claimed task finishes before it returns).
unsafe impl Send for Job {}
unsafe impl Sync for Job {}

impl Job {
    /// Claims and runs tasks until none are left; a panic is recorded, not
    /// raised. Returns how many tasks it ran.
    fn work(&self) -> usize {
        let mut ran = 0;
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return ran;
            }
            ran += 1;
            // SAFETY: task i < n is claimed, so the caller is still waiting for it.
            let body = unsafe { &*self.body };
            if catch_unwind(AssertUnwindSafe(|| body(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

#[derive(Default)]
struct Slot {
    job: Option<Arc<Job>>,
    epoch: u64,
    sleepers: usize,
}

struct Team {
    slot: Mutex<Slot>,
    wake: Condvar,
    /// `slot.epoch`, readable without the lock (what idle helpers spin on).
    epoch: AtomicU64,
    busy: AtomicBool,
    helpers: usize,
    /// `ZNATIVE_TEAM_NO_BACKOFF` set: never stand down.
    no_backoff: bool,
    /// Loops run inline until this many nanoseconds after `start` (see [`BACKOFF_MAX`]).
    backoff_until: AtomicU64,
    start: Instant,
    /// Loops, tasks and tasks the helpers ran in the current [`WINDOW`] (written
    /// by the caller that holds `busy`).
    window: [AtomicU64; 3],
}

fn team() -> &'static Team {
    static TEAM: OnceLock<&'static Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let helpers = crate::par::num_threads().saturating_sub(1);
        let team: &'static Team = Box::leak(Box::new(Team {
            slot: Mutex::new(Slot::default()),
            wake: Condvar::new(),
            epoch: AtomicU64::new(0),
            busy: AtomicBool::new(false),
            helpers,
            no_backoff: std::env::var_os("ZNATIVE_TEAM_NO_BACKOFF").is_some(),
            backoff_until: AtomicU64::new(0),
            start: Instant::now(),
            window: Default::default(),
        }));
        let mut started = 0;
        for i in 0..helpers {
            let spawned = std::thread::Builder::new()
                .name(format!("znative-team-{i}"))
                .spawn(move || helper(team));
            started += usize::from(spawned.is_ok());
        }
        if started < helpers {
            // Threads could not be spawned: loops run on the caller (and who started).
            team.busy.store(started == 0, Ordering::Relaxed);
        }
        team
    })
}

fn helper(team: &'static Team) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while team.epoch.load(Ordering::Acquire) == seen {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && start.elapsed() > SPIN {
                let mut slot = team.slot.lock().unwrap_or_else(|e| e.into_inner());
                while slot.epoch == seen {
                    slot.sleepers += 1;
                    slot = team.wake.wait(slot).unwrap_or_else(|e| e.into_inner());
                    slot.sleepers -= 1;
                }
                break;
            }
        }
        let job = {
            let slot = team.slot.lock().unwrap_or_else(|e| e.into_inner());
            seen = slot.epoch;
            slot.job.clone()
        };
        if let Some(job) = job {
            let _ = job.work();
        }
    }
}

/// Threads a loop of [`run`] may use: the caller and the team's helpers.
pub fn threads() -> usize {
    team().helpers + 1
}

/// Runs `f(i)` for every `i < n`, the caller and the team's helpers claiming
/// tasks in order from a shared counter; returns when all have run. A panic in
/// a task is raised here once every task has finished.
pub fn run<F: Fn(usize) + Sync>(n: usize, f: F) {
    let team = team();
    let now = team.start.elapsed();
    if n <= 1 || team.helpers == 0 {
        (0..n).for_each(f);
        return;
    }
    if !team.no_backoff && (now.as_nanos() as u64) < team.backoff_until.load(Ordering::Relaxed) {
        count(1, 1);
        (0..n).for_each(f);
        return;
    }
    if team.busy.swap(true, Ordering::Acquire) {
        (0..n).for_each(f);
        return;
    }
    let body: &(dyn Fn(usize) + Sync) = &f;
    // SAFETY: only the lifetime is erased; see `Body`.
    let body: Body = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Body>(body) };
    let job = Arc::new(Job {
        n,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
        body,
    });
    {
        let mut slot = team.slot.lock().unwrap_or_else(|e| e.into_inner());
        slot.job = Some(Arc::clone(&job));
        slot.epoch += 1;
        team.epoch.store(slot.epoch, Ordering::Release);
        if slot.sleepers > 0 {
            team.wake.notify_all();
        }
    }
    let mine = job.work();
    // Tasks a helper claimed may still run: wait for them (yielding, in case
    // that helper shares this core).
    let worked = team.start.elapsed();
    let mut spins = 0u32;
    while job.done.load(Ordering::Acquire) < n {
        std::hint::spin_loop();
        spins = spins.saturating_add(1);
        if spins > 2000 {
            std::thread::yield_now();
        }
    }
    let end = team.start.elapsed();
    let waited = end - worked;
    let late = spins > 0 && waited > LATE && waited > worked - now;
    let [loops, tasks, helped] = &team.window;
    let l = loops.fetch_add(1, Ordering::Relaxed) + 1;
    let t = tasks.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
    let h = helped.fetch_add((n - mine) as u64, Ordering::Relaxed) + (n - mine) as u64;
    if l >= WINDOW {
        team.window
            .iter()
            .for_each(|c| c.store(0, Ordering::Relaxed));
    }
    count(0, 1);
    count(2, n as u64);
    count(3, (n - mine) as u64);
    count(6, waited.as_nanos() as u64);
    count(
        if late { 4 } else { 5 },
        u64::from(late || (l >= WINDOW && 4 * h < t)),
    );
    if late || (l >= WINDOW && 4 * h < t) {
        let backoff = if late {
            (waited * BACKOFF_PER_WAIT).min(BACKOFF_MAX)
        } else {
            BACKOFF_MAX
        };
        let until = (end + backoff).as_nanos() as u64;
        team.backoff_until.store(until, Ordering::Relaxed);
    }
    team.slot.lock().unwrap_or_else(|e| e.into_inner()).job = None;
    team.busy.store(false, Ordering::Release);
    if job.panicked.load(Ordering::Relaxed) {
        resume_unwind(Box::new("a parallel kernel task panicked"));
    }
}

#[cfg(test)]
mod tests {
    use super::run;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Every index runs exactly once, over many back-to-back loops (helpers
    /// spinning, sleeping and waking in between) and nested calls (inline).
    #[test]
    fn every_task_runs_once() {
        for n in [0usize, 1, 2, 3, 17, 1000] {
            for round in 0..50 {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                run(n, |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                    if i == 0 && round % 10 == 0 {
                        let inner = AtomicUsize::new(0);
                        run(5, |_| {
                            inner.fetch_add(1, Ordering::Relaxed);
                        });
                        assert_eq!(inner.load(Ordering::Relaxed), 5);
                    }
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// A panicking task is raised on the caller after the loop, and the team
    /// serves the next loop.
    #[test]
    fn a_task_panic_reaches_the_caller() {
        let got = std::panic::catch_unwind(|| run(64, |i| assert!(i != 40, "task 40")));
        assert!(got.is_err());
        let count = AtomicUsize::new(0);
        run(64, |_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 64);
    }
}
