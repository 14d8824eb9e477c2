//! Every error kind, produced by the kernel on real files: ENOENT, EACCES,
//! ENOSPC (/dev/full), EFBIG (RLIMIT_FSIZE in a child process), short reads,
//! bad configuration and bad request ids.

mod common;

use std::process::Command;

use common::{backends, engine, pattern, Scratch};
use zaio::{AioConfig, AioError, AlignedBuffer, BackendKind, Engine, Op};

#[test]
fn missing_file_is_not_found_with_path_offset_errno() {
    for backend in backends() {
        let dir = Scratch::new("enoent");
        let e = engine(backend, 1 << 20, 8);
        let p = dir.path("nope.bin");
        let mut buf = vec![0u8; 100];
        let err = e.read(&p, &mut buf, 4096).unwrap_err();
        assert!(
            matches!(err, AioError::NotFound { offset: 4096, .. }),
            "{err:?}"
        );
        assert_eq!(err.errno(), Some(libc::ENOENT));
        assert_eq!(err.path(), Some(p.as_path()));
        let msg = err.to_string();
        assert!(
            msg.contains("nope.bin") && msg.contains("offset 4096"),
            "{msg}"
        );
        // A write into a directory that does not exist fails at open too.
        let err = e.write(&dir.path("no-dir/x"), &buf, 0).unwrap_err();
        assert!(matches!(err, AioError::NotFound { .. }), "{err:?}");
    }
}

#[test]
fn unwritable_directory_is_permission_denied() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        // Root bypasses mode bits (CAP_DAC_OVERRIDE); the Python tests cover
        // EACCES by dropping privileges in a child process.
        eprintln!("skipping: running as root, EACCES cannot trigger");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = Scratch::new("eacces");
    let ro = dir.path("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o500)).unwrap();
    let e = engine(BackendKind::Threads, 1 << 20, 8);
    let err = e.write(&ro.join("x"), &[1u8; 10], 0).unwrap_err();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o700)).unwrap();
    assert!(matches!(err, AioError::PermissionDenied { .. }), "{err:?}");
    assert_eq!(err.errno(), Some(libc::EACCES));
}

#[test]
fn short_read_is_an_error_never_zero_filled() {
    for backend in backends() {
        let dir = Scratch::new("short");
        let e = engine(backend, 64 << 10, 8);
        let p = dir.path("short");
        std::fs::write(&p, pattern(10_000, 1)).unwrap();
        for (off, n) in [
            (0u64, 10_001usize),
            (0, 1 << 20),
            (8192, 4096),
            (20_000, 10),
        ] {
            let mut buf = AlignedBuffer::unlocked(n).unwrap();
            let err = e.read(&p, buf.as_mut_slice(), off).unwrap_err();
            match &err {
                AioError::ShortRead {
                    file_size, offset, ..
                } => {
                    assert_eq!((*file_size, *offset), (10_000, off));
                }
                other => panic!("{backend:?} ({off}, {n}): expected ShortRead, got {other:?}"),
            }
            assert!(
                err.to_string().contains("the file is 10000 bytes long"),
                "{err}"
            );
        }
    }
}

#[test]
fn full_device_is_no_space() {
    let full = std::path::Path::new("/dev/full");
    if !full.exists() {
        eprintln!("skipping: no /dev/full");
        return;
    }
    for backend in backends() {
        let e = engine(backend, 1 << 20, 8);
        let mut buf = AlignedBuffer::unlocked(1 << 20).unwrap();
        buf.as_mut_slice().fill(1);
        let err = e.write(full, buf.as_slice(), 0).unwrap_err();
        assert!(
            matches!(err, AioError::NoSpace { .. }),
            "{backend:?}: {err:?}"
        );
        assert_eq!(err.errno(), Some(libc::ENOSPC));
        assert!(err.to_string().contains("/dev/full"));
    }
}

/// Runs in a child process (see `file_size_limit_is_file_too_large`): with
/// RLIMIT_FSIZE at 64 KiB, a 1 MiB write must fail with EFBIG.
#[test]
fn efbig_child() {
    let Ok(target) = std::env::var("ZAIO_EFBIG_TARGET") else {
        return;
    };
    let backend: BackendKind = std::env::var("ZAIO_EFBIG_BACKEND")
        .unwrap()
        .parse()
        .unwrap();
    // SAFETY: plain syscalls on this process; SIGXFSZ ignored so the write returns EFBIG.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let lim = libc::rlimit {
            rlim_cur: 64 << 10,
            rlim_max: 64 << 10,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
    let e = engine(backend, 1 << 20, 8);
    let mut buf = AlignedBuffer::unlocked((1 << 20) + 5).unwrap();
    buf.as_mut_slice().fill(3);
    let r = e.write(std::path::Path::new(&target), buf.as_slice(), 0);
    let err = r.expect_err("write past RLIMIT_FSIZE must not report success");
    assert!(matches!(err, AioError::FileTooLarge { .. }), "{err:?}");
    assert_eq!(err.errno(), Some(libc::EFBIG));
    assert!(err.to_string().contains(&target));
}

#[test]
fn file_size_limit_is_file_too_large() {
    let exe = std::env::current_exe().unwrap();
    for backend in backends() {
        let dir = Scratch::new("efbig");
        let target = dir.path("big.bin");
        let out = Command::new(&exe)
            .args(["--exact", "efbig_child", "--nocapture", "--test-threads=1"])
            .env("ZAIO_EFBIG_TARGET", &target)
            .env("ZAIO_EFBIG_BACKEND", backend.name())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{backend:?} child failed:\n{text}");
        assert!(text.contains("1 passed"), "{text}");
    }
}

#[test]
fn bad_config_names_the_key_and_the_range() {
    for (cfg, key) in [
        (
            AioConfig {
                block_size: 1000,
                ..AioConfig::default()
            },
            "block_size = 1000",
        ),
        (
            AioConfig {
                queue_depth: 0,
                ..AioConfig::default()
            },
            "queue_depth = 0",
        ),
        (
            AioConfig {
                intra_op_parallelism: 0,
                ..AioConfig::default()
            },
            "intra_op_parallelism = 0",
        ),
    ] {
        let err = Engine::new(cfg).err().expect("rejected");
        assert!(err.to_string().contains(key), "{err}");
    }
    let err = "io-uring".parse::<BackendKind>().unwrap_err();
    assert!(err.to_string().contains("`auto`, `io_uring`, `threads`"));
}

#[test]
fn each_id_is_waited_once() {
    let dir = Scratch::new("ids");
    let e = engine(BackendKind::Threads, 1 << 20, 8);
    let buf = [5u8; 10];
    // SAFETY: `buf` lives until the wait.
    let id =
        unsafe { e.submit(Op::Write, &dir.path("f"), buf.as_ptr().cast_mut(), 10, 0) }.unwrap();
    assert_eq!(e.wait(id).unwrap(), 10);
    assert!(matches!(e.wait(id), Err(AioError::UnknownRequest(i)) if i == id));
    assert!(matches!(e.wait(999), Err(AioError::UnknownRequest(999))));
}

#[test]
fn aligned_buffer_is_aligned_zeroed_and_reports_lock() {
    for n in [0usize, 1, 4097, 3 << 20] {
        let b = AlignedBuffer::new(n).unwrap();
        assert_eq!(b.as_ptr() as usize % zaio::ALIGN, 0);
        assert_eq!(b.len(), n);
        assert!(b.as_slice().iter().all(|&x| x == 0));
    }
    // Past RLIMIT_MEMLOCK (8 MiB for unprivileged users) mlock fails: still a buffer.
    let big: Vec<AlignedBuffer> = (0..4)
        .map(|_| AlignedBuffer::new(4 << 20).unwrap())
        .collect();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert!(
            big.iter().any(|b| !b.locked()),
            "16 MiB cannot all be locked"
        );
    }
    assert!(!AlignedBuffer::unlocked(4096).unwrap().locked());
}
