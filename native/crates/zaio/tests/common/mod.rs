//! Shared helpers of the integration tests: a scratch directory on the real
//! disk, deterministic bytes, and the backends this machine can run.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use zaio::{AioConfig, BackendKind, Engine};

/// A directory under the system temp dir, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("zaio-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Scratch(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `n` bytes that differ with `seed` and position (no long zero runs).
pub fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The backends to test here: threads always, io_uring where it starts.
pub fn backends() -> Vec<BackendKind> {
    let mut b = vec![BackendKind::Threads];
    match zaio::probe_io_uring() {
        Ok(()) => b.push(BackendKind::IoUring),
        Err((why, _)) => eprintln!("skipping io_uring: {why}"),
    }
    b
}

pub fn engine(backend: BackendKind, block_size: usize, queue_depth: usize) -> Engine {
    Engine::new(AioConfig {
        block_size,
        queue_depth,
        backend,
        ..AioConfig::default()
    })
    .expect("engine starts")
}

pub fn file_bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).expect("read back with std::fs")
}
