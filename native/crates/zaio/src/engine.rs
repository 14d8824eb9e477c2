//! The engine: resolves the backend, starts the workers, splits submitted
//! requests into pieces and hands out their results.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use crate::config::{AioConfig, BackendKind};
use crate::error::{AioError, Op};
use crate::request::{self, Completions, Request, WorkQueue};
use crate::{backend_threads, backend_uring, file};

/// Counters since the engine started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub requests: u64,
    pub bytes: u64,
    /// Requests that opened an O_DIRECT descriptor for their aligned middle.
    pub direct: u64,
    /// Requests whose file refused O_DIRECT and ran buffered.
    pub direct_refused: u64,
    /// Requests whose caller buffer was misaligned and went through bounce buffers.
    pub bounced: u64,
    /// The latest O_DIRECT refusal, with the path.
    pub last_direct_refused: Option<String>,
}

/// An async file-IO engine. Dropping it waits for every request in flight.
pub struct Engine {
    cfg: AioConfig,
    backend: BackendKind,
    reason: String,
    queue: Arc<WorkQueue>,
    done: Arc<Completions>,
    next_id: AtomicU64,
    stats: Mutex<Stats>,
    workers: Vec<JoinHandle<()>>,
}

impl Engine {
    /// Validates `cfg`, picks the backend (recording why) and starts workers.
    pub fn new(cfg: AioConfig) -> Result<Engine, AioError> {
        cfg.validate()?;
        let queue = Arc::new(WorkQueue::default());
        let (backend, reason, rings) = match cfg.backend {
            BackendKind::Threads => (BackendKind::Threads, "requested".to_string(), Vec::new()),
            kind => {
                let rings: Result<Vec<_>, _> = (0..cfg.intra_op_parallelism)
                    .map(|_| backend_uring::new_ring(cfg.queue_depth))
                    .collect();
                match (rings, kind) {
                    (Ok(r), BackendKind::IoUring) => (BackendKind::IoUring, "requested".into(), r),
                    (Ok(r), _) => (
                        BackendKind::IoUring,
                        "auto: io_uring_setup succeeded".into(),
                        r,
                    ),
                    (Err((reason, errno)), BackendKind::IoUring) => {
                        return Err(AioError::BackendUnavailable { reason, errno })
                    }
                    (Err((why, _)), _) => {
                        (BackendKind::Threads, format!("auto: {why}"), Vec::new())
                    }
                }
            }
        };
        let mut engine = Engine {
            cfg: cfg.clone(),
            backend,
            reason,
            queue: Arc::clone(&queue),
            done: Arc::new(Completions::default()),
            next_id: AtomicU64::new(1),
            stats: Mutex::new(Stats::default()),
            workers: Vec::new(),
        };
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(AioError::Spawn)
        };
        if backend == BackendKind::IoUring {
            for (i, ring) in rings.into_iter().enumerate() {
                let (q, c) = (Arc::clone(&queue), cfg.clone());
                let w = spawn(
                    format!("zaio-uring-{i}"),
                    Box::new(move || backend_uring::worker(ring, q, c)),
                )?;
                engine.workers.push(w);
            }
        } else {
            for i in 0..cfg.pool_threads() {
                let (q, block) = (Arc::clone(&queue), cfg.block_size);
                let w = spawn(
                    format!("zaio-io-{i}"),
                    Box::new(move || backend_threads::worker(q, block)),
                )?;
                engine.workers.push(w);
            }
        }
        Ok(engine)
    }

    /// The backend running: `io_uring` or `threads`.
    pub fn backend(&self) -> BackendKind {
        self.backend
    }

    /// Why this backend: `requested`, or what `auto` found.
    pub fn backend_reason(&self) -> &str {
        &self.reason
    }

    pub fn config(&self) -> &AioConfig {
        &self.cfg
    }

    pub fn stats(&self) -> Stats {
        self.stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Starts reading `len` bytes at `offset` of `path` into `buf`, or writing
    /// them from `buf`. Opening the file happens here, so a missing file or a
    /// denied directory is returned now; IO errors come from [`Engine::wait`].
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid (and, for reads, not be accessed) until
    /// `wait` has returned this request's result or the engine is dropped.
    pub unsafe fn submit(
        &self,
        op: Op,
        path: &Path,
        buf: *mut u8,
        len: usize,
        offset: u64,
    ) -> Result<u64, AioError> {
        if offset
            .checked_add(len as u64)
            .is_none_or(|e| e > i64::MAX as u64)
        {
            return Err(AioError::InvalidConfig {
                name: "offset",
                value: format!("{offset} + {len} bytes"),
                expected: "an end offset below 2^63",
            });
        }
        let want_direct = request::has_aligned_middle(offset, len);
        let files = file::open(op, path, offset, len, want_direct)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        {
            let mut st = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
            st.requests += 1;
            st.bytes += len as u64;
            if files.direct.is_some() {
                st.direct += 1;
            }
            if let Some(why) = &files.direct_refused {
                st.direct_refused += 1;
                st.last_direct_refused = Some(why.clone());
            }
            let mid = offset.next_multiple_of(crate::ALIGN as u64) - offset;
            if files.direct.is_some() && !(buf as usize + mid as usize).is_multiple_of(crate::ALIGN)
            {
                st.bounced += 1;
            }
        }
        let req = Arc::new(Request {
            id,
            op,
            path: path.to_path_buf(),
            files,
            buf: buf as usize,
            len,
            offset,
            remaining: Default::default(),
            error: Default::default(),
            done: Arc::clone(&self.done),
        });
        self.done.register(id);
        let pieces = request::plan(&req, self.cfg.block_size);
        if pieces.is_empty() {
            // Nothing to transfer; a write still syncs the (possibly new) file.
            req.complete();
        } else {
            self.queue.push_all(pieces);
        }
        Ok(id)
    }

    /// Blocks until request `id` finishes; its byte count or error.
    pub fn wait(&self, id: u64) -> Result<usize, AioError> {
        self.done.wait(id)
    }

    /// Waits for every request not yet waited on; each id with its result.
    pub fn wait_all(&self) -> Vec<(u64, Result<usize, AioError>)> {
        self.done
            .ids()
            .into_iter()
            .map(|id| (id, self.done.wait(id)))
            .collect()
    }

    /// Reads `buf.len()` bytes at `offset` of `path`, blocking.
    pub fn read(&self, path: &Path, buf: &mut [u8], offset: u64) -> Result<usize, AioError> {
        // SAFETY: `buf` is borrowed mutably until `wait` returns below.
        let id = unsafe { self.submit(Op::Read, path, buf.as_mut_ptr(), buf.len(), offset)? };
        self.wait(id)
    }

    /// Writes `buf` at `offset` of `path` and syncs it, blocking.
    pub fn write(&self, path: &Path, buf: &[u8], offset: u64) -> Result<usize, AioError> {
        // SAFETY: writes only read the buffer; it is borrowed until `wait` returns.
        let id =
            unsafe { self.submit(Op::Write, path, buf.as_ptr().cast_mut(), buf.len(), offset)? };
        self.wait(id)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Buffers of requests in flight must not be written after the caller frees them.
        drop(self.wait_all());
        self.queue.close();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
