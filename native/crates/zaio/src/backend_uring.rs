//! The io_uring backend: each worker owns one ring of `queue_depth` entries,
//! pulls pieces from the shared queue while it has free slots, and reaps
//! completions. Bounce pieces (misaligned caller buffers) run blocking on the
//! worker, one block at a time; a partial completion is finished blocking.

use std::io;
use std::sync::Arc;

use io_uring::{opcode, types, IoUring};

use crate::backend_threads::{eof_or_stuck, run_blocking};
use crate::config::AioConfig;
use crate::error::{AioError, Op};
use crate::request::{Mode, Piece, WorkQueue};

/// Why io_uring cannot be used here, from the errno of `io_uring_setup`.
pub fn explain_setup_error(e: &io::Error) -> String {
    let errno = e.raw_os_error().unwrap_or(0);
    let (name, why) = match errno {
        libc::EPERM => ("EPERM", "seccomp or kernel.io_uring_disabled"),
        libc::ENOSYS => (
            "ENOSYS",
            "kernel without io_uring (needs Linux 5.1+) or seccomp",
        ),
        libc::ENOMEM => ("ENOMEM", "locked-memory limit too low for the ring"),
        libc::EMFILE => ("EMFILE", "out of file descriptors"),
        libc::EINVAL => ("EINVAL", "ring size or flags refused by this kernel"),
        _ => ("errno", "see `man 2 io_uring_setup`"),
    };
    format!("io_uring_setup failed: {name} {errno} ({why})")
}

/// Creates a ring of `entries`, or says why not.
pub fn new_ring(entries: usize) -> Result<IoUring, (String, Option<i32>)> {
    IoUring::new(entries as u32).map_err(|e| (explain_setup_error(&e), e.raw_os_error()))
}

/// Whether io_uring works here: a 1-entry ring is created and closed.
pub fn probe() -> Result<(), (String, Option<i32>)> {
    new_ring(1).map(drop)
}

fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
    )
}

fn sqe_for(p: &Piece, slot: usize) -> io_uring::squeue::Entry {
    let fd = types::Fd(p.fd());
    let entry = match p.req.op {
        Op::Read => opcode::Read::new(fd, p.ptr(), p.len as u32)
            .offset(p.file_off)
            .build(),
        Op::Write => opcode::Write::new(fd, p.ptr().cast_const(), p.len as u32)
            .offset(p.file_off)
            .build(),
    };
    entry.user_data(slot as u64)
}

/// Completes a piece from its CQE result (`res` bytes, or `-errno`).
fn on_complete(p: Piece, res: i32, bounce: &mut Option<crate::AlignedBuffer>, block: usize) {
    let r = if res < 0 {
        let errno = -res;
        if matches!(errno, libc::EINTR | libc::EAGAIN) {
            run_blocking(&p, 0, bounce, block)
        } else {
            let call = if p.req.op == Op::Read {
                "io_uring read"
            } else {
                "io_uring write"
            };
            Err(AioError::from_errno(
                p.req.op,
                p.req.path.clone(),
                p.file_off,
                p.len,
                call,
                errno,
            ))
        }
    } else if res as usize >= p.len {
        Ok(())
    } else if res == 0 {
        Err(eof_or_stuck(&p.req, p.file_off, p.len))
    } else {
        // Partial: finish the rest blocking (short reads at end of file are found there).
        run_blocking(&p, res as usize, bounce, block)
    };
    p.req.finish_piece(r);
}

/// One ring's worker, until the queue closes and its ring is empty.
pub(crate) fn worker(mut ring: IoUring, queue: Arc<WorkQueue>, cfg: AioConfig) {
    let qd = cfg.queue_depth;
    let mut slots: Vec<Option<Piece>> = (0..qd).map(|_| None).collect();
    let mut free: Vec<usize> = (0..qd).rev().collect();
    let mut bounce = None;
    loop {
        // Fill free slots; block for work only when nothing is in flight.
        while let Some(&slot) = free.last() {
            let piece = if free.len() == qd {
                match queue.pop() {
                    Some(p) => p,
                    None => return,
                }
            } else {
                match queue.try_pop() {
                    Some(p) => p,
                    None => break,
                }
            };
            if piece.mode == Mode::Bounce {
                let r = run_blocking(&piece, 0, &mut bounce, cfg.block_size);
                piece.req.finish_piece(r);
                continue;
            }
            let sqe = sqe_for(&piece, slot);
            // SAFETY: the buffer and fds live in `piece`, kept in `slots` until its CQE.
            // The SQ has at least `qd` entries and at most `qd` are outstanding.
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                // Unreachable by construction; run it blocking rather than lose it.
                let r = run_blocking(&piece, 0, &mut bounce, cfg.block_size);
                piece.req.finish_piece(r);
                continue;
            }
            free.pop();
            slots[slot] = Some(piece);
            if cfg.single_submit {
                while let Err(e) = ring.submit() {
                    if !is_transient(&e) {
                        break;
                    }
                }
            }
        }
        let in_flight = qd - free.len();
        if in_flight == 0 {
            continue;
        }
        let want = if cfg.overlap_events { 1 } else { in_flight };
        if let Err(e) = ring.submit_and_wait(want) {
            if !is_transient(&e) {
                // io_uring_enter itself failed (not an IO error): report it on every
                // piece in flight. This does not happen with a working ring.
                for (slot, entry) in slots.iter_mut().enumerate() {
                    if let Some(p) = entry.take() {
                        free.push(slot);
                        let r = Err(AioError::Io {
                            op: p.req.op,
                            path: p.req.path.clone(),
                            offset: p.file_off,
                            call: "io_uring_enter",
                            source: io::Error::new(e.kind(), e.to_string()),
                        });
                        p.req.finish_piece(r);
                    }
                }
                continue;
            }
        }
        let done: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (slot, res) in done {
            if let Some(p) = slots.get_mut(slot).and_then(Option::take) {
                free.push(slot);
                on_complete(p, res, &mut bounce, cfg.block_size);
            }
        }
    }
}
