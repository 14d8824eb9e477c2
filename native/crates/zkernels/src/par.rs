//! The kernels' thread pool and chunked parallel loops.
//!
//! One pool per process, sized by `ZNATIVE_NUM_THREADS` or the cores this
//! process may use. Buffers are cut into [`CHUNK`]-element pieces; inputs
//! smaller than two chunks run on the calling thread, where waking the pool
//! would cost more than it saves.

use std::sync::OnceLock;

use rayon::prelude::*;

/// Elements per task: 16 Ki f32 = 64 KiB per buffer, so a task's working set
/// (4 buffers) stays in L2 while it runs.
pub const CHUNK: usize = 1 << 14;

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

/// Threads the kernels use.
pub fn num_threads() -> usize {
    pool().current_num_threads()
}

/// Runs `f` over aligned chunks of four equally long buffers.
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
    pool().install(|| {
        a.par_chunks_mut(CHUNK)
            .zip(b.par_chunks(CHUNK))
            .zip(c.par_chunks_mut(CHUNK))
            .zip(d.par_chunks_mut(CHUNK))
            .for_each(|(((a, b), c), d)| f(a, b, c, d));
    });
}

/// Runs `f` over aligned chunks of three equally long buffers.
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
    pool().install(|| {
        a.par_chunks_mut(CHUNK)
            .zip(b.par_chunks(CHUNK))
            .zip(c.par_chunks_mut(CHUNK))
            .for_each(|((a, b), c)| f(a, b, c));
    });
}
