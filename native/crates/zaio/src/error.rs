//! The one error type of the IO engine. Every variant that touches a file
//! carries the path, the file offset and (when the kernel gave one) the errno,
//! so the binding can raise an `OSError` subclass with `errno` set.

use std::path::PathBuf;

use thiserror::Error;

/// Read or write, as named in messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
        }
    }
}

#[derive(Debug, Error)]
pub enum AioError {
    /// The file (or a directory above it) does not exist: ENOENT.
    #[error("{op} `{path}` at offset {offset}: no such file or directory (ENOENT); check the path, and for writes that its directory exists", op = .op.name(), path = .path.display())]
    NotFound { op: Op, path: PathBuf, offset: u64 },

    /// The file or its directory may not be opened for this operation: EACCES / EPERM.
    #[error("{op} `{path}` at offset {offset}: permission denied (errno {errno}); make the file and its directory {need} for this user", op = .op.name(), path = .path.display(), need = if matches!(.op, Op::Read) { "readable" } else { "writable" })]
    PermissionDenied {
        op: Op,
        path: PathBuf,
        offset: u64,
        errno: i32,
    },

    /// The file system is full: ENOSPC.
    #[error("write `{path}` at offset {offset} ({len} bytes): no space left on device (ENOSPC); free space or point the swap directory at a larger file system", path = .path.display())]
    NoSpace {
        path: PathBuf,
        offset: u64,
        len: usize,
    },

    /// The write would pass the process's file-size limit or the file system's: EFBIG.
    #[error("write `{path}` at offset {offset} ({len} bytes): file too large (EFBIG); raise `ulimit -f` (RLIMIT_FSIZE) or use a file system that allows files this large", path = .path.display())]
    FileTooLarge {
        path: PathBuf,
        offset: u64,
        len: usize,
    },

    /// The file ended before the requested range did. Never zero-filled.
    #[error("read `{path}` at offset {offset}: wanted {len} bytes but the file is {file_size} bytes long; the file is shorter than the tensor, so it was written with another size or truncated", path = .path.display())]
    ShortRead {
        path: PathBuf,
        offset: u64,
        len: usize,
        eof_at: u64,
        file_size: u64,
    },

    /// Any other failed system call on a file.
    #[error("{op} `{path}` at offset {offset}: {call} failed: {source}", op = .op.name(), path = .path.display())]
    Io {
        op: Op,
        path: PathBuf,
        offset: u64,
        call: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// A configuration value out of range.
    #[error("invalid aio {name} = {value}: expected {expected}")]
    InvalidConfig {
        name: &'static str,
        value: String,
        expected: &'static str,
    },

    /// io_uring was requested explicitly but cannot be used here.
    #[error(
        "io_uring backend requested but unavailable: {reason}; use backend `threads` or `auto`"
    )]
    BackendUnavailable { reason: String, errno: Option<i32> },

    /// `wait` on an id this engine never returned or already waited on.
    #[error("no pending request with id {0}; each id can be waited on once")]
    UnknownRequest(u64),

    /// A worker thread could not be started.
    #[error("cannot start an IO worker thread: {0}")]
    Spawn(std::io::Error),
}

impl AioError {
    /// The errno a Python `OSError` should carry, if the kernel reported one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            AioError::NotFound { .. } => Some(libc::ENOENT),
            AioError::PermissionDenied { errno, .. } => Some(*errno),
            AioError::NoSpace { .. } => Some(libc::ENOSPC),
            AioError::FileTooLarge { .. } => Some(libc::EFBIG),
            AioError::Io { source, .. } => source.raw_os_error(),
            AioError::BackendUnavailable { errno, .. } => *errno,
            AioError::Spawn(e) => e.raw_os_error(),
            AioError::ShortRead { .. }
            | AioError::InvalidConfig { .. }
            | AioError::UnknownRequest(_) => None,
        }
    }

    /// The file a failed request named, if any.
    pub fn path(&self) -> Option<&std::path::Path> {
        match self {
            AioError::NotFound { path, .. }
            | AioError::PermissionDenied { path, .. }
            | AioError::NoSpace { path, .. }
            | AioError::FileTooLarge { path, .. }
            | AioError::ShortRead { path, .. }
            | AioError::Io { path, .. } => Some(path),
            _ => None,
        }
    }

    /// The file offset of the failed request (or piece of it), if any.
    pub fn offset(&self) -> Option<u64> {
        match self {
            AioError::NotFound { offset, .. }
            | AioError::PermissionDenied { offset, .. }
            | AioError::NoSpace { offset, .. }
            | AioError::FileTooLarge { offset, .. }
            | AioError::ShortRead { offset, .. }
            | AioError::Io { offset, .. } => Some(*offset),
            _ => None,
        }
    }

    /// Classifies a failed system call on `path` by its errno.
    pub(crate) fn from_errno(
        op: Op,
        path: PathBuf,
        offset: u64,
        len: usize,
        call: &'static str,
        errno: i32,
    ) -> AioError {
        match errno {
            libc::ENOENT => AioError::NotFound { op, path, offset },
            libc::EACCES | libc::EPERM | libc::EROFS => AioError::PermissionDenied {
                op,
                path,
                offset,
                errno,
            },
            libc::ENOSPC => AioError::NoSpace { path, offset, len },
            libc::EFBIG => AioError::FileTooLarge { path, offset, len },
            _ => AioError::Io {
                op,
                path,
                offset,
                call,
                source: std::io::Error::from_raw_os_error(errno),
            },
        }
    }
}
