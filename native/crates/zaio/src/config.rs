//! Engine configuration, with DeepSpeed's `aio` block as the model:
//! `block_size`, `queue_depth`, `intra_op_parallelism` (DeepSpeed's
//! `thread_count`), `single_submit`, `overlap_events`, plus the backend choice.

use std::str::FromStr;

use crate::error::AioError;

/// O_DIRECT alignment of file offsets, lengths and buffer addresses. 4096 is
/// the page size and a multiple of every common logical block size (512, 4096).
pub const ALIGN: usize = 4096;

/// Which IO backend to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// io_uring when `io_uring_setup` works here, else the thread pool.
    Auto,
    /// io_uring only; the engine fails to start where it is unavailable.
    IoUring,
    /// Blocking `pread`/`pwrite` on a pool of threads.
    Threads,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Auto => "auto",
            BackendKind::IoUring => "io_uring",
            BackendKind::Threads => "threads",
        }
    }
}

impl FromStr for BackendKind {
    type Err = AioError;

    fn from_str(s: &str) -> Result<Self, AioError> {
        match s {
            "auto" => Ok(BackendKind::Auto),
            "io_uring" | "uring" => Ok(BackendKind::IoUring),
            "threads" | "thread" => Ok(BackendKind::Threads),
            _ => Err(AioError::InvalidConfig {
                name: "backend",
                value: format!("{s:?}"),
                expected: "one of `auto`, `io_uring`, `threads`",
            }),
        }
    }
}

/// Most threads the thread-pool backend starts, whatever `queue_depth` asks for.
pub const MAX_POOL_THREADS: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AioConfig {
    /// Bytes per IO request to the kernel; a request is split into blocks of
    /// this size. A multiple of 4096 (O_DIRECT alignment).
    pub block_size: usize,
    /// IOs in flight per io_uring ring (its submission-queue size). The thread
    /// backend keeps `queue_depth × intra_op_parallelism` IOs in flight with
    /// one thread each, capped at [`MAX_POOL_THREADS`].
    pub queue_depth: usize,
    /// Worker threads (each with its own ring under io_uring) that share the
    /// blocks of every request, so one large request uses all of them.
    pub intra_op_parallelism: usize,
    /// io_uring: enter the kernel once per block instead of once per batch.
    /// No effect on the thread backend.
    pub single_submit: bool,
    /// io_uring: refill the ring as each IO completes. When false, a worker
    /// waits for its whole batch before submitting the next. No effect on the
    /// thread backend.
    pub overlap_events: bool,
    pub backend: BackendKind,
}

impl Default for AioConfig {
    fn default() -> Self {
        AioConfig {
            block_size: 1 << 20,
            queue_depth: 8,
            intra_op_parallelism: 1,
            single_submit: false,
            overlap_events: true,
            backend: BackendKind::Auto,
        }
    }
}

impl AioConfig {
    pub fn validate(&self) -> Result<(), AioError> {
        if self.block_size < ALIGN
            || !self.block_size.is_multiple_of(ALIGN)
            || self.block_size > 1 << 30
        {
            return Err(AioError::InvalidConfig {
                name: "block_size",
                value: self.block_size.to_string(),
                expected: "a multiple of 4096 between 4096 and 1073741824 bytes",
            });
        }
        if !(1..=4096).contains(&self.queue_depth) {
            return Err(AioError::InvalidConfig {
                name: "queue_depth",
                value: self.queue_depth.to_string(),
                expected: "1 to 4096",
            });
        }
        if !(1..=256).contains(&self.intra_op_parallelism) {
            return Err(AioError::InvalidConfig {
                name: "intra_op_parallelism",
                value: self.intra_op_parallelism.to_string(),
                expected: "1 to 256",
            });
        }
        Ok(())
    }

    /// Threads the thread-pool backend runs.
    pub fn pool_threads(&self) -> usize {
        (self.queue_depth * self.intra_op_parallelism).clamp(1, MAX_POOL_THREADS)
    }
}
