//! The kernels' thread pool and chunked parallel loops.
//!
//! One pool per process, sized by `ZNATIVE_NUM_THREADS` or the cores this
//! process may use. A buffer is cut into a few long contiguous parts per
//! thread ([`PARTS_PER_THREAD`]): long runs keep the hardware prefetchers
//! streaming and make scheduling overhead negligible, while more than one part
//! per thread lets an idle thread take over work from one that an unrelated
//! process slowed down. Inputs below [`CHUNK`] elements per part run on the
//! calling thread, where waking the pool would cost more than it saves.

use std::sync::OnceLock;

use rayon::prelude::*;

/// Smallest part handed to a thread: 64 Ki elements (256 KiB of f32 per buffer).
pub const CHUNK: usize = 1 << 16;

/// Parts per pool thread for large inputs.
pub const PARTS_PER_THREAD: usize = 4;

/// Elements per part for a buffer of `n`: whole multiples of 16 (one 64-byte
/// line of f32) so parts start on cache-line boundaries of an aligned buffer.
fn part_len(n: usize) -> usize {
    let parts = (num_threads() * PARTS_PER_THREAD)
        .min(n.div_ceil(CHUNK))
        .max(1);
    n.div_ceil(parts).next_multiple_of(16)
}

fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::env::var("ZNATIVE_NUM_THREADS")
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("znative-{i}"))
            .build()
            // Building a pool only fails if threads cannot be spawned; fall back to one thread.
            .unwrap_or_else(|_| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .expect("a one-thread pool always builds")
            })
    })
}

/// Runs `f` inside the kernels' pool, so rayon parallel iterators in `f` use it.
pub fn install<R: Send, F: FnOnce() -> R + Send>(f: F) -> R {
    pool().install(f)
}

/// Threads the kernels use.
pub fn num_threads() -> usize {
    pool().current_num_threads()
}

/// Runs `f` over matching parts of four equally long buffers.
pub fn for_each_chunk4<A, B, C, D, F>(a: &mut [A], b: &[B], c: &mut [C], d: &mut [D], f: F)
where
    A: Send,
    B: Sync,
    C: Send,
    D: Send,
    F: Fn(&mut [A], &[B], &mut [C], &mut [D]) + Sync,
{
    if a.len() < 2 * CHUNK {
        return f(a, b, c, d);
    }
    let len = part_len(a.len());
    pool().install(|| {
        a.par_chunks_mut(len)
            .zip(b.par_chunks(len))
            .zip(c.par_chunks_mut(len))
            .zip(d.par_chunks_mut(len))
            .for_each(|(((a, b), c), d)| f(a, b, c, d));
    });
}

/// Runs `f` over matching parts of three equally long buffers.
pub fn for_each_chunk3<A, B, C, F>(a: &mut [A], b: &[B], c: &mut [C], f: F)
where
    A: Send,
    B: Sync,
    C: Send,
    F: Fn(&mut [A], &[B], &mut [C]) + Sync,
{
    if a.len() < 2 * CHUNK {
        return f(a, b, c);
    }
    let len = part_len(a.len());
    pool().install(|| {
        a.par_chunks_mut(len)
            .zip(b.par_chunks(len))
            .zip(c.par_chunks_mut(len))
            .for_each(|((a, b), c)| f(a, b, c));
    });
}
